"""Benchmark: compaction of one embedding shard (``EmbeddingShard.compact``)
after most of its rows left, and the memory it gives back.

    python bench/compact.py [--rows 1000000] [--dim 64] [--keep 0.5] [--json PATH]

One Adagrad shard (in this process) takes ``--rows`` ids (train lookups), then
drops all but a ``--keep`` share of them, scattered (as a split's source drops
the slots it gave away), and compacts. Figures: the drop's and the
compaction's time, the rows moved, the table's bytes (``stats().bytes``) and
this process's resident memory (``/proc/self/statm``) before and after, and its
peak during the compaction (``VmHWM`` of ``/proc/self/status``, reset first
through ``/proc/self/clear_refs``; Linux only) next to the resident memory
before it. Then the dropped rows come back (``import_rows``, as a merge would
bring them), timed against a twin shard that never compacted.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from estuary.config.spec import InitializerSpec, SparseOptimizerSpec, TableSpec
from estuary.embedding import EmbeddingShard

_MIB = 2**20


def rss_mib() -> float:
    """This process's resident memory (MiB)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / _MIB


def reset_peak() -> bool:
    """Start a new peak (``VmHWM``) at the current resident memory; False where
    the kernel does not offer it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_mib() -> float:
    """Peak resident memory since the last ``reset_peak`` (MiB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run(args: argparse.Namespace, compact: bool) -> dict[str, Any]:
    spec = TableSpec(
        dim=args.dim,
        initializer=InitializerSpec("uniform", 0.1),
        optimizer=SparseOptimizerSpec(name="adagrad", lr=0.05),
        initial_capacity_rows=args.rows,
    )
    shard = EmbeddingShard(spec, seed=0, name="t")
    ids = np.random.default_rng(0).permutation(args.rows * 4)[: args.rows].astype(np.int64)
    for start in range(0, ids.size, 65_536):
        shard.lookup(ids[start : start + 65_536], train=True)
    cut = np.random.default_rng(1).random(ids.size) >= args.keep  # the rows that leave
    leaving = ids[cut]
    moved = shard.export_rows(lambda x: np.isin(x, leaving))
    t0 = time.perf_counter()
    shard.remove(leaving)
    t1 = time.perf_counter()
    bytes_before, rss_before = shard.stats().bytes / _MIB, rss_mib()
    has_peak = reset_peak()
    done = shard.compact(below=0.75 if compact else 0.0)
    t2 = time.perf_counter()
    peak = peak_mib() if has_peak else None
    bytes_after, rss_after = shard.stats().bytes / _MIB, rss_mib()
    t3 = time.perf_counter()
    shard.import_rows(moved)
    t4 = time.perf_counter()
    return {
        "compact": compact,
        "held": done.held,
        "moved": done.moved,
        "drop_ms": round((t1 - t0) * 1e3, 1),
        "compact_ms": round((t2 - t1) * 1e3, 1),
        "table_mib": [round(bytes_before, 1), round(bytes_after, 1)],
        "rss_mib": [round(rss_before, 1), round(rss_after, 1)],
        "peak_mib": None if peak is None else round(peak, 1),
        "import_back_ms": round((t4 - t3) * 1e3, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--keep", type=float, default=0.5, help="share of the rows that stay")
    parser.add_argument("--json", type=Path, help="write config and runs here")
    args = parser.parse_args()
    runs = []
    for compact in (True, False):
        r = run(args, compact)
        runs.append(r)
        peak = "" if r["peak_mib"] is None else f", peak {r['peak_mib']:.0f} MiB"
        print(
            f"compact={compact!s:5}  {r['held']:,} rows kept, {r['moved']:,} moved: "
            f"drop {r['drop_ms']} ms, compact {r['compact_ms']} ms; table "
            f"{r['table_mib'][0]}->{r['table_mib'][1]} MiB, RSS {r['rss_mib'][0]:.0f}->"
            f"{r['rss_mib'][1]:.0f} MiB{peak}; rows back in {r['import_back_ms']} ms"
        )
    if args.json:
        args.json.write_text(json.dumps({"config": vars(args) | {"json": None}, "runs": runs}))


if __name__ == "__main__":
    main()
