"""Benchmark: how a ``data.dataset`` job's rows reach W trainers.

    python bench/dataset.py [--json PATH] [--rows-per-hour 40000] [--hours 3]
                            [--rounds 2] [--contenders local_2x2,ray_rank0,ray_direct]

One job (synthetic Criteo-shaped hourly partitions, DLRM dim 16, 2 trainers x
512 rows a step, 2 PS shards, hybrid mode), three ways to feed it, in the same run:

  local_2x2   the local runtime (``--nproc 2``): rank 0 reads (2 reader
              threads), shuffles, and sends rank 1 its part over gloo
  ray_rank0   Ray, 2 data executors read and decode; rank 0 fetches every row
              and sends rank 1 its part (``runtime.ray.data_delivery: rank0``)
  ray_direct  Ray, 2 data executors; rank 0 routes row ids, each trainer
              fetches its own blocks (``runtime.ray.data_delivery: direct``)

Each contender runs ``estuary train`` in its own process; ``--rounds`` rounds
interleave them and each figure is the best round's training rows/s (rank 0's
loop, every rank's rows: ``samples_per_s`` in summary.json). Also reported: rank
0's seconds handing parts to rank 1 (``batch_send_s``) and the rows it fetched.

Ratios: ``direct_vs_rank0_delivery`` = ray_direct / ray_rank0, and
``ray_direct_vs_local_2x2``. On one machine the object store is shared memory,
so delivery costs little either way; the difference direct delivery makes
(rank 0 moving row ids, each rank 1/W of the rows) is across nodes, which this
bench does not have.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

CONTENDERS = ("local_2x2", "ray_rank0", "ray_direct")
RUNTIME = {
    "local_2x2": {"trainers": 2, "ps_shards": 2},
    "ray_rank0": {
        "backend": "ray",
        "trainers": 2,
        "ps_shards": 2,
        "data_executors": 2,
        "ray": {"data_delivery": "rank0"},
    },
    "ray_direct": {
        "backend": "ray",
        "trainers": 2,
        "ps_shards": 2,
        "data_executors": 2,
        "ray": {"data_delivery": "direct"},
    },
}
DENSE = [f"I{i}" for i in range(1, 14)]
SPARSE = [f"C{i}" for i in range(1, 27)]
PARTITIONS = "{{YYYY}}{{MM}}{{DD}}/{{HH}}"  # the synthetic writer's folders


def make_data(root: Path, rows_per_hour: int, hours: int) -> Path:
    """Synthetic hourly partitions (cached under ``root`` by their size)."""
    from estuary.data.synthetic import SyntheticSpec, write_synthetic

    folder = root / f"synth-{rows_per_hour}x{hours}"
    spec = SyntheticSpec(
        rows_per_hour=rows_per_hour, hours=hours, seed=3, vocab_sizes=(50_000,) * len(SPARSE)
    )
    write_synthetic(spec, folder)  # skips hours already written (their _SUCCESS)
    return folder


def write_job(folder: Path, data: Path, hours: int) -> Path:
    end = f"2026-01-01T{hours:02d}"
    job: dict[str, Any] = {
        "name": "bench-dataset",
        "data": {
            "schema": {"label": "label", "dense": DENSE, "sparse": SPARSE},
            "dataset": {
                "streams": {
                    "train": {
                        "sources": [
                            {
                                "name": "synth",
                                "path": f"{data}/{PARTITIONS}/part-*",
                                "format": "criteo_tsv",
                                "start": "2026-01-01T00",
                                "end": end,
                            }
                        ]
                    }
                },
                "shuffle": {"buffer_rows": 20000, "interleave_splits": 1},
                "executor": {"workers": 2},
            },
        },
        "model": {
            "type": "dlrm",
            "params": {"bottom_mlp": [64, 16], "top_mlp": [64, 1]},
            "embedding": {"default": {"dim": 16, "optimizer": {"name": "adagrad", "lr": 0.05}}},
        },
        "train": {"batch_size": 512, "mode": "hybrid", "threads": 1, "seed": 0},
        "output": {"dir": "out", "progress": False, "checkpoint": False},
    }
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def run(name: str, job: Path, out: Path) -> dict[str, Any]:
    sets = [
        arg for k, v in flatten(RUNTIME[name], "runtime").items() for arg in ("--set", f"{k}={v}")
    ]
    cmd = [sys.executable, "-m", "estuary.cli", "train", str(job), "--no-progress", "-q"]
    cmd += ["--output", str(out), *sets]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((out / "summary.json").read_text())
    return {
        "rows_per_s": summary["samples_per_s"],
        "train_rows": summary["train_rows"],
        "steps": summary["steps"],
        "wall_s": summary["wall_s"],
        "batch_send_s": summary.get("batch_send_s"),
        "rows_fetched_rank0": summary.get("rows_fetched_rank0"),
        "process_s": round(time.perf_counter() - t0, 2),
    }


def flatten(tree: dict[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}.{key}"))
        else:
            out[f"{prefix}.{key}"] = value
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--rows-per-hour", type=int, default=40000)
    parser.add_argument("--hours", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument(
        "--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "estuary-bench"
    )
    args = parser.parse_args()
    names = args.contenders.split(",")
    unknown = set(names) - set(CONTENDERS)
    if unknown:
        parser.error(f"unknown contenders {sorted(unknown)}; known: {', '.join(CONTENDERS)}")
    data = make_data(args.data_dir, args.rows_per_hour, args.hours)
    rounds: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        job = write_job(Path(tmp), data, args.hours)
        for r in range(args.rounds):
            for name in names:
                got = run(name, job, Path(tmp) / f"{name}-{r}")
                rounds[name].append(got)
                print(
                    f"round {r + 1} {name:<11} {got['rows_per_s']:>9,.0f} rows/s  {got}", flush=True
                )
    best = {n: max(rs, key=lambda g: g["rows_per_s"]) for n, rs in rounds.items()}
    ratios = {}
    if "ray_direct" in best and "ray_rank0" in best:
        ratios["direct_vs_rank0_delivery"] = (
            best["ray_direct"]["rows_per_s"] / best["ray_rank0"]["rows_per_s"]
        )
    if "ray_direct" in best and "local_2x2" in best:
        ratios["ray_direct_vs_local_2x2"] = (
            best["ray_direct"]["rows_per_s"] / best["local_2x2"]["rows_per_s"]
        )
    report = {
        "rows": args.rows_per_hour * args.hours,
        "rounds": args.rounds,
        "cores": os.cpu_count(),
        "best": best,
        "all": rounds,
        "ratios": ratios,
    }
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
