"""Tables with a memory budget and a disk tier: same training, bounded memory,
checkpoints and deltas over both tiers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from estuary.config.errors import ConfigError
from estuary.config.spec import (
    DiskSpec,
    EvictionSpec,
    InitializerSpec,
    SparseOptimizerSpec,
    TableSpec,
)
from estuary.embedding import EmbeddingTable
from estuary.embedding.disk_tier import memory_rows
from estuary.metrics.evaluation import evaluate_predictions

DIM = 8
VOCAB = 12_000


def _spec(memory_bytes: int | None, shards: int = 1, path: str | None = None) -> TableSpec:
    return TableSpec(
        dim=DIM,
        shards=shards,
        initializer=InitializerSpec("normal", 0.01),
        optimizer=SparseOptimizerSpec(name="adagrad", lr=0.1),
        disk=DiskSpec(memory_bytes=memory_bytes, path=path),
    )


def _budget_for(rows: int) -> int:
    # The bytes whose derived capacity is ``rows`` memory rows (adagrad fp32: V = 2 D).
    return int(rows * (4 * 2 * DIM + 16 + 16 / 0.75)) + 1


def _batches(seed: int, steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    # Zipf ids, each with a hidden weight; label ~ Bernoulli(sigmoid(weight)).
    rng = np.random.default_rng(seed)
    truth = np.random.default_rng(99).normal(0, 2, VOCAB)
    out = []
    for _ in range(steps):
        ids = (rng.zipf(1.2, 256) - 1) % VOCAB
        labels = (rng.random(256) < 1 / (1 + np.exp(-truth[ids]))).astype(np.float64)
        out.append((ids.astype(np.int64), labels))
    return out


def _train(table: EmbeddingTable, batches: list[tuple[np.ndarray, np.ndarray]]) -> None:
    # Logistic regression on the sum of each id's row; one step per batch.
    for ids, labels in batches:
        uniq, inverse = np.unique(ids, return_inverse=True)
        rows = table.lookup(uniq, train=True)
        p = 1 / (1 + np.exp(-rows[inverse].sum(axis=1)))
        g = np.zeros((uniq.size, DIM), np.float32)
        np.add.at(g, inverse, np.repeat((p - labels)[:, None], DIM, axis=1).astype(np.float32))
        table.apply_gradients(uniq, g)


def _auc(table: EmbeddingTable, batches: list[tuple[np.ndarray, np.ndarray]]) -> float:
    ids = np.concatenate([b[0] for b in batches])
    labels = np.concatenate([b[1] for b in batches])
    p = 1 / (1 + np.exp(-table.lookup(ids, train=False).sum(axis=1)))
    return evaluate_predictions(labels, p).auc


def test_a_table_four_times_its_budget_trains_as_the_in_memory_table() -> None:
    train, held_out = _batches(0, 400), _batches(1, 40)
    memory = EmbeddingTable(_spec(None), seed=3, name="t")
    _train(memory, train)
    held = len(memory)
    budget = _budget_for(held // 4)
    tiered = EmbeddingTable(_spec(budget), seed=3, name="t")
    _train(tiered, train)
    stats = tiered.stats()
    assert stats.rows == held and stats.disk_rows >= 3 * (held - stats.disk_rows) - 16
    auc_memory, auc_tiered = _auc(memory, held_out), _auc(tiered, held_out)
    assert auc_memory > 0.6  # the task is learnable
    assert abs(auc_tiered - auc_memory) <= 0.001
    every = np.arange(VOCAB, dtype=np.int64)  # in fact the same rows, bit for bit
    np.testing.assert_array_equal(
        tiered.lookup(every, train=False), memory.lookup(every, train=False)
    )
    # Memory: the budget, plus the stated overhead: the disk index (16 B / load per
    # disk row at load >= 0.6, and its free list) and the admission sketch / logs.
    overhead = 28 * stats.disk_rows + 8192
    assert stats.bytes <= budget + overhead
    assert stats.disk_reads > 0 and stats.disk_writes > 0 and stats.disk_bytes > 0
    assert 0 < stats.memory_hit_rate < 1 and memory.stats().memory_hit_rate == 1


def test_memory_rows_follow_the_budget() -> None:
    assert memory_rows(_budget_for(1000), 2 * DIM, 1) == 1000
    assert memory_rows(_budget_for(1000), 2 * DIM, 4) == 250


def _trained_tiered(tmp_path: Path, shards: int = 1) -> EmbeddingTable:
    table = EmbeddingTable(_spec(_budget_for(300), shards, str(tmp_path)), seed=5, name="t")
    _train(table, _batches(2, 150))
    assert table.stats().disk_rows > 2 * (len(table) - table.stats().disk_rows)
    return table


@pytest.mark.parametrize("shards", [1, 2])
def test_checkpoint_of_a_tiered_table_holds_both_tiers_and_resumes(
    tmp_path: Path, shards: int
) -> None:
    source = _trained_tiered(tmp_path, shards)
    path = tmp_path / "t.safetensors"
    save_file(source.state_dict(), str(path))
    state = load_file(str(path))
    assert state["ids"].size == len(source)
    every = np.arange(VOCAB, dtype=np.int64)
    for spec in (_spec(_budget_for(300), shards, str(tmp_path)), _spec(None)):
        restored = EmbeddingTable(spec, seed=5, name="t")
        restored.load_state_dict(state)
        assert len(restored) == len(source)
        np.testing.assert_array_equal(
            restored.lookup(every, train=False), source.lookup(every, train=False)
        )
    resumed = EmbeddingTable(_spec(_budget_for(300), shards, str(tmp_path)), seed=5, name="t")
    resumed.load_state_dict(state)
    loaded = resumed.stats()  # loaded back within the budget, memory too
    assert loaded.disk_rows > 0
    assert loaded.bytes <= _budget_for(300) + 28 * loaded.disk_rows + 8192 * shards
    more = _batches(3, 60)
    _train(source, more)
    _train(resumed, more)
    np.testing.assert_array_equal(
        resumed.lookup(every, train=False), source.lookup(every, train=False)
    )


def test_deltas_carry_rows_of_both_tiers(tmp_path: Path) -> None:
    source = _trained_tiered(tmp_path)
    replica = EmbeddingTable(_spec(_budget_for(300), 1, str(tmp_path)), seed=5, name="t")
    replica.load_state_dict(source.state_dict())
    every = np.arange(VOCAB, dtype=np.int64)
    for seed in (4, 5):
        _train(source, _batches(seed, 40))  # rows move between the tiers
        source.remove(every[::97])  # some from memory, some from disk
        delta = source.delta_state_dict()
        assert delta["ids"].size < len(source)  # a delta, not a full state
        replica.apply_delta(delta)
        assert len(replica) == len(source)
        np.testing.assert_array_equal(
            replica.lookup(every, train=False), source.lookup(every, train=False)
        )


@pytest.mark.parametrize(
    ("table", "field"),
    [
        ({"disk": DiskSpec(memory_bytes=100)}, "t.disk.memory_bytes"),
        (
            {"disk": DiskSpec(memory_bytes=1 << 20), "eviction": EvictionSpec(capacity_rows=5)},
            "t.disk.memory_bytes",
        ),
    ],
)
def test_bad_disk_settings_name_the_field(table: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        TableSpec(**table).validate("t")  # type: ignore[arg-type]


def test_a_call_with_more_disk_rows_than_the_budget_keeps_every_row(tmp_path: Path) -> None:
    table = EmbeddingTable(_spec(_budget_for(100), 1, str(tmp_path)), seed=5, name="t")
    ids = np.arange(1, 1001, dtype=np.int64)
    for start in range(0, ids.size, 50):
        table.lookup(ids[start : start + 50], train=True)
    before = table.lookup(ids, train=False)
    table.lookup(ids, train=True)  # 1000 ids, ~900 on disk, room for 100
    assert len(table) == ids.size and table.stats().admissions == ids.size
    np.testing.assert_array_equal(table.lookup(ids, train=False), before)
