"""The approximate admission counter (``counter: sketch``): error, memory, state."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from estuary.config.errors import ConfigError
from estuary.config.spec import AdmissionSpec, SparseOptimizerSpec, TableSpec
from estuary.embedding import EmbeddingTable
from estuary.embedding.admission import AdmissionFilter
from estuary.embedding.admission_sketch import SketchAdmissionFilter


def _filter(
    min_count: int = 2, hashes: int = 6, max_pending_ids: int = 1 << 20
) -> SketchAdmissionFilter:
    spec = AdmissionSpec(min_count=min_count, sketch_hashes=hashes)
    return SketchAdmissionFilter(spec, seed=3, max_pending_ids=max_pending_ids)


def _false_admission_rate(filt: SketchAdmissionFilter, batches: int) -> float:
    # Every id is new (random 62-bit): any admission is a false one.
    rng = np.random.default_rng(1)
    admitted = seen = 0
    for _ in range(batches):
        ids = rng.integers(0, 2**62, 4096, dtype=np.int64)
        admitted += filt.observe(ids).size
        seen += ids.size
    return admitted / seen


def test_false_admissions_stay_near_the_documented_rate_and_fall_with_more_hashes() -> None:
    # Documented: about 0.5 ** hashes per layer, two layers; ~2% at 6 hashes.
    six = _false_admission_rate(_filter(hashes=6, max_pending_ids=1 << 16), 100)
    three = _false_admission_rate(_filter(hashes=3, max_pending_ids=1 << 16), 100)
    assert six < 0.03
    assert three > 2 * six


def test_ids_seen_often_enough_are_admitted_at_once() -> None:
    # Count-min never undercounts: within a generation, the sighting that brings
    # an id to min_count admits it (as the exact counter does).
    for min_count in (2, 3, 5, 17):
        filt = _filter(min_count=min_count)
        exact = AdmissionFilter(AdmissionSpec(min_count=min_count, counter="exact"), seed=3)
        ids = np.arange(1, 3001, dtype=np.int64) * 7919
        for _ in range(min_count - 1):
            assert filt.observe(ids).size <= ids.size * 0.03  # only false admissions
            assert exact.observe(ids).size == 0
        np.testing.assert_array_equal(np.intersect1d(filt.observe(ids), ids), ids)


def test_memory_is_bounded_and_small_tables_stay_small() -> None:
    bound = 4096
    filt = _filter(max_pending_ids=bound)
    tiny = _filter()
    tiny.observe(np.arange(5, dtype=np.int64))
    assert tiny.nbytes <= 2048  # a table with 5 ids: one 1 KiB layer
    rng = np.random.default_rng(0)
    for _ in range(200):
        filt.observe(rng.integers(0, 2**62, 1000, dtype=np.int64))
    # Two layers of at most bound * hashes / ln 2 one-bit counters, in 64 B blocks.
    layer = -(-bound * 6 / np.log(2) // 512) * 64
    assert filt.nbytes <= 2 * layer
    assert filt.aged > 0


def test_decisions_do_not_depend_on_the_order_inside_a_call() -> None:
    rng = np.random.default_rng(2)
    batches = [rng.integers(0, 5000, 800, dtype=np.int64) for _ in range(30)]
    a, b = _filter(min_count=3), _filter(min_count=3)
    for ids in batches:
        np.testing.assert_array_equal(a.observe(ids), b.observe(ids[::-1].copy()))


def test_state_round_trip_through_safetensors_resumes_bit_for_bit(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    stream = [rng.integers(0, 200_000, 2000, dtype=np.int64) for _ in range(120)]
    source = _filter(max_pending_ids=1 << 13)
    for ids in stream[:60]:
        source.observe(ids)
    assert source.aged > 0  # the state spans a rotation
    path = tmp_path / "sketch.safetensors"
    save_file(source.state_dict(), str(path))
    resumed = _filter(max_pending_ids=1 << 13)
    resumed.load_state_dict(load_file(str(path)))
    for ids in stream[60:]:
        np.testing.assert_array_equal(resumed.observe(ids), source.observe(ids))
    for key, value in source.state_dict().items():
        np.testing.assert_array_equal(resumed.state_dict()[key], value)


def _table(shards: int, **admission: object) -> EmbeddingTable:
    spec = TableSpec(
        dim=4,
        shards=shards,
        optimizer=SparseOptimizerSpec(name="sgd", lr=0.1),
        admission=AdmissionSpec(min_count=2, **admission),  # type: ignore[arg-type]
    )
    return EmbeddingTable(spec, seed=5, name="t")


def test_resharded_sketch_keeps_every_pending_sighting() -> None:
    four = _table(4)
    once = np.arange(1, 4001, dtype=np.int64) * 104729
    four.lookup(once, train=True)
    assert len(four) < 0.03 * once.size  # false admissions only
    three = _table(3)
    three.load_state_dict(four.state_dict())
    three.lookup(once, train=True)  # the second sighting, in other shards
    assert len(three) == once.size


def test_exact_pending_counts_load_into_a_sketch_table() -> None:
    exact = _table(1, counter="exact")
    ids = np.arange(1, 501, dtype=np.int64)
    exact.lookup(ids, train=True)
    assert len(exact) == 0 and exact.stats().pending_ids == ids.size
    sketch = _table(2)
    sketch.load_state_dict(exact.state_dict())
    sketch.lookup(ids, train=True)
    assert len(sketch) == ids.size


def test_table_bytes_count_the_sketch() -> None:
    table = _table(1)
    before = table.stats().bytes
    table.lookup(np.arange(100_000, dtype=np.int64), train=True)
    sketch = table.shards[0]._admission
    assert isinstance(sketch, SketchAdmissionFilter) and sketch.nbytes > 1024
    assert table.stats().bytes >= before - 1024 + sketch.nbytes
    assert table.stats().pending_ids == pytest.approx(100_000, rel=0.1)


@pytest.mark.parametrize(
    ("fields", "path"),
    [
        ({"sketch_hashes": 0}, "t.sketch_hashes"),
        ({"sketch_hashes": 8}, "t.sketch_hashes"),
        ({"min_count": 300}, "t.min_count"),
    ],
)
def test_bad_sketch_settings_name_the_field(fields: dict[str, int], path: str) -> None:
    with pytest.raises(ConfigError, match=path.replace(".", r"\.")):
        AdmissionSpec(**fields).validate("t")  # type: ignore[arg-type]
    if path == "t.min_count":
        AdmissionSpec(counter="exact", **fields).validate("t")  # type: ignore[arg-type]
