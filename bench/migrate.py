"""Benchmark: the pause of a PS slot migration (``estuary.ps.migration``) while
a trainer runs.

    python bench/migrate.py [--json PATH] [--rows 100000 1000000] [--dim 16]
                            [--batch 4096] [--steps 60] [--moves 3] [--resize]

For each table size R: two parameter-server processes (``ServerProcess``) host
one Adagrad table (dim ``--dim``); a client fills it with R ids (train lookups
plus pushes). Then a trainer thread runs ``--steps`` sync steps of ``--batch``
uniform draws over the R ids (lookup, push of rows x 0.5), while the main
thread moves half of server 0's slots to server 1 (about R/4 rows), then back,
``--moves`` migrations in all, spaced over the run. Figures per migration:
``rows`` and ``bytes`` moved, ``pause_ms`` (fence to lift: the most a trainer
request waited), ``wait_ms`` (the fence step's last pushes) and ``move_ms``
(export, import, switch, drop); per run the trainer's median step time and its
longest step (the step that waited at the fence).

``--resize``: the moves are a split and a merge instead, alternately: a third
server process joins and takes half of server 0's slots
(``ShardedPSClient.add_server``), then gives them back to server 0 and leaves
(``retire_server``); the trainer's client connects to it and drops it as it
fetches the map.

``--compact-below F``: the servers' ``ServerConfig.compact_below`` (default
0.75; 0 = never compact). Per migration also: server 0's resident memory
(``/proc/PID/statm``) and its table's bytes (``stats().bytes``) before and
after, ``freed_bytes`` (what the sources' compaction gave back) and
``compact_ms`` (the time it took, inside ``move_ms``).

``--json PATH`` writes ``{"config", "runs"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from estuary.config.spec import InitializerSpec, SparseOptimizerSpec, TableSpec
from estuary.ps import HostedTable, PSClient, ServerConfig, ServerProcess
from estuary.ps.sharded import ShardedPSClient, server_share


def rss_mib(pid: int | None) -> float:
    """Resident memory of process ``pid`` (MiB), from /proc (0 where there is none)."""
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def run(rows: int, args: argparse.Namespace) -> dict[str, Any]:
    spec = TableSpec(
        dim=args.dim,
        initializer=InitializerSpec("uniform", 0.1),
        optimizer=SparseOptimizerSpec(name="adagrad", lr=0.05),
        initial_capacity_rows=rows,
    )
    config = ServerConfig(
        {"t": server_share(HostedTable(spec, 0), 2)},
        world_size=1,
        staleness=0,
        compact_below=args.compact_below,
    )
    procs = [ServerProcess(config) for _ in range(3 if args.resize else 2)]
    try:

        def client() -> ShardedPSClient:
            return ShardedPSClient([PSClient(p.address, p.authkey) for p in procs[:2]])

        trainer, mover = client(), client()
        table = trainer.table("t")
        ids = np.random.default_rng(0).permutation(rows * 4)[:rows].astype(np.int64)
        for start in range(0, rows, 65_536):  # fill: one step per chunk
            chunk = ids[start : start + 65_536]
            table.lookup(chunk, train=True)
            table.apply_gradients(chunk, np.zeros((chunk.size, args.dim), np.float32))
        table.wait_applied()
        times: list[float] = []
        done = threading.Event()

        def train() -> None:
            rng = np.random.default_rng(1)
            for _ in range(args.steps):
                batch = np.unique(rng.choice(ids, args.batch))
                t0 = time.perf_counter()
                got = table.lookup(batch, train=True)
                table.apply_gradients(batch, got * 0.5)
                times.append(time.perf_counter() - t0)
            table.wait_applied()
            done.set()

        thread = threading.Thread(target=train)
        thread.start()
        migrations = []
        moved = np.empty(0, np.int64)
        watch = PSClient(procs[0].address, procs[0].authkey)
        source = watch.table("t")  # server 0's part: the split's source
        for k in range(args.moves):
            while len(times) < (k + 1) * args.steps // (args.moves + 1) and not done.is_set():
                time.sleep(0.001)
            before = (rss_mib(procs[0].pid), source.stats().bytes / 2**20)
            if args.resize:
                spare = procs[2]
                migration = (
                    mover.add_server(PSClient(spare.address, spare.authkey))
                    if k % 2 == 0
                    else mover.retire_server(2, into=0)
                )
            else:
                slots = mover.refresh_routing().owned(0)[::2] if k % 2 == 0 else moved
                target = 1 if k % 2 == 0 else 0
                migration = mover.migrate(slots, to=target)
                moved = slots
            migrations.append(
                {
                    key: round(value, 2) if isinstance(value, float) else value
                    for key, value in migration.as_dict().items()
                }
                | {
                    "rss_mib": [round(before[0], 1), round(rss_mib(procs[0].pid), 1)],
                    "table_mib": [round(before[1], 1), round(source.stats().bytes / 2**20, 1)],
                }
            )
        thread.join()
        trainer.close()
        watch.close()
        mover.close()
    finally:
        for proc in procs:
            proc.stop()
    return {
        "rows": rows,
        "migrations": migrations,
        "step_ms_median": round(statistics.median(times) * 1e3, 2),
        "step_ms_max": round(max(times) * 1e3, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write config and runs here")
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--moves", type=int, default=3)
    parser.add_argument("--resize", action="store_true", help="split and merge instead")
    parser.add_argument("--compact-below", type=float, default=0.75, help="0 = never compact")
    args = parser.parse_args()
    runs = []
    for rows in args.rows:
        result = run(rows, args)
        runs.append(result)
        for m in result["migrations"]:
            print(
                f"R={rows:>9,}  moved {m['rows']:>8,} rows ({m['bytes'] / 2**20:6.1f} MiB) "
                f"{m['sources']}->{m['to']}: pause {m['pause_ms']:8.1f} ms "
                f"(wait {m['wait_ms']:6.1f}, move {m['move_ms']:8.1f}); server 0 "
                f"RSS {m['rss_mib'][0]:.0f}->{m['rss_mib'][1]:.0f} MiB, table "
                f"{m['table_mib'][0]:.1f}->{m['table_mib'][1]:.1f} MiB, "
                f"freed {m['freed_bytes'] / 2**20:.1f} MiB in {m['compact_ms']:.1f} ms"
            )
        print(
            f"R={rows:>9,}  trainer step: median {result['step_ms_median']} ms, "
            f"max {result['step_ms_max']} ms"
        )
    if args.json:
        args.json.write_text(json.dumps({"config": vars(args) | {"json": None}, "runs": runs}))


if __name__ == "__main__":
    main()
