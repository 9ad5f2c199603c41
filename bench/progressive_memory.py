"""Benchmark: progressive evaluation's memory and cost as rows grow.

    python bench/progressive_memory.py [--rows 10000000] [--batch-size 1000]
                                       [--rows-per-window 100000] [--json PATH]

Feeds ``ProgressiveStats`` what the training loop would (each step's rows in
their window and origin, a tenth of them also as ``new_ids``, a lag per step)
and prints, at each tenth of ``--rows``: the bytes its arrays hold, bytes per
row, the mean time of a step's ``record`` calls, and the time a ``/metrics``
scrape's figures and the summary report take. Scores are drawn once (a pool of
a million rows, logits normal) and reused, so the timings are of the stats only.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from estuary.metrics.progressive import ProgressiveCollector, ProgressiveStats

POOL = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--rows-per-window", type=int, default=100_000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    labels = (rng.random(POOL) < 0.2).astype(np.int8)
    probs = (1 / (1 + np.exp(-(rng.standard_normal(POOL) + labels - 1.5)))).astype(np.float32)
    stats = ProgressiveStats("all rows")
    collector = ProgressiveCollector(stats)
    rows, record_s, steps, lines = 0, 0.0, 0, []
    checkpoint = args.rows // 10
    while rows < args.rows:
        at = rows % (POOL - args.batch_size)
        y, p = labels[at : at + args.batch_size], probs[at : at + args.batch_size]
        w = rows // args.rows_per_window
        started = time.perf_counter()
        stats.record((w * 3600, (w + 1) * 3600), ["hist/synth"], y, p, lag_s=60.0)
        stats.record_origin("new_ids", y[: len(y) // 10], p[: len(p) // 10])
        record_s += time.perf_counter() - started
        rows, steps = rows + len(y), steps + 1
        if rows % checkpoint < args.batch_size:
            started = time.perf_counter()
            list(collector.collect())
            scrape_s = time.perf_counter() - started
            started = time.perf_counter()
            stats.report()
            report_s = time.perf_counter() - started
            line = {
                "rows": rows,
                "windows": len(stats.windows),
                "bytes": stats.size_bytes,
                "bytes_per_row": round(stats.size_bytes / rows, 3),
                "record_us_per_step": round(1e6 * record_s / steps, 1),
                "scrape_ms": round(1e3 * scrape_s, 2),
                "report_ms": round(1e3 * report_s, 2),
            }
            lines.append(line)
            print(json.dumps(line), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": None}, "lines": lines}))


if __name__ == "__main__":
    main()
