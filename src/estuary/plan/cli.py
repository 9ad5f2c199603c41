"""``estuary plan JOB.yaml --nodes N [--ids 1e10]``: the sizing answer for one job.

Calibrates the job's costs on this machine (its data, tables and model; ~30 s)
unless ``--costs`` gives a calibration file, then prints the largest balanced
layout on N nodes and its predicted throughput and memory per shard. The costs
are per core as measured here; the cluster's network is a model (``--net-*``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    """Register ``plan`` on the ``estuary`` command's subparsers."""
    p = sub.add_parser(
        "plan",
        parents=parents,
        help="size a job for N nodes from calibrated costs: PS shards, "
        "trainers, executors, predicted rows/s and memory per shard",
    )
    p.add_argument("job", type=Path, help="job file (YAML)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a job field (repeatable)",
    )
    p.add_argument("--nodes", type=int, required=True, help="machines in the cluster")
    p.add_argument(
        "--ids",
        type=float,
        help="distinct ids the tables will hold (default: the calibration data's distinct ids)",
    )
    p.add_argument("--costs", type=Path, help="calibration JSON (default: calibrate now)")
    p.add_argument("--save-costs", type=Path, help="write the calibration JSON here")
    p.add_argument("--cores-per-node", type=int, default=32)
    p.add_argument("--memory-per-node-gb", type=float, default=256.0)
    p.add_argument("--ps-memory-gb", type=float, default=64.0, help="most memory of one shard")
    p.add_argument(
        "--net-latency-us",
        type=float,
        default=100.0,
        help="cluster network round trip (default 100 us)",
    )
    p.add_argument(
        "--net-gbps", type=float, default=10.0, help="bandwidth of one link in Gbit/s (default 10)"
    )
    p.add_argument("--json", type=Path, help="also write the answer as JSON here")


def run(args: argparse.Namespace) -> int:
    from estuary.config import load_job
    from estuary.errors import ConfigError
    from estuary.plan.calibration import calibrate
    from estuary.plan.costs import load_costs, save_costs
    from estuary.plan.simulator import ClusterSpec
    from estuary.plan.sizing import size_job
    from estuary.plan.trace import GIB

    if args.nodes < 1:
        raise ConfigError("--nodes", "must be >= 1")
    job = load_job(args.job, args.overrides)
    if args.costs:
        costs = load_costs(args.costs)
    else:
        print("calibrating on this machine (one thread per component)...", file=sys.stderr)
        costs = calibrate(job, repeats=1)
    if args.save_costs:
        save_costs(costs, args.save_costs)
    ids = args.ids if args.ids is not None else float(costs.machine.get("distinct_ids", 1e6))
    if ids <= 0:
        raise ConfigError("--ids", "must be > 0")
    cluster_costs = replace(
        costs, net_latency_s=args.net_latency_us * 1e-6, net_bytes_per_s=args.net_gbps * 1e9 / 8
    )
    cluster = ClusterSpec(
        nodes=args.nodes,
        cores_per_node=args.cores_per_node,
        memory_per_node_bytes=args.memory_per_node_gb * GIB,
        batch_rows=job.train.batch_size,
    )
    try:
        sizing = size_job(cluster_costs, ids, cluster, ps_memory_bytes=args.ps_memory_gb * GIB)
    except ValueError as exc:
        raise ConfigError("--nodes", str(exc)) from None
    print(
        f"{job.name}: {ids:.3g} ids on {args.nodes} nodes x {args.cores_per_node} cores, "
        f"{args.memory_per_node_gb:g} GiB (costs per core measured on "
        f"{costs.machine.get('host', '?')}; network {args.net_latency_us:g} us, "
        f"{args.net_gbps:g} Gbit/s)"
    )
    for label, value in sizing.rows():
        print(f"  {label:22s} {value}")
    if args.json:
        lay, p = sizing.layout, sizing.prediction
        out = {
            "job": job.name,
            "nodes": args.nodes,
            "ids": ids,
            "ps_shards": lay.ps_shards,
            "trainers": lay.trainers,
            "executors": lay.executors,
            "rows_per_s": p.rows_per_s,
            "bottleneck": p.bottleneck,
            "ps_memory_bytes": sizing.ps_memory_bytes,
            "shard_bytes": sizing.shard_bytes,
            "cores_used": sizing.cores_used,
            "memory_used_bytes": sizing.memory_used_bytes,
            "costs": costs.to_dict(),
        }
        args.json.write_text(json.dumps(out, indent=1))
    return 0
