"""Benchmark: one embedding shard per core vs Python-dict tables vs memory bandwidth.

    python bench/ps.py [--json PATH] [--rows 1000000 10000000] [--dims 16 64]
                       [--batch 65536] [--batches 8] [--repeats 3] [--zipf-a 1.05]
                       [--new-frac 0.1] [--fresh] [--optimizer adagrad ...]
                       [--dtypes fp32 bf16] [--tiered-rows 400000] [--clock wall|cpu]

Single thread (NUMBA_NUM_THREADS / OMP threads set to 1 before imports). For
each table size R and dim D: a shard (Adagrad, uniform init) is filled with R
random int64 ids in random order, then timed on ``--batches`` batches of
``--batch`` Zipf(a) draws over those ids, deduplicated per batch (as the data
layer's CompactBatch delivers them). Figures are ids/s, best of ``--repeats``:

  lookup         ``lookup(train=False, out=buf)``, every id present
  get_or_insert  ``lookup(train=True, out=buf)`` on the batches with ``--new-frac``
                 of the ids replaced by never-seen ones (fresh every repeat):
                 probe + insert, init of the new rows (weights and Adagrad
                 state), stamps, and a copy of every id's (D,) row into ``buf``
  update         ``apply_gradients`` (``--optimizer``, default Adagrad) on the batches
beside, measured in the same run on the same rows and batches:
  dict           the Python-dict table: a dict id -> its own float32 (D,) numpy
                 row; per id ``get``, a fresh uniform row for a new id,
                 ``buf[i] = row`` (the fastest of the variants tried: stacking the
                 rows with ``np.stack(out=buf)`` measured 1.2-1.4x slower).
                 Ratio ``get_or_insert_vs_dict`` (the issue's floor: >= 20x)
  dict_index     a stronger baseline: a dict id -> slot over numpy rows;
                 ``setdefault`` per id, uniform init of the new rows, then
                 ``np.take(rows, slots, out=buf, mode="clip")`` (3-5x faster than a
                 fresh ``rows[slots]``). Ratio ``get_or_insert_vs_dict_index``
  gather         numpy ``storage[slots]`` of the batch's full rows (weights + state)
  gather_scatter ``storage[slots]`` then ``storage[slots] = x``: the bytes an update
                 must move, the memory-bandwidth limit for ``update``
and bytes per row (``stats().bytes / rows`` after the timed runs) vs the ideal: the table's own row
layout, weights in the table's dtype plus the optimizer's float32 state
(adagrad fp32 8D, rowwise_adagrad fp32 4D + 4, rowwise_adagrad bf16 2D + 4),
and vs the issue's budget ``1.1 x ideal + 24`` B (index, metadata, slack).

Configurations: every ``--optimizer`` with every ``--dtypes`` (e.g.
``--optimizer rowwise_adagrad --dtypes fp32 bf16``); each has its own shard over
the same ids, timed in the same repeats as the rest (figures
``R<rows>.D<dim>.<optimizer>.<dtype>.<figure>``; unprefixed shard figures are
the first configuration's).

Every side writes each batch's rows into its own output buffer ``buf``
(float32 (N, D), reused by every batch, as a trainer reuses its step buffer),
so none times the first-touch page faults of a fresh array, which on VMs
can cost as much as the whole D=64 gather. ``--fresh`` also times the shard
and ``dict_index`` returning a fresh array per call
(``fresh_get_or_insert_vs_dict_index``; it enlarges the pre-sized tables, so
``bytes_per_row`` grows too). The tables are sized in advance and the rows new
ids will take are touched before timing (steady state: no first-touch page
faults on either side).

``--clock cpu`` times every operation in the process's CPU time instead of wall
time: on a machine shared with other work, run-to-run swings from waiting for a
core drop out (the slowdown of shared caches and memory bandwidth stays; disk
I/O waits drop out too, so the tiered figures read optimistic there).

``--json PATH`` writes ``{"config", "figures", "ratios"}``; ratios are worst cases
over the sizes: ``get_or_insert_vs_dict`` and ``get_or_insert_vs_dict_index``
(min), ``update_time_over_gather_time`` (max; gather_scatter),
``bytes_per_row_over_ideal`` (max, first configuration), ``bytes_per_row_over_budget``
(max over configurations; the issue's floor: <= 1.0) and, when a row-wise Adagrad
(``rowwise_adagrad``, ``rowwise_adagrad_elem``) ran with fp32 and bf16 rows,
``bf16_rowwise_vs_fp32_ids_per_s`` (min over those optimizers, sizes and lookup /
get_or_insert / update; floor >= 0.9).

Disk tier (``--tiered-rows R``, 0 = skip): two shards of the first
configuration at D = the first ``--dims``, one all in memory, one with
``disk.memory_bytes`` for R/4 rows (the table is 4x its budget), both filled
with the same R ids; then ``--batches`` Zipf(a) batches of ``--batch / 4``
draws whose distinct ids (the hot set) fit the budget (figure
``tiered.hot_over_budget``), run once untimed (the tiered shard brings its hot
rows back from disk), then timed as train lookups + ``apply_gradients``, best
of ``--repeats``: ``ratios.tiered_vs_memory_ids_per_s`` (floor >= 0.5). Also
``tiered.memory_hit_rate`` (timed runs) and the tiered shard's bytes.
"""

from __future__ import annotations

import os

for _var in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from estuary.config.spec import (  # noqa: E402
    DiskSpec,
    InitializerSpec,
    SparseOptimizerSpec,
    TableSpec,
)
from estuary.embedding import EmbeddingShard  # noqa: E402
from estuary.embedding.precision import STORED_DTYPES  # noqa: E402

Ids = np.ndarray
_FILL_CHUNK = 1 << 20
# The timer of every timed operation (``--clock``): wall time, or this process's
# CPU time (``time.process_time``: on a machine shared with other work it leaves
# out the time the process waits for a core, not the slowdown of sharing caches
# and memory bandwidth; it also leaves out the disk tier's I/O waits).
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]


def zipf_batches(
    keys: Ids, a: float, draws: int, batches: int, rng: np.random.Generator
) -> list[Ids]:
    """``batches`` arrays of unique ids from ``draws`` Zipf(a) draws over ``keys``
    (rank = position)."""
    cdf = np.cumsum(np.arange(1, keys.size + 1, dtype=np.float64) ** -a)
    cdf /= cdf[-1]
    out = []
    for _ in range(batches):
        ranks = np.minimum(np.searchsorted(cdf, rng.random(draws)), keys.size - 1)
        out.append(rng.permutation(np.unique(keys[ranks])))
    return out


class DictTable:
    """The Python-dict table: id -> its own (D,) row array."""

    def __init__(self, keys: Ids, dim: int, rng: np.random.Generator) -> None:
        self.dim, self.rng, self.scale = dim, rng, 1.0 / np.sqrt(dim)
        self.d: dict[int, np.ndarray] = {}
        for start in range(0, keys.size, _FILL_CHUNK):
            chunk = keys[start : start + _FILL_CHUNK]
            init = rng.uniform(-self.scale, self.scale, (chunk.size, dim)).astype(np.float32)
            self.d.update(zip(chunk.tolist(), init, strict=True))

    def get_or_insert(self, ids: Ids, out: np.ndarray) -> np.ndarray:
        d, get = self.d, self.d.get
        for i, key in enumerate(ids.tolist()):
            row = get(key)
            if row is None:
                row = self.rng.uniform(-self.scale, self.scale, self.dim).astype(np.float32)
                d[key] = row
            out[i] = row
        return out


class DictIndexTable:
    """The stronger baseline: dict id -> slot, numpy rows, uniform init of new rows."""

    def __init__(self, keys: Ids, dim: int, capacity_rows: int, rng: np.random.Generator) -> None:
        self.d: dict[int, int] = dict(zip(keys.tolist(), range(keys.size), strict=True))
        self.rows = np.empty((capacity_rows, dim), np.float32)
        self.scale = 1.0 / np.sqrt(dim)
        self.rng = rng
        for start in range(0, keys.size, _FILL_CHUNK):
            stop = min(start + _FILL_CHUNK, keys.size)
            self.rows[start:stop] = self._init(stop - start)

    def _init(self, n: int) -> np.ndarray:
        return self.rng.uniform(-self.scale, self.scale, (n, self.rows.shape[1])).astype(np.float32)

    def get_or_insert(self, ids: Ids, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``ids`` (N,) -> (N, D) (into ``out`` if given), inserting and
        initialising new ids."""
        d = self.d
        before = len(d)
        sd = d.setdefault
        slots = np.array([sd(k, len(d)) for k in ids.tolist()], np.int64)
        if len(d) > before:
            self.rows[before : len(d)] = self._init(len(d) - before)
        # np.take can write into ``out`` (rows[slots] cannot); mode="clip" (every
        # slot is valid) writes there directly, "raise" buffers a copy (measured
        # 1.4-1.8x slower).
        return np.take(self.rows, slots, axis=0, out=out, mode="clip")


def mixed_batches(
    batches: list[Ids], new_frac: float, repeats: int, rng: np.random.Generator
) -> list[list[Ids]]:
    """Per repeat: the batches with ``new_frac`` of their ids replaced by fresh ones."""
    out = []
    for _ in range(repeats):
        mixed = []
        for b in batches:
            fresh = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, b.size)
            mixed.append(np.where(rng.random(b.size) >= new_frac, b, fresh).astype(np.int64))
        out.append(mixed)
    return out


Config = tuple[str, str]  # (optimizer, dtype)


def config_name(config: Config) -> str:
    """``rowwise_adagrad.bf16``: the figures' key of a configuration."""
    return ".".join(config)


def make_shard(dim: int, config: Config, capacity_rows: int) -> EmbeddingShard:
    """An empty shard of ``config`` with room for ``capacity_rows`` rows."""
    optimizer, dtype = config
    spec = TableSpec(
        dim=dim,
        initializer=InitializerSpec("uniform"),
        optimizer=SparseOptimizerSpec(name=optimizer, lr=0.05),
        initial_capacity_rows=capacity_rows,  # no growth while timed
        dtype=dtype,  # type: ignore[arg-type]
    )
    return EmbeddingShard(spec, seed=0, name="bench")


def ideal_bytes_per_row(shard: EmbeddingShard) -> float:
    """The table's own layout and nothing else: D weights in the table's dtype plus
    the optimizer's float32 state (adagrad fp32: 8D; rowwise_adagrad bf16: 2D + 4)."""
    width, dim = shard._optimizer.width, shard.dim
    return float(dim * np.dtype(STORED_DTYPES[shard.spec.dtype]).itemsize + 4 * (width - dim))


def bench_size(
    rows: int, dim: int, configs: list[Config], args: argparse.Namespace, rng: np.random.Generator
) -> dict[str, float]:
    """All figures for one (R, D); each repeat times every operation of every
    configuration back to back, so the shards, the dict and numpy see the same
    machine load. Unprefixed figures are the first configuration's."""
    keys = np.unique(rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, rows + rows // 8))
    keys = rng.permutation(keys)[:rows].astype(np.int64)  # rank order = random slot order
    batches = zipf_batches(keys, args.zipf_a, args.batch, args.batches, rng)
    # Fresh never-seen ids for every repeat of each get-or-insert variant.
    mixes = mixed_batches(batches, args.new_frac, args.repeats, rng)
    fresh_mixes = mixed_batches(batches, args.new_frac, args.repeats if args.fresh else 0, rng)
    grads = [rng.normal(size=(b.size, dim)).astype(np.float32) for b in batches]
    new_ids = sum(b.size for m in mixes + fresh_mixes for b in m)
    margin = int(1.2 * args.new_frac * new_ids) + 1024
    shards, fill_s = {}, {}
    for config in configs:
        shard = make_shard(dim, config, rows + margin)
        t0 = clock()
        for start in range(0, rows, _FILL_CHUNK):
            shard.lookup(keys[start : start + _FILL_CHUNK], train=True)
        fill_s[config] = clock() - t0
        # Steady state: the rows new ids will take are mapped already (as in a
        # table at capacity reusing evicted slots), so no side times first-touch
        # page faults, which are slow on VMs (~0.3 ms/MB measured here).
        shard._storage.array[rows + 1 :] = 0
        shards[config] = shard
    dict_table = DictTable(keys, dim, rng)
    index_table = DictIndexTable(keys, dim, rows + margin, rng)
    index_table.rows[rows:] = 0
    first = shards[configs[0]]
    storage = first._storage.array
    slots = [first._index.lookup(b) for b in batches]
    # One output buffer per side, reused by every batch (as a trainer reuses its
    # step buffer), mapped before timing.
    most = max(b.size for m in mixes for b in m)
    out_shard = np.zeros((most, dim), np.float32)
    out_dict = np.zeros((most, dim), np.float32)

    def gather_scatter() -> None:
        for s in slots:
            storage[s] = storage[s]

    Run = Callable[[list[Ids], list[Ids]], object]  # (mix, fresh_mix) -> anything
    runs: dict[str, Run] = {
        "gather": lambda *_: [storage[s] for s in slots],
        "dict": lambda mix, _: [dict_table.get_or_insert(b, out_dict[: b.size]) for b in mix],
        "dict_index": lambda mix, _: [
            index_table.get_or_insert(b, out_dict[: b.size]) for b in mix
        ],
        "gather_scatter": lambda *_: gather_scatter(),
    }

    def shard_runs(shard: EmbeddingShard) -> dict[str, Run]:
        return {
            "lookup": lambda *_: [
                shard.lookup(b, train=False, out=out_shard[: b.size]) for b in batches
            ],
            "get_or_insert": lambda mix, _: [
                shard.lookup(b, train=True, out=out_shard[: b.size]) for b in mix
            ],
            "update": lambda *_: [
                shard.apply_gradients(b, g) for b, g in zip(batches, grads, strict=True)
            ],
        }

    for config, shard in shards.items():
        runs.update({f"{config_name(config)}.{k}": r for k, r in shard_runs(shard).items()})
    if args.fresh:
        runs["get_or_insert_fresh"] = lambda _, mix: [first.lookup(b, train=True) for b in mix]
        runs["dict_index_fresh"] = lambda _, mix: [index_table.get_or_insert(b) for b in mix]
    best = dict.fromkeys(runs, float("inf"))
    for mix, fresh_mix in zip(mixes, fresh_mixes or mixes, strict=True):
        for name, run in runs.items():
            t0 = clock()
            run(mix, fresh_mix)
            best[name] = min(best[name], clock() - t0)
    n_ids, n_mixed = sum(b.size for b in batches), sum(b.size for b in mixes[0])
    per_config: dict[str, float] = {}
    for config, shard in shards.items():
        # Memory after the timed runs: the table then holds the new ids its
        # pre-sized capacity was made for (right after the fill, that headroom
        # for the timed inserts, 5-6% of the rows, counted as waste).
        stats = shard.stats()
        c = config_name(config)
        ideal = ideal_bytes_per_row(shard)
        per_config.update(
            {
                f"{c}.lookup_ids_per_s": n_ids / best[f"{c}.lookup"],
                f"{c}.get_or_insert_ids_per_s": n_mixed / best[f"{c}.get_or_insert"],
                f"{c}.update_ids_per_s": n_ids / best[f"{c}.update"],
                f"{c}.bytes_per_row": stats.bytes / stats.rows,
                f"{c}.ideal_bytes_per_row": ideal,
                f"{c}.budget_bytes_per_row": budget_bytes_per_row(ideal),
                f"{c}.fill_rows_per_s": rows / fill_s[config],
            }
        )
    c0 = config_name(configs[0])
    fresh = {}
    if args.fresh:
        fresh = {
            "get_or_insert_fresh_ids_per_s": n_mixed / best["get_or_insert_fresh"],
            "dict_index_fresh_get_or_insert_ids_per_s": n_mixed / best["dict_index_fresh"],
            "fresh_get_or_insert_vs_dict_index": best["dict_index_fresh"]
            / best["get_or_insert_fresh"],
        }
    return {
        "lookup_ids_per_s": per_config[f"{c0}.lookup_ids_per_s"],
        "get_or_insert_ids_per_s": per_config[f"{c0}.get_or_insert_ids_per_s"],
        "dict_get_or_insert_ids_per_s": n_mixed / best["dict"],
        "dict_index_get_or_insert_ids_per_s": n_mixed / best["dict_index"],
        "update_ids_per_s": per_config[f"{c0}.update_ids_per_s"],
        "gather_rows_per_s": n_ids / best["gather"],
        "gather_scatter_rows_per_s": n_ids / best["gather_scatter"],
        "update_time_over_gather_time": best[f"{c0}.update"] / best["gather_scatter"],
        "get_or_insert_vs_dict": best["dict"] / best[f"{c0}.get_or_insert"],
        "get_or_insert_vs_dict_index": best["dict_index"] / best[f"{c0}.get_or_insert"],
        **fresh,
        "bytes_per_row": per_config[f"{c0}.bytes_per_row"],
        "ideal_bytes_per_row": per_config[f"{c0}.ideal_bytes_per_row"],
        "ids_per_batch": n_ids / len(batches),
        "fill_rows_per_s": per_config[f"{c0}.fill_rows_per_s"],
        **per_config,
    }


def bench_tiered(
    rows: int, dim: int, config: Config, args: argparse.Namespace, rng: np.random.Generator
) -> dict[str, float]:
    """The disk-tier figures (module docstring)."""
    keys = rng.permutation(np.unique(rng.integers(1, 2**62, rows + rows // 8)))[:rows]
    keys = keys.astype(np.int64)
    memory = make_shard(dim, config, rows)
    for start in range(0, rows, max(1, rows // 16)):
        memory.lookup(keys[start : start + max(1, rows // 16)], train=True)
    budget_rows = rows // 4
    spec = replace(memory.spec, disk=DiskSpec(memory_bytes=_budget_bytes(budget_rows, memory)))
    anon_before = _rss_anon()
    tiered = EmbeddingShard(replace(spec, initial_capacity_rows=budget_rows), seed=0, name="bench")
    chunk = max(1, budget_rows // 4)  # one call may not bring more new rows than fit
    for start in range(0, rows, chunk):
        tiered.lookup(keys[start : start + chunk], train=True)
    anon_grown = _rss_anon() - anon_before
    assert len(tiered) == len(memory) == rows
    batches = zipf_batches(keys, args.zipf_a, max(1, args.batch // 4), args.batches, rng)
    hot = np.unique(np.concatenate(batches)).size
    grads = [rng.normal(size=(b.size, dim)).astype(np.float32) for b in batches]
    out = np.zeros((max(b.size for b in batches), dim), np.float32)

    def step(shard: EmbeddingShard) -> None:
        for b, g in zip(batches, grads, strict=True):
            shard.lookup(b, train=True, out=out[: b.size])
            shard.apply_gradients(b, g)

    for shard in (memory, tiered):
        step(shard)  # warm: the hot rows come back into the tiered shard's memory
    before = tiered.stats()
    best = {"memory": float("inf"), "tiered": float("inf")}
    for _ in range(args.repeats):
        for name, shard in (("memory", memory), ("tiered", tiered)):
            t0 = clock()
            step(shard)
            best[name] = min(best[name], clock() - t0)
    after = tiered.stats()
    n = sum(b.size for b in batches)
    hits = after.hits - before.hits
    return {
        "tiered.rows": float(rows),
        "tiered.budget_rows": float(budget_rows),
        "tiered.hot_over_budget": hot / budget_rows,
        "tiered.memory_ids_per_s": n / best["memory"],
        "tiered.tiered_ids_per_s": n / best["tiered"],
        "tiered_vs_memory_ids_per_s": best["memory"] / best["tiered"],
        "tiered.memory_hit_rate": (after.memory_hits - before.memory_hits) / hits if hits else 1.0,
        "tiered.disk_rows": float(after.disk_rows),
        "tiered.bytes": float(after.bytes),
        "memory.bytes": float(memory.stats().bytes),
        "tiered.budget_bytes": float(spec.disk.memory_bytes or 0),
        # The process's anonymous resident memory grown while the tiered shard
        # was made and filled (file pages of the tier excluded; -1: not Linux).
        "tiered.rss_anon_growth_bytes": float(anon_grown),
    }


def _rss_anon() -> int:
    # RssAnon of this process in bytes (-1 where /proc is not there).
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


def _budget_bytes(rows: int, shard: EmbeddingShard) -> int:
    # disk.memory_bytes whose derived capacity is ``rows`` (disk_tier.memory_rows).
    return int(rows * (4 * shard._format.stored_width + 16 + 16 / 0.75)) + 1


def budget_bytes_per_row(ideal: float) -> float:
    """The issue's memory budget of a row: 1.1 x its ideal bytes + 24 B (index,
    metadata and growth slack)."""
    return 1.1 * ideal + 24.0


_OPS = ("lookup", "get_or_insert", "update")


def bf16_vs_fp32(table: list[tuple[int, int, dict[str, float]]], optimizer: str) -> float | None:
    """Worst ids/s of ``optimizer`` with bf16 rows over fp32 rows, over sizes and
    operations (lookup, get_or_insert, update); None unless both ran."""
    bf16, fp32 = f"{optimizer}.bf16", f"{optimizer}.fp32"
    ratios = [
        r[f"{bf16}.{op}_ids_per_s"] / r[f"{fp32}.{op}_ids_per_s"]
        for _, _, r in table
        for op in _OPS
        if f"{bf16}.{op}_ids_per_s" in r and f"{fp32}.{op}_ids_per_s" in r
    ]
    return min(ratios) if ratios else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write config, figures and ratios here")
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--dims", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--batch", type=int, default=65_536, help="Zipf draws per batch")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--zipf-a", type=float, default=1.05)
    parser.add_argument("--new-frac", type=float, default=0.1)
    parser.add_argument(
        "--optimizer",
        nargs="+",
        default=["adagrad"],
        help="the shards' sparse optimizers (adagrad, rowwise_adagrad, adam, ...); the "
        "first is the one compared with the dict tables",
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["fp32"],
        choices=sorted(STORED_DTYPES),
        help="row dtypes; every optimizer runs with each",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tiered-rows", type=int, default=400_000, help="disk-tier table rows (0: skip)"
    )
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="time operations in wall time or in the process's CPU time (cpu: for a "
        "machine shared with other work; see CLOCKS)",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="also time get-or-insert into a fresh output array per call (both sides)",
    )
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    rng = np.random.default_rng(args.seed)

    configs = [(o, d) for o in args.optimizer for d in args.dtypes]
    for config in configs:  # load (or compile) every configuration's numba kernels
        warm = make_shard(4, config, 16)
        warm.lookup(np.arange(10, dtype=np.int64), train=True)
        warm.lookup(np.arange(10, dtype=np.int64), train=False, out=np.empty((10, 4), np.float32))
        warm.apply_gradients(np.arange(10, dtype=np.int64), np.ones((10, 4), np.float32))

    t_start = time.perf_counter()
    figures: dict[str, float] = {}
    table = []
    for rows in args.rows:
        for dim in args.dims:
            res = bench_size(rows, dim, configs, args, rng)
            table.append((rows, dim, res))
            figures.update({f"R{rows}.D{dim}.{k}": v for k, v in res.items()})
    ratios = {
        "get_or_insert_vs_dict": min(r["get_or_insert_vs_dict"] for _, _, r in table),
        "get_or_insert_vs_dict_index": min(r["get_or_insert_vs_dict_index"] for _, _, r in table),
        "update_time_over_gather_time": max(r["update_time_over_gather_time"] for _, _, r in table),
        "bytes_per_row_over_ideal": max(
            r["bytes_per_row"] / r["ideal_bytes_per_row"] for _, _, r in table
        ),
        "bytes_per_row_over_budget": max(
            r[f"{c}.bytes_per_row"] / r[f"{c}.budget_bytes_per_row"]
            for _, _, r in table
            for c in map(config_name, configs)
        ),
    }
    if args.tiered_rows:
        tiered = bench_tiered(args.tiered_rows, args.dims[0], configs[0], args, rng)
        figures.update(tiered)
        ratios["tiered_vs_memory_ids_per_s"] = tiered["tiered_vs_memory_ids_per_s"]
        print(
            f"disk tier: {args.tiered_rows:,} rows, budget {tiered['tiered.budget_rows']:,.0f} "
            f"rows (hot set {tiered['tiered.hot_over_budget']:.2f} of it): memory "
            f"{tiered['tiered.memory_ids_per_s'] / 1e6:.2f}M ids/s, tiered "
            f"{tiered['tiered.tiered_ids_per_s'] / 1e6:.2f}M ids/s (lookup + update), "
            f"memory hit rate {tiered['tiered.memory_hit_rate']:.3f}, "
            f"bytes {tiered['tiered.bytes'] / 1e6:.1f} MB vs "
            f"{tiered['memory.bytes'] / 1e6:.1f} MB; budget "
            f"{tiered['tiered.budget_bytes'] / 1e6:.1f} MB, process anonymous memory grown by "
            f"{tiered['tiered.rss_anon_growth_bytes'] / 1e6:.1f} MB making the tiered table"
        )
    rowwise = [bf16_vs_fp32(table, o) for o in ("rowwise_adagrad", "rowwise_adagrad_elem")]
    measured = [r for r in rowwise if r is not None]
    if measured:
        ratios["bf16_rowwise_vs_fp32_ids_per_s"] = min(measured)
    print(
        f"single thread, {args.optimizer}, zipf_a={args.zipf_a}, {args.batches} batches of "
        f"{args.batch} draws (deduplicated), new_frac={args.new_frac}, best of {args.repeats}"
    )
    head = (
        f"{'rows':>10} {'D':>3} {'ids/batch':>9} | {'lookup':>8} {'gather':>8} | "
        f"{'get_or_ins':>10} {'dict':>7} {'x dict':>6} {'dict_idx':>8} {'x idx':>6} | "
        f"{'update':>8} {'gath+scat':>9} "
        f"{'t/limit':>7} | {'B/row':>6} {'ideal':>6}"
    )
    print(head)
    print("-" * len(head))
    for rows, dim, r in table:
        print(
            f"{rows:>10,} {dim:>3} {r['ids_per_batch']:>9,.0f} | "
            f"{r['lookup_ids_per_s'] / 1e6:>7.1f}M {r['gather_rows_per_s'] / 1e6:>7.1f}M | "
            f"{r['get_or_insert_ids_per_s'] / 1e6:>9.1f}M "
            f"{r['dict_get_or_insert_ids_per_s'] / 1e6:>6.2f}M "
            f"{r['get_or_insert_vs_dict']:>5.1f}x "
            f"{r['dict_index_get_or_insert_ids_per_s'] / 1e6:>7.2f}M "
            f"{r['get_or_insert_vs_dict_index']:>5.1f}x | "
            f"{r['update_ids_per_s'] / 1e6:>7.1f}M {r['gather_scatter_rows_per_s'] / 1e6:>8.1f}M "
            f"{r['update_time_over_gather_time']:>7.2f} | "
            f"{r['bytes_per_row']:>6.0f} {r['ideal_bytes_per_row']:>6.0f}"
        )
    print(
        "rates in ids (rows) per second; dict = Python-dict table (id -> row array), "
        "dict_idx = dict id -> slot over numpy rows; t/limit = update time / gather+scatter time"
    )
    for rows, dim, r in table if args.fresh else []:
        print(
            f"fresh output arrays, {rows:,} x {dim}: get_or_insert "
            f"{r['get_or_insert_fresh_ids_per_s'] / 1e6:.1f}M, dict_index "
            f"{r['dict_index_fresh_get_or_insert_ids_per_s'] / 1e6:.2f}M, "
            f"{r['fresh_get_or_insert_vs_dict_index']:.1f}x"
        )
    print(
        f"{'rows':>10} {'D':>3} {'configuration':>22} | {'lookup':>8} {'get_or_ins':>10} "
        f"{'update':>8} | {'B/row':>6} {'ideal':>6} {'budget':>6}"
    )
    for rows, dim, r in table:
        for c in map(config_name, configs):
            print(
                f"{rows:>10,} {dim:>3} {c:>22} | {r[f'{c}.lookup_ids_per_s'] / 1e6:>7.1f}M "
                f"{r[f'{c}.get_or_insert_ids_per_s'] / 1e6:>9.1f}M "
                f"{r[f'{c}.update_ids_per_s'] / 1e6:>7.1f}M | {r[f'{c}.bytes_per_row']:>6.1f} "
                f"{r[f'{c}.ideal_bytes_per_row']:>6.0f} {r[f'{c}.budget_bytes_per_row']:>6.1f}"
            )
    print("worst cases: " + ", ".join(f"{k}={v:.2f}" for k, v in ratios.items()))
    print(f"total {time.perf_counter() - t_start:.0f} s")
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        payload = {"config": config, "figures": figures, "ratios": ratios}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
