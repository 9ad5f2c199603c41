"""Synthetic CTR data: reproducible per (seed, hour), Zipf ids, calibrated CTR, a
click model that drifts, files every format and Estuary's own reader can read,
atomic partitions with ``_SUCCESS`` last, bounded memory, the ``synth`` CLI, and
a model that learns from it."""

from __future__ import annotations

import json
import os
import tracemalloc
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq
import pytest

import estuary
from estuary.cli import main
from estuary.config import ConfigError
from estuary.config.spec import DataSpec, SchemaSpec, SourceSpec
from estuary.data import TabularDataset, hash_feature
from estuary.data.synthetic import (
    SyntheticSpec,
    SynthOutput,
    chunk_table,
    epoch_hour,
    generate_chunks,
    model_for,
    partition_dir,
    write_partition,
    write_synthetic,
    writers,
)

START = datetime(2026, 1, 1, tzinfo=UTC)
SMALL = SyntheticSpec(
    rows_per_hour=1500, hours=3, start=START, vocab_sizes=(1000,) * 26, chunk_rows=512, seed=3
)


def hour_rows(spec: SyntheticSpec, hour: int, start: int = 0, stop: int | None = None) -> pa.Table:
    """Rows of hour number ``hour`` of the spec, as one Arrow table."""
    chunks = generate_chunks(spec, spec.start_hour + hour, start, stop)
    return pa.concat_tables([chunk_table(c, ("row_id", "event_time_ms")) for c in chunks])


def auc(score: np.ndarray, labels: np.ndarray) -> float:
    ranks = np.empty(score.shape[0])
    ranks[np.argsort(score, kind="stable")] = np.arange(1, score.shape[0] + 1)
    pos = labels == 1
    n1, n0 = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def part_files(root: Path) -> list[Path]:
    return sorted(root.glob("*/*/part-*"))


# -- reproducibility -------------------------------------------------------------------


def test_an_hour_is_the_same_whatever_the_order_chunking_or_workers(tmp_path: Path) -> None:
    write_synthetic(SMALL, tmp_path / "forward")
    hours = list(reversed(SMALL.epoch_hours()))
    write_synthetic(replace(SMALL, chunk_rows=333), tmp_path / "parallel", workers=2, hours=hours)
    alone = replace(SMALL, start=datetime(2026, 1, 1, 2, tzinfo=UTC), hours=1, chunk_rows=4096)
    write_partition(alone, tmp_path / "alone", SynthOutput(), alone.start_hour)

    third = "20260101/02/part-00000.tsv"
    expected = (tmp_path / "forward" / third).read_bytes()
    assert (tmp_path / "parallel" / third).read_bytes() == expected
    assert (tmp_path / "alone" / third).read_bytes() == expected
    for a, b in zip(
        part_files(tmp_path / "forward"), part_files(tmp_path / "parallel"), strict=True
    ):
        assert a.read_bytes() == b.read_bytes()

    # A slice of an hour is that slice of the whole hour.
    assert hour_rows(SMALL, 1, 700, 900).equals(hour_rows(SMALL, 1).slice(700, 200))
    assert not hour_rows(replace(SMALL, seed=4), 1).equals(hour_rows(SMALL, 1))


def test_row_ids_and_event_times_are_unique_and_ordered() -> None:
    hour0, hour1 = hour_rows(SMALL, 0), hour_rows(SMALL, 1)
    ids = np.concatenate([hour0["row_id"].to_numpy(), hour1["row_id"].to_numpy()])
    assert np.array_equal(np.diff(ids), np.ones(ids.shape[0] - 1))  # consecutive across hours
    assert ids[0] == epoch_hour(START) * SMALL.rows_per_hour
    times = hour1["event_time_ms"].to_numpy()
    hour_ms = (epoch_hour(START) + 1) * 3_600_000
    assert np.all(np.diff(times) >= 0) and times[0] == hour_ms and times[-1] < hour_ms + 3_600_000


# -- what the data looks like ----------------------------------------------------------


def test_ids_are_zipf_distributed_with_a_long_tail() -> None:
    spec = SyntheticSpec(rows_per_hour=100_000, vocab_sizes=(10**6,), num_dense=0, missing_rate=0)
    ids = np.concatenate([c.sparse[:, 0] for c in generate_chunks(spec, spec.start_hour)])
    counts = np.sort(np.unique(ids, return_counts=True)[1])[::-1] / ids.shape[0]
    a = 1 - spec.zipf_exponent
    top = (2**a - 1) / ((10**6 + 1) ** a - 1)  # P(rank 1) under the continuous law
    assert counts[0] == pytest.approx(top, rel=0.05)  # the head is frequent ...
    assert counts[:100].sum() > 0.35
    ranks = np.arange(5, 100)
    slope = np.polyfit(np.log(ranks), np.log(counts[4:99]), 1)[0]
    assert slope == pytest.approx(-spec.zipf_exponent, abs=0.1)  # ... a power law ...
    assert np.mean(counts * ids.shape[0] == 1) > 0.6  # ... and most ids are seen once


@pytest.mark.parametrize("base_ctr", [0.22, 0.05])
def test_mean_label_over_a_day_is_the_base_ctr(base_ctr: float) -> None:
    spec = SyntheticSpec(rows_per_hour=4000, base_ctr=base_ctr, label_noise=0.01, seed=11)
    labels = [c.labels for h in range(24) for c in generate_chunks(spec, spec.start_hour + h)]
    assert np.concatenate(labels).mean() == pytest.approx(base_ctr, abs=0.01)


def per_value_scorer(table: pa.Table, names: list[str]) -> Callable[[pa.Table], np.ndarray]:
    """Fit the simplest CTR model on ``table``: a sum of smoothed per-value log-odds."""
    labels = table["label"].to_numpy().astype(np.float64)
    prior = labels.mean()
    fitted = []
    for name in names:
        values, inverse = np.unique(table[name].to_numpy(zero_copy_only=False), return_inverse=True)
        clicks, seen = np.bincount(inverse, weights=labels), np.bincount(inverse)
        log_odds = np.log((clicks + 10 * prior) / (seen - clicks + 10 * (1 - prior)))
        fitted.append((values, np.append(log_odds - np.log(prior / (1 - prior)), 0.0)))

    def score(rows: pa.Table) -> np.ndarray:
        total = np.zeros(rows.num_rows)
        for name, (values, log_odds) in zip(names, fitted, strict=True):
            column = rows[name].to_numpy(zero_copy_only=False)
            at = np.searchsorted(values, column).clip(max=values.shape[0] - 1)
            total += log_odds[np.where(values[at] == column, at, -1)]  # unseen value: 0
        return total

    return score


@pytest.mark.parametrize("drift", [0.0, 1.0])
def test_a_model_of_hour_0_degrades_on_hour_47_only_when_the_model_drifts(drift: float) -> None:
    spec = SyntheticSpec(
        rows_per_hour=30_000,
        vocab_sizes=(50,) * 4,
        num_dense=0,
        num_interactions=0,
        zipf_exponent=1.0,
        drift=drift,
        drift_fraction=1.0,
        diurnal_amplitude=0.0,
        missing_rate=0.0,
        signal_scale=1.5,
    )
    names = spec.sparse_names()
    score = per_value_scorer(hour_rows(spec, 0, 0, 20_000), names)
    same_hour, later = hour_rows(spec, 0, 20_000, 30_000), hour_rows(spec, 47, 0, 10_000)
    auc_now = auc(score(same_hour), same_hour["label"].to_numpy())
    auc_later = auc(score(later), later["label"].to_numpy())
    assert auc_now > 0.75
    if drift:
        assert auc_now - auc_later > 0.15
    else:
        assert abs(auc_now - auc_later) < 0.03


def test_drifting_weights_move_smoothly_and_decorrelate() -> None:
    spec = SyntheticSpec(drift=1.0, drift_fraction=1.0, drift_period_hours=24, seed=5)
    model, ranks = model_for(spec), np.arange(5000, dtype=np.uint64)
    w = {h: model.value_weights(0, ranks, spec.start_hour + h) for h in (0, 1, 48)}
    assert np.corrcoef(w[0], w[1])[0, 1] > 0.95
    assert np.corrcoef(w[0], w[48])[0, 1] < 0.7
    still = model_for(replace(spec, drift=0.0))
    assert np.array_equal(still.value_weights(0, ranks, 0), still.value_weights(0, ranks, 999))


# -- files -----------------------------------------------------------------------------


def read_back(path: Path, fmt: str, names: list[str]) -> pa.Table:
    """Any output file as an all-string table (nulls where values are missing)."""
    if fmt == "parquet":
        table = pq.read_table(path)
    elif fmt == "jsonl":
        table = pajson.read_json(path)
    else:
        table = pacsv.read_csv(
            path,
            pacsv.ReadOptions(column_names=None if fmt == "csv" else names),
            pacsv.ParseOptions(delimiter="\t" if fmt == "criteo_tsv" else ","),
            pacsv.ConvertOptions(
                column_types=dict.fromkeys(names, pa.string()), strings_can_be_null=True
            ),
        )
    return table.select(names).cast(pa.schema([(n, pa.string()) for n in names]))


@pytest.mark.parametrize("gzip", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("fmt", ["criteo_tsv", "csv", "parquet", "jsonl"])
def test_every_format_holds_the_generated_values(tmp_path: Path, fmt: str, gzip: bool) -> None:
    spec = replace(SMALL, hours=1)
    extra = ("row_id", "event_time_ms")
    output = SynthOutput(format=fmt, gzip=gzip, extra_columns=extra)
    report = write_synthetic(spec, tmp_path, output)
    (path,) = part_files(tmp_path)
    assert report.files == 1 and report.rows == spec.rows_per_hour
    assert path.name == output.file_name(0)
    assert path.name.endswith(".gz") == (gzip and fmt != "parquet")
    expected = hour_rows(spec, 0)
    names = expected.column_names
    assert read_back(path, fmt, names).equals(
        expected.cast(pa.schema([(n, pa.string()) for n in names]))
    )


@pytest.mark.parametrize("fmt", ["criteo_tsv", "csv"])
def test_tabular_dataset_reads_the_partitions(tmp_path: Path, fmt: str) -> None:
    write_synthetic(SMALL, tmp_path, SynthOutput(format=fmt, gzip=True))
    schema = SchemaSpec(dense=SMALL.dense_names(), sparse=SMALL.sparse_names())
    source = SourceSpec(path="*/*/part-*", format=fmt)  # type: ignore[arg-type]
    ds = TabularDataset(DataSpec(sources=[source], schema=schema, eval_fraction=0.0), tmp_path)
    expected = pa.concat_tables([hour_rows(SMALL, h) for h in range(SMALL.hours)])
    assert ds.num_rows == SMALL.rows_per_hour * SMALL.hours and ds.bad_rows.count == 0
    assert ds.labels.tolist() == expected["label"].to_pylist()
    counts = np.stack([expected[n].fill_null(0).to_numpy() for n in SMALL.dense_names()], 1)
    np.testing.assert_allclose(ds.dense, np.log1p(counts), rtol=1e-6)
    for f, name in enumerate(SMALL.sparse_names()):
        assert np.array_equal(ds.ids[:, f], hash_feature(expected[name], name))


def test_success_marker_is_written_after_every_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    renamed: list[str] = []
    real_replace = os.replace

    def recording_replace(src: str | Path, dst: str | Path) -> None:
        renamed.append(Path(dst).relative_to(tmp_path).as_posix())
        real_replace(src, dst)

    monkeypatch.setattr(writers.os, "replace", recording_replace)
    write_synthetic(replace(SMALL, hours=2), tmp_path, SynthOutput(files_per_hour=3))
    for hour in ("20260101/00", "20260101/01"):
        mine = [r for r in renamed if r.startswith(hour)]
        assert mine[-1] == f"{hour}/_SUCCESS" and len(mine) == 4
        marker = json.loads((tmp_path / hour / "_SUCCESS").read_text())
        assert marker["rows"] == SMALL.rows_per_hour and len(marker["files"]) == 3
    assert not list(tmp_path.rglob(".*"))  # no temporary files left behind
    lines = [p.read_bytes().count(b"\n") for p in part_files(tmp_path)]
    assert lines == [500] * 6  # 1500 rows per hour in 3 parts


def test_finished_hours_are_skipped_unless_overwriting(tmp_path: Path) -> None:
    first = write_synthetic(SMALL, tmp_path)
    assert first.rows == 4500 and first.skipped == 0
    again = write_synthetic(SMALL, tmp_path)
    assert again.rows == 0 and again.skipped == SMALL.hours
    (tmp_path / "20260101/01/_SUCCESS").unlink()  # an interrupted hour is redone
    assert write_synthetic(SMALL, tmp_path).rows == SMALL.rows_per_hour
    assert write_synthetic(SMALL, tmp_path, SynthOutput(overwrite=True)).rows == 4500


def test_path_pattern_tokens_and_config_errors_name_the_field(tmp_path: Path) -> None:
    pattern = "dt={{YYYY}}-{{MM}}-{{DD}}/hour={HH}"
    assert (
        partition_dir(tmp_path, pattern, SMALL.start_hour + 25)
        == tmp_path / "dt=2026-01-02/hour=01"
    )
    with pytest.raises(ConfigError, match=r"^output\.path_pattern: unknown token \{day\}"):
        write_synthetic(SMALL, tmp_path, SynthOutput(path_pattern="{day}"))
    with pytest.raises(ConfigError, match=r"^synthetic\.vocab_sizes\[1\]: must be in"):
        replace(SMALL, vocab_sizes=(10, 0)).validate()
    with pytest.raises(ConfigError, match=r"^output\.format: unknown format 'orc'"):
        SynthOutput(format="orc").validate()


def test_memory_is_bounded_by_one_chunk(tmp_path: Path) -> None:
    def peak_bytes(rows: int, chunk_rows: int) -> int:
        spec = replace(SMALL, rows_per_hour=rows, chunk_rows=chunk_rows, hours=1)
        model_for(spec).bias  # noqa: B018 - calibrate (a fixed cost) before measuring
        tracemalloc.start()
        try:
            part = write_partition(spec, tmp_path / f"{chunk_rows}", SynthOutput(), spec.start_hour)
            assert part.rows == rows
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    whole_hour, chunked = peak_bytes(10_000, 10_000), peak_bytes(10_000, 500)
    assert chunked < whole_hour / 5  # ~0.8 KB per row of the chunk, whatever the hour's size
    assert all(c.num_rows <= 1000 for c in generate_chunks(replace(SMALL, chunk_rows=1000), 0))


# -- CLI and training ------------------------------------------------------------------


def test_synth_command_writes_partitions_and_reports_throughput(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["synth", str(tmp_path), "--rows-per-hour", "400", "--hours", "2", "--gzip"]
    argv += ["--start", "2026-02-03T22", "--vocab-sizes", "100", "--with-ids", "--seed", "9"]
    assert main(argv) == 0
    assert "rows/s" in capsys.readouterr().out
    files = [p.relative_to(tmp_path).as_posix() for p in part_files(tmp_path)]
    assert files == ["20260203/22/part-00000.tsv.gz", "20260203/23/part-00000.tsv.gz"]
    assert (tmp_path / "20260203/23/_SUCCESS").exists()
    assert main(["synth", str(tmp_path), "--rows-per-hour", "0"]) == 2
    assert "synthetic.rows_per_hour: must be > 0" in capsys.readouterr().err


@pytest.mark.slow
def test_trainer_learns_the_click_model(tmp_path: Path) -> None:
    spec = replace(SMALL, rows_per_hour=2000, vocab_sizes=(50,) * 26, signal_scale=2.0, seed=1)
    write_synthetic(spec, tmp_path / "data")
    job = estuary.job_from_dict(
        {
            "data": {
                "sources": [{"path": "data/*/*/part-*.tsv", "format": "criteo_tsv"}],
                "schema": {"dense": spec.dense_names(), "sparse": spec.sparse_names()},
                "eval_fraction": 0.2,
            },
            "model": {
                "type": "dlrm",
                "params": {"bottom_mlp": [16, 8], "top_mlp": [16]},
                "embedding": {"default": {"dim": 8, "optimizer": {"name": "adagrad", "lr": 0.1}}},
            },
            "train": {"batch_size": 128, "epochs": 2, "seed": 0},
            "output": {"dir": "out", "progress": False, "checkpoint": False},
        },
        base_dir=tmp_path,
    )
    result = estuary.Trainer(job).fit(progress=False)  # ~0.3 s, plus torch's first-use warm-up
    assert result.train_rows == 2 * 4800
    assert result.auc > 0.65, result.auc  # the click model's ceiling here is ~0.8
