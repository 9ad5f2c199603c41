"""Tables with 16-bit weights (``dtype: fp16 | bf16``): training follows the fp32
table, memory halves, checkpoints keep the stored dtype, loading across dtypes
warns."""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from estuary.config.errors import ConfigError
from estuary.config.spec import InitializerSpec, SparseOptimizerSpec, TableSpec
from estuary.config.tables import merge_table
from estuary.embedding import (
    EmbeddingShard,
    EmbeddingTable,
    half_updates,
    optimizers,
    row_formats,
)
from estuary.embedding.files import read_state, write_state
from estuary.embedding.precision import decode

DIM = 16
SPEC = TableSpec(
    dim=DIM,
    initializer=InitializerSpec("uniform", 0.1),
    optimizer=SparseOptimizerSpec(name="rowwise_adagrad", lr=0.05),
)


def train(table: EmbeddingTable, steps: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    target = np.random.default_rng(99).normal(0, 0.3, (200, DIM)).astype(np.float32)
    for _ in range(steps):
        ids = np.unique(rng.integers(0, 200, size=64)).astype(np.int64)
        rows = table.lookup(ids, train=True)
        table.apply_gradients(ids, rows - target[ids])  # pull rows towards a target


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize(
    "optimizer", ["rowwise_adagrad", "rowwise_adagrad_elem", "adagrad", "adam"]
)
def test_16_bit_training_follows_the_fp32_table(dtype: str, optimizer: str) -> None:
    opt = SparseOptimizerSpec(name=optimizer, lr=0.05)
    ref = EmbeddingTable(replace(SPEC, optimizer=opt), seed=3, name="t")
    half = EmbeddingTable(replace(SPEC, optimizer=opt, dtype=dtype), seed=3, name="t")
    before = ref.lookup(np.arange(200, dtype=np.int64), train=False)
    train(ref, 300)
    train(half, 300)
    ids = np.arange(200, dtype=np.int64)
    got, want = half.lookup(ids, train=False), ref.lookup(ids, train=False)
    assert got.dtype == np.float32
    moved = np.abs(want - before).mean()
    # The rows moved by ~0.2 on average; 16-bit rows end near the fp32 ones: on
    # average within a rounding step (bf16's is 2**-9 at 0.1-0.25), at worst a
    # few (measured: bf16 mean 7e-4-1.1e-3, max 0.011-0.023; fp16 ~8x closer).
    assert moved > 0.1
    diff = np.abs(got - want)
    step = 2.0**-9 if dtype == "bf16" else 2.0**-12
    assert diff.mean() < 1.5 * step
    assert diff.max() < 16 * step


def test_bf16_rows_take_half_the_weight_bytes() -> None:
    fp32 = EmbeddingShard(replace(SPEC, initial_capacity_rows=4096), seed=0, name="t")
    bf16 = EmbeddingShard(replace(SPEC, initial_capacity_rows=4096, dtype="bf16"), seed=0, name="t")
    # Rows of D=16 rowwise_adagrad: 16 weights + 1 accumulator, 4-byte words.
    assert fp32._storage.array.shape[1] * 4 == 68
    assert bf16._storage.array.shape[1] * 4 == 36
    assert bf16.stats().bytes < fp32.stats().bytes


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_checkpoint_file_keeps_the_stored_dtype(dtype: str, tmp_path: Path) -> None:
    table = EmbeddingTable(replace(SPEC, dtype=dtype, shards=2), seed=1, name="t")
    train(table, 5)
    state = table.state_dict()
    path = tmp_path / "t.safetensors"
    write_state(path, state)
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    assert header["weights"]["dtype"] == {"bf16": "BF16", "fp16": "F16"}[dtype]
    assert header["opt.accum"]["dtype"] == "F32"  # optimizer state stays float32
    loaded = read_state(path)
    assert loaded["weights"].dtype == state["weights"].dtype
    np.testing.assert_array_equal(loaded["weights"], state["weights"])
    restored = EmbeddingTable(replace(SPEC, dtype=dtype, shards=3), seed=1, name="t")
    restored.load_state_dict(loaded)
    ids = np.arange(200, dtype=np.int64)
    np.testing.assert_array_equal(restored.lookup(ids, train=False), table.lookup(ids, train=False))


def test_loading_across_dtypes_warns_and_rounds_to_the_table_dtype(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fp32 = EmbeddingShard(SPEC, seed=1, name="clicks")
    ids = np.arange(50, dtype=np.int64)
    want = fp32.lookup(ids, train=True)
    bf16 = EmbeddingShard(replace(SPEC, dtype="bf16"), seed=1, name="clicks")
    with caplog.at_level(logging.WARNING):
        bf16.load_state_dict(fp32.state_dict())
    warned = [r.message for r in caplog.records]
    assert len(warned) == 1  # once per load, not per key
    assert "'clicks'" in warned[0] and "fp32" in warned[0] and "bf16" in warned[0]
    got = bf16.lookup(ids, train=False)
    assert bf16.state_dict()["weights"].dtype == np.uint16
    np.testing.assert_allclose(got, want, rtol=2.0**-8)  # nearest bf16
    caplog.clear()
    back = EmbeddingShard(SPEC, seed=1, name="clicks")
    with caplog.at_level(logging.WARNING):
        back.load_state_dict(bf16.state_dict())
    assert any("bf16" in r.message and "fp32" in r.message for r in caplog.records)
    np.testing.assert_array_equal(back.lookup(ids, train=False), got)  # exact up-cast


def test_same_dtype_loads_do_not_warn(caplog: pytest.LogCaptureFixture) -> None:
    a = EmbeddingShard(replace(SPEC, dtype="bf16"), seed=1, name="t")
    a.lookup(np.arange(10, dtype=np.int64), train=True)
    with caplog.at_level(logging.WARNING):
        EmbeddingShard(replace(SPEC, dtype="bf16"), seed=1, name="t").load_state_dict(
            a.state_dict()
        )
    assert not caplog.records


def test_an_unknown_dtype_is_a_config_error_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"model\.embedding\.tables\.C1\.dtype"):
        merge_table(TableSpec(), {"dtype": "fp8"}, "model.embedding.tables.C1")


@pytest.mark.parametrize("name", ["rowwise_adagrad", "rowwise_adagrad_elem"])
def test_fused_bf16_rowwise_adagrad_gives_the_bits_of_the_generic_path(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    assert (type(optimizers.make_optimizer(SparseOptimizerSpec(name=name), 7)), "bf16") in (
        half_updates.FUSED_HALF_UPDATES
    )
    opt = SparseOptimizerSpec(name=name, lr=0.05, weight_decay=0.1, clip=0.3)
    spec = replace(SPEC, dim=7, optimizer=opt, dtype="bf16")

    def trained() -> dict[str, np.ndarray]:
        shard = EmbeddingShard(spec, seed=1, name="t")
        rng = np.random.default_rng(0)
        for _ in range(20):
            ids = np.unique(rng.integers(0, 300, 100)).astype(np.int64)
            shard.lookup(ids, train=True)
            grads = rng.normal(size=(ids.size, 7)).astype(np.float32)
            grads[0, 0] = np.nan  # NaN and inf weights round alike on both paths
            grads[1, 1] = np.inf
            shard.apply_gradients(ids, grads, lr_scale=0.7)
        return shard.state_dict()

    fused = trained()
    monkeypatch.setattr(half_updates, "FUSED_HALF_UPDATES", {})
    monkeypatch.setattr(row_formats, "FUSED_HALF_UPDATES", {})
    generic = trained()
    for key in [k for k in fused if k == "weights" or k.startswith(("opt.", "unknown."))]:
        np.testing.assert_array_equal(fused[key], generic[key], err_msg=key)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_fused_row_init_rounds_new_rows_as_the_generic_fill(dtype: str) -> None:
    ids = np.arange(-500, 500, 7, dtype=np.int64)
    fused = EmbeddingShard(replace(SPEC, dtype=dtype), seed=4, name="t")
    generic = EmbeddingShard(replace(SPEC, dtype=dtype), seed=4, name="t")
    generic._fused_init = False  # Initializer.fill + RowFormat.fill, then claim
    np.testing.assert_array_equal(fused.lookup(ids, train=True), generic.lookup(ids, train=True))
    a, b = fused.state_dict(), generic.state_dict()
    for key in ("weights", "opt.accum", "unknown.weights"):
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def _fused_bf16_step(
    weights: np.ndarray, grads: np.ndarray, ids: np.ndarray, key: int
) -> tuple[np.ndarray, np.ndarray]:
    """One fused bf16 row-wise Adagrad step of rows holding ``weights`` (float32,
    bf16-exact) from a zero accumulator: the stored bf16 bits, and the float32
    values the fp32 kernel computes for the same rows (the exact pre-rounding
    values: both kernels share the arithmetic)."""
    n, dim = grads.shape
    rows = np.arange(n, dtype=np.int64)
    words = dim // 2
    storage = np.zeros((n, words + 1), np.float32)
    bits = storage.view(np.uint16)
    bits[:, :dim] = (weights.view(np.uint32) >> 16).astype(np.uint16)
    half_updates._rowwise_adagrad_bf16_kernel(
        storage, bits, rows, ids, grads, words, np.uint64(key), 0.05, 1e-8, 1.0, np.inf
    )
    exact = np.zeros((n, dim + 1), np.float32)
    exact[:, :dim] = weights
    optimizers._rowwise_adagrad_kernel(exact, rows, grads, dim, 0.05, 1e-8, 1.0, np.inf)
    np.testing.assert_array_equal(storage[:, words], exact[:, dim])  # same accumulator
    return bits[:, :dim].copy(), exact[:, :dim]


def test_fused_bf16_update_rounds_stochastically_without_bias_and_reproducibly() -> None:
    # 20,000 rows with the same weights and gradients: each row's rounding has
    # its own random bits (its id), so per element the mean of the stored values
    # is the float32 update within a few standard errors (0.5 ulp / sqrt(n)).
    n, dim = 20_000, 16
    rng = np.random.default_rng(3)
    w0 = decode(
        (rng.normal(0, 0.1, dim).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    )
    weights = np.tile(w0, (n, 1))
    grads = np.tile(rng.normal(0, 0.01, dim).astype(np.float32), (n, 1))
    ids = rng.choice(10**9, n, replace=False).astype(np.int64)
    bits, exact = _fused_bf16_step(weights, grads, ids, key=11)
    got = decode(bits).astype(np.float64)
    want = exact[0].astype(np.float64)
    lo = decode((want.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)).astype(
        np.float64
    )
    hi = decode(((want.astype(np.float32).view(np.uint32) >> 16) + 1).astype(np.uint16))
    ulp = np.abs(hi.astype(np.float64) - lo)
    assert np.all((got == lo) | (got == hi))  # a neighbour of the float32 value
    assert np.all(ulp > 0) and np.any(np.abs(want - lo) > 0.1 * ulp)  # not all exact
    assert np.all(np.abs(got.mean(axis=0) - want) < 5 * 0.5 * ulp / np.sqrt(n))
    # Deterministic for a key; other keys round otherwise.
    again, _ = _fused_bf16_step(weights, grads, ids, key=11)
    other, _ = _fused_bf16_step(weights, grads, ids, key=12)
    np.testing.assert_array_equal(bits, again)
    assert np.count_nonzero(bits != other) > n * dim // 10
