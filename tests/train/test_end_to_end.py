"""A tiny job end to end: train -> summary.json -> checkpoint -> `estuary eval`
gives the same AUC; the Python API with a custom module; bad rows counted."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import estuary
from estuary.cli import main

DENSE = [f"I{i}" for i in range(1, 14)]
SPARSE = [f"C{i}" for i in range(1, 27)]


def write_criteo(
    path: Path, rows: int, seed: int = 0, bad_lines: dict[int, str] | None = None
) -> None:
    """Synthetic Criteo-format rows whose label depends on C1 and I1."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(rows):
        c1 = int(rng.integers(0, 40))
        i1 = int(rng.integers(0, 20))
        p = 1 / (1 + np.exp(-(((c1 % 4) - 1.5) * 1.5 + (i1 - 10) * 0.15)))
        label = int(rng.random() < p)
        dense = [str(i1)] + [
            str(int(rng.integers(0, 5))) if rng.random() > 0.2 else "" for _ in range(12)
        ]
        cats = [f"{c1:08x}"] + [f"{int(rng.integers(0, 50)):08x}" for _ in range(25)]
        lines.append("\t".join([str(label), *dense, *cats]))
    for index, text in (bad_lines or {}).items():
        lines.insert(index, text)
    path.write_text("\n".join(lines) + "\n")


def write_job(tmp_path: Path, data: Path, **train: object) -> Path:
    job = {
        "data": {
            "sources": [{"path": data.name, "format": "criteo_tsv"}],
            "schema": {"label": "label", "dense": DENSE, "sparse": SPARSE},
            "eval_fraction": 0.2,
        },
        "model": {
            "type": "dlrm",
            "params": {"bottom_mlp": [16, 8], "top_mlp": [16]},
            "embedding": {"default": {"dim": 8, "optimizer": {"name": "adagrad", "lr": 0.1}}},
        },
        "train": {"batch_size": 64, "epochs": 2, "seed": 1, **train},
        "output": {"dir": "out", "progress": False},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_train_writes_summary_and_checkpoint_that_eval_reproduces(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_criteo(tmp_path / "train.tsv", 1500)
    job = write_job(tmp_path, tmp_path / "train.tsv")
    assert main(["train", str(job), "--no-progress"]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    for key in (
        "auc",
        "logloss",
        "train_rows",
        "eval_rows",
        "bad_rows",
        "samples_per_s",
        "wall_s",
        "mode",
    ):
        assert key in summary
    assert summary["train_rows"] == 2 * 1200 and summary["eval_rows"] == 300
    assert summary["bad_rows"] == 0 and summary["mode"] == "sync"
    assert summary["auc"] > 0.65  # the planted signal is learnt
    capsys.readouterr()

    assert main(["eval", str(job), "--checkpoint", str(tmp_path / "out")]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["auc"] == pytest.approx(summary["auc"], abs=1e-9)
    assert printed["logloss"] == pytest.approx(summary["logloss"], abs=1e-9)


def test_output_flag_and_set_override(tmp_path: Path) -> None:
    write_criteo(tmp_path / "train.tsv", 400)
    job = write_job(tmp_path, tmp_path / "train.tsv")
    out = tmp_path / "elsewhere"
    assert (
        main(["train", str(job), "--no-progress", "--output", str(out), "--set", "train.epochs=1"])
        == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["train_rows"] == 320 and summary["epochs"] == 1


def test_bad_rows_are_counted_and_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_criteo(tmp_path / "train.tsv", 600, bad_lines={5: "1\tnot-a-number", 9: "x" + "\t" * 39})
    job = write_job(tmp_path, tmp_path / "train.tsv", epochs=1)
    assert main(["train", str(job), "--no-progress", "--set", "data.max_bad_row_ratio=0.01"]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["bad_rows"] == 2
    assert summary["train_rows"] + summary["eval_rows"] == 600


def test_too_many_bad_rows_fail_with_a_clear_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_criteo(tmp_path / "train.tsv", 100, bad_lines={i: "1\tbad" for i in range(0, 40, 2)})
    job = write_job(tmp_path, tmp_path / "train.tsv", epochs=1)
    assert main(["train", str(job), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "train.tsv" in err


def test_no_rows_to_train_fails_naming_the_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "empty.tsv"
    data.write_text("")
    assert main(["train", str(write_job(tmp_path, data)), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "warning: empty.tsv: no data rows\n" in err  # one line, no Python source
    assert "error: data.sources: no rows to train on (0 good rows" in err
    assert "files read: empty.tsv" in err
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_resuming_a_changed_job_warns_or_names_what_no_longer_fits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "train.tsv"
    write_criteo(data, 300)
    job = str(write_job(tmp_path, data, epochs=1))
    assert main(["train", job, "--no-progress"]) == 0
    capsys.readouterr()
    # Another optimizer: restores, warns, and that optimizer's state starts fresh.
    changed = ["--set", "train.dense_optimizer.name=sgd"]
    changed += ["--set", "model.embedding.default.optimizer.name=adam"]
    assert main(["train", job, "--no-progress", "--resume", *changed]) == 0
    err = capsys.readouterr().err
    assert "dense optimizer adam in the checkpoint, sgd in this job" in err
    assert "26 table(s) (C1, C10," in err and "optimizer adagrad in the checkpoint, adam" in err
    # Another layer size: nothing is restored, the differing parameters are named.
    wider = ["--set", "model.params.top_mlp=[32]"]
    assert main(["train", job, "--no-progress", "--resume", *wider]) == 2
    err = capsys.readouterr().err
    assert "the dense model does not match this job's model" in err
    assert "top.0.weight: shape [16, " in err and "in the checkpoint, [32, " in err


def test_config_error_names_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_criteo(tmp_path / "train.tsv", 50)
    job = write_job(tmp_path, tmp_path / "train.tsv")
    assert main(["train", str(job), "--set", "model.embedding.default.dimm=4"]) == 2
    assert "model.embedding.default.dimm: unknown key" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["hybrid", "async"])
def test_background_sparse_modes_train_every_row(tmp_path: Path, mode: str) -> None:
    write_criteo(tmp_path / "train.tsv", 1500)
    job = estuary.load_job(write_job(tmp_path, tmp_path / "train.tsv", mode=mode, staleness=2))
    result = estuary.Trainer(job).fit(progress=False)
    assert result.train_rows == 2 * 1200
    # Stale reads cost a little accuracy; well above chance is what matters here.
    assert result.auc > 0.6
    if mode == "hybrid":
        assert result.extra["max_staleness_seen"] <= 2


def test_custom_module_trains_through_the_python_api(tmp_path: Path) -> None:
    write_criteo(tmp_path / "train.tsv", 1500)
    job = estuary.load_job(write_job(tmp_path, tmp_path / "train.tsv"), ["output.checkpoint=false"])

    class Flat(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(13 + 26 * 8, 1)

        def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
            return self.linear(torch.cat([dense, sparse.flatten(1)], dim=1)).squeeze(1)

    result = estuary.Trainer(job, model=Flat()).fit(progress=False)
    assert result.auc > 0.65 and result.checkpoint is None
