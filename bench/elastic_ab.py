"""A/B probe for bench/elastic.py: static read layouts (E executors x T reads
each) feeding the same trainer, alternated so the machine's load drift hits
each alike; rows/s over each run's second half.

    python bench/elastic_ab.py [--layouts 8x1,1x8] [--reps 3] [--seconds 14]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import ray
import torch

sys.path.insert(0, str(Path(__file__).parent))
import elastic as bench


class LayoutRun(bench.Run):
    """A static run whose executors read ``threads`` splits at once."""

    threads = 1

    def pool(self) -> tuple[Any, Any]:
        pool, group = super().pool()
        if self.threads > 1:
            pool.set_threads(self.threads)
        return pool, group


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="8x1,1x8")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=14.0)
    parser.add_argument("--need", type=float, default=4.0)
    args = parser.parse_args()
    layouts = [tuple(int(x) for x in lay.split("x")) for lay in args.layouts.split(",")]
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="estuary-elastic-ab-"))
    ray.init(address="local", num_cpus=16, include_dashboard=False, logging_level="WARNING")
    try:
        rate = bench.trainer_rate(bench.Trainer(1024))
        hours = bench.hours_for(rate, args.seconds * args.reps * len(layouts) / 2)
        bench.write_data(root, hours)
        most = max(e * t for e, t in layouts)
        job = bench.make_job(root, most, hours)
        delay = args.need * bench.ROWS / rate
        print(f"trainer alone {rate:.0f} rows/s, split delay {delay:.3f} s")
        for _ in range(args.reps):
            for executors, threads in layouts:
                run = LayoutRun(job, root, delay, executors, 1024, most)
                run.threads = threads
                series = run.go(args.seconds, None, None, None)["rows_per_s_each_second"]
                print(f"{executors}x{threads}: {bench.steady(series):.0f} rows/s {series}")
    finally:
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
