"""Benchmark: reading every table's stats from the parameter servers, table by
table against one ``stats_many`` request per server (rank 0's time-series sample).

    python bench/ps_stats.py [--json PATH] [--servers 1 2] [--samples 200]
                             [--ids 2000] [--job examples/criteo.yaml]

For each server count P: P ``ServerProcess``es host the job's tables (the 26
criteo tables by default, each server its share, as ``runtime.ps_shards=P``
starts them); one training step of ``--ids`` ids per table fills them. Then
``--samples`` rounds, each timing (wall clock, the trainer blocks on it)

  per_table    ``{name: table.stats()}``: one request per table and server
               (the sample before ``stats_many``; a sharded table asks its P
               servers at once)
  stats_many   ``stats_of(tables)``: one request per server for all tables

in alternating order, so a load swing hits both alike. Figures: the median and
90th percentile in ms, and ``per_table_over_stats_many`` (medians). The machine
is shared: say the load (printed) with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from estuary.config import load_job
from estuary.embedding.types import stats_of
from estuary.ps import ServerConfig, ServerProcess
from estuary.ps.sharded import connect_servers, server_share
from estuary.train.plan import TrainPlan

ROOT = Path(__file__).resolve().parents[1]


def timed_ms(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "median_ms": round(statistics.median(ordered), 3),
        "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))], 3),
    }


def bench_servers(job_path: Path, servers: int, samples: int, ids: int) -> dict[str, Any]:
    """One server count's figures (see the module docstring)."""
    hosted = TrainPlan.from_job(load_job(job_path)).hosted_tables()
    config = ServerConfig(
        {name: server_share(t, servers) for name, t in hosted.items()}, world_size=1, staleness=0
    )
    with contextlib.ExitStack() as stack:
        procs = [stack.enter_context(ServerProcess(config)) for _ in range(servers)]
        client = connect_servers(
            [p.address for p in procs], [p.authkey for p in procs], timeout_s=60
        )
        stack.callback(client.close)
        tables = client.tables()
        stores = list(tables.values())
        rng = np.random.default_rng(0)
        batch = [rng.integers(0, 1 << 40, size=ids).astype(np.int64) for _ in stores]
        rows = client.lookup_many(stores, batch, train=True)
        client.apply_gradients_many(stores, batch, [np.zeros_like(r) for r in rows])
        want = {name: t.stats() for name, t in tables.items()}
        assert stats_of(tables) == want, "stats_many disagrees with per-table stats"

        per_table: list[float] = []
        many: list[float] = []
        for i in range(samples):
            runs = [
                (per_table, lambda: {name: t.stats() for name, t in tables.items()}),
                (many, lambda: stats_of(tables)),
            ]
            for into, fn in runs if i % 2 == 0 else runs[::-1]:
                into.append(timed_ms(fn))
        out = {
            "servers": servers,
            "tables": len(tables),
            "per_table": summary(per_table),
            "stats_many": summary(many),
        }
        out["per_table_over_stats_many"] = round(
            out["per_table"]["median_ms"] / out["stats_many"]["median_ms"], 2
        )
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--servers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--ids", type=int, default=2000, help="ids per table in the fill step")
    parser.add_argument("--job", type=Path, default=ROOT / "examples" / "criteo.yaml")
    args = parser.parse_args()
    results = []
    for servers in args.servers:
        load = os.getloadavg()[0]
        result = bench_servers(args.job, servers, args.samples, args.ids)
        result["load_before"] = round(load, 2)
        result["load_after"] = round(os.getloadavg()[0], 2)
        print(json.dumps(result))
        results.append(result)
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {"config": vars(args) | {"job": str(args.job)}, "results": results},
                indent=2,
                default=str,
            )
        )


if __name__ == "__main__":
    main()
