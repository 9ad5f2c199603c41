"""Benchmark: numba HashIndex vs a pure-Python dict on Zipf-distributed ids.

    python bench/table.py [--json PATH] [--keys 1000000] [--batches 4] [--zipf-a 1.1]

Universe: ``--keys`` random int64 ids. Each batch is ``--keys`` draws from a
Zipf(a) law over that universe (rank r drawn with probability ~ r**-a).

Figures (keys/s, best of ``--repeats``; both sides start from numpy int64 arrays
and return numpy int64 slots, so the dict side pays ``tolist``/``np.array``):
  get_or_insert  fresh structure, all Zipf batches (first sightings insert)
  lookup         the full-universe structure, all Zipf batches (every id present)
  insert_unique  fresh structure, every id once (pure insert + growth)
Plus, for scale, an ``EmbeddingShard`` (D=16, adagrad) train lookup and update.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from estuary.config.spec import TableSpec
from estuary.embedding import EmbeddingShard, HashIndex

Ids = np.ndarray


def zipf_batches(keys: Ids, a: float, batches: int, rng: np.random.Generator) -> list[Ids]:
    """``batches`` arrays of ``keys.size`` Zipf(a) draws over ``keys`` (rank = position)."""
    weights = np.arange(1, keys.size + 1, dtype=np.float64) ** -a
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    return [keys[np.searchsorted(cdf, rng.random(keys.size))] for _ in range(batches)]


def best_time(run: Callable[[], object], setup: Callable[[], None], repeats: int) -> float:
    """Fastest wall time of ``run`` over ``repeats`` tries, ``setup`` untimed before each."""
    best = float("inf")
    for _ in range(repeats):
        setup()
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


class DictTable:
    """The baseline: a dict id -> slot, new slot = current size (setdefault style)."""

    def __init__(self) -> None:
        self.d: dict[int, int] = {}

    def get_or_insert(self, ids: Ids) -> Ids:
        d = self.d
        sd = d.setdefault
        return np.array([sd(k, len(d)) for k in ids.tolist()], np.int64)

    def lookup(self, ids: Ids) -> Ids:
        get = self.d.get
        return np.array([get(k, -1) for k in ids.tolist()], np.int64)


def measure(
    make: Callable[[], HashIndex | DictTable], keys: Ids, batches: list[Ids], repeats: int
) -> dict[str, float]:
    """Keys/s of one implementation for each operation (see module docstring)."""
    holder: dict[str, HashIndex | DictTable] = {}

    def fresh() -> None:
        holder["t"] = make()

    draws = sum(b.size for b in batches)
    t_goi = best_time(lambda: [holder["t"].get_or_insert(b) for b in batches], fresh, repeats)
    t_ins = best_time(lambda: holder["t"].get_or_insert(keys), fresh, repeats)
    full = make()
    full.get_or_insert(keys)
    t_look = best_time(lambda: [full.lookup(b) for b in batches], lambda: None, repeats)
    return {
        "get_or_insert": draws / t_goi,
        "lookup": draws / t_look,
        "insert_unique": keys.size / t_ins,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write figures and ratios here")
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--zipf-a", type=float, default=1.1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    keys = np.unique(rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, args.keys * 2))
    keys = rng.permutation(keys)[: args.keys].astype(np.int64)
    batches = zipf_batches(keys, args.zipf_a, args.batches, rng)
    draws = sum(b.size for b in batches)
    distinct = int(np.unique(np.concatenate(batches)).size)

    # Warm up: load (or compile) the numba kernels outside the timings.
    warm = HashIndex(4)
    warm.get_or_insert(keys[:100])
    warm.lookup(keys[:100])

    impls: dict[str, Callable[[], HashIndex | DictTable]] = {
        "numba": lambda: HashIndex(capacity_ids=1024),
        "dict": DictTable,
    }
    times = {name: measure(make, keys, batches, args.repeats) for name, make in impls.items()}
    # The two implementations must agree on slots (same insertion order).
    check_n, check_d = HashIndex(), DictTable()
    assert np.array_equal(check_n.get_or_insert(batches[0]), check_d.get_or_insert(batches[0]))

    shard_rows = shard_figures(batches[0], rng)

    figures: dict[str, float] = {
        f"{impl}.{op}_keys_per_s": rate for impl, ops in times.items() for op, rate in ops.items()
    }
    figures.update(shard_rows)
    ratios = {f"{op}_vs_dict": times["numba"][op] / times["dict"][op] for op in times["numba"]}
    print(
        f"keys={keys.size:,} zipf_a={args.zipf_a} draws={draws:,} "
        f"distinct_drawn={distinct:,} repeats={args.repeats}"
    )
    print(f"{'operation':<16}{'numba keys/s':>16}{'dict keys/s':>16}{'ratio':>9}")
    for op in times["numba"]:
        n, d = times["numba"][op], times["dict"][op]
        print(f"{op:<16}{n:>16,.0f}{d:>16,.0f}{n / d:>8.1f}x")
    for key, value in shard_rows.items():
        print(f"{key:<40}{value:>16,.0f}")
    if args.json:
        payload = {
            "config": {
                "keys": int(keys.size),
                "zipf_a": args.zipf_a,
                "draws": draws,
                "distinct_drawn": distinct,
                "repeats": args.repeats,
            },
            "figures": figures,
            "ratios": ratios,
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


def shard_figures(batch: Ids, rng: np.random.Generator) -> dict[str, float]:
    """Rows/s of a whole shard (index + gather + adagrad) on one Zipf batch, D=16."""
    ids = np.unique(batch)
    shard = EmbeddingShard(TableSpec(dim=16), seed=0, name="bench")
    shard.lookup(ids[:10], train=True)  # warm the kernels
    t0 = time.perf_counter()
    shard.lookup(ids, train=True)  # every id new: insert + initialise
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    shard.lookup(ids, train=True)
    t_hit = time.perf_counter() - t0
    grads = rng.normal(size=(ids.size, 16)).astype(np.float32)
    t0 = time.perf_counter()
    shard.apply_gradients(ids, grads)
    t_apply = time.perf_counter() - t0
    return {
        "shard.lookup_new_rows_per_s": ids.size / t_first,
        "shard.lookup_hit_rows_per_s": ids.size / t_hit,
        "shard.apply_adagrad_rows_per_s": ids.size / t_apply,
    }


if __name__ == "__main__":
    main()
