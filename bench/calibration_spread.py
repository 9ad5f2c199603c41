"""How far apart calibrations of the same machine land: run it K times, compare.

    python bench/calibration_spread.py [--runs 3] [--json PATH]

Runs ``estuary.plan.calibration.calibrate`` ``--runs`` times, back to back, on
the job and batch size ``bench/simulate.py`` calibrates with (examples/criteo.yaml
at ``simulate_real.BATCH_ROWS``), and prints per calibrated figure each run's
value and its relative spread (max / min - 1; ``inf`` where one run read 0 and
another did not), the wall seconds of each calibration and of its stages (the
calibration module's private stage functions, timed by wrapping them), and the
load average around each run. Nothing is compared with real training runs:
this is the calibration's own reproducibility.

Which calibration code runs is whatever ``estuary`` imports: point
``PYTHONPATH`` at another checkout's ``src`` to measure that one.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import simulate_real

from estuary.config import load_job
from estuary.plan import calibration

# The calibration's stages (module-level functions ``calibrate`` calls by name);
# whichever of these the imported code has are timed.
STAGES = (
    "_data_costs",
    "_bytes_per_row",
    "_trainer_costs",
    "_collection_costs",
    "_layout_costs",
    "measure_network",
    "_parallel_costs",
)


def spread(values: list[float]) -> float:
    """max / min - 1 of ``values`` (0 when all are equal, ``inf`` when the least
    is 0 and the greatest is not)."""
    lo, hi = min(values), max(values)
    if hi == lo:
        return 0.0
    if lo <= 0:
        return math.inf
    return hi / lo - 1.0


def _timed_stages(times: dict[str, float]) -> None:
    """Wrap each of ``STAGES`` in ``calibration`` so its wall seconds land in ``times``."""
    for name in STAGES:
        fn = getattr(calibration, name, None)
        if fn is None or getattr(fn, "_spread_wrapped", False):
            continue

        def wrapper(*args: Any, __fn: Any = fn, __name: str = name, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return __fn(*args, **kw)
            finally:
                times[__name] = times.get(__name, 0.0) + time.perf_counter() - t0

        functools.update_wrapper(wrapper, fn)
        wrapper._spread_wrapped = True  # type: ignore[attr-defined]
        setattr(calibration, name, wrapper)


def figures(costs: Any) -> dict[str, float]:
    """The calibrated numbers of one ``Costs`` (its fields and the machine's
    ``parallel_throughput``); constants of the data (features, dim) included."""
    out = {
        k: float(v)
        for k, v in asdict(costs).items()
        if k not in ("machine", "version") and isinstance(v, int | float)
    }
    if "parallel_throughput" in costs.machine:
        out["parallel_throughput"] = float(costs.machine["parallel_throughput"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="calibrations to run (K)")
    ap.add_argument("--json", type=Path, help="write the figures and spreads here")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error(f"--runs must be >= 1, got {args.runs}")

    job = load_job(simulate_real.JOB, [f"train.batch_size={simulate_real.BATCH_ROWS}"])
    stage_s: dict[str, float] = {}
    _timed_stages(stage_s)
    runs: list[dict[str, Any]] = []
    for i in range(args.runs):
        stage_s.clear()
        load_before = os.getloadavg()[0]
        t0 = time.perf_counter()
        costs = calibration.calibrate(job)
        wall = time.perf_counter() - t0
        runs.append(
            {
                "wall_s": wall,
                "load_1m_before": load_before,
                "load_1m_after": os.getloadavg()[0],
                "stage_s": dict(stage_s),
                "figures": figures(costs),
            }
        )
        print(
            f"run {i + 1}/{args.runs}: {wall:.1f} s, load {load_before:.2f} -> "
            f"{runs[-1]['load_1m_after']:.2f}; stages "
            + ", ".join(f"{k} {v:.1f}" for k, v in stage_s.items()),
            flush=True,
        )

    names = list(runs[0]["figures"])
    table = {n: [r["figures"][n] for r in runs] for n in names}
    spreads = {n: spread(v) for n, v in table.items()}
    width = max(len(n) for n in names)
    print(
        f"\n{'figure':<{width}}  "
        + "  ".join(f"{'run ' + str(i + 1):>11}" for i in range(len(runs)))
        + "   spread"
    )
    for n in sorted(names, key=lambda n: -spreads[n] if math.isfinite(spreads[n]) else -1e9):
        vals = "  ".join(f"{v:11.4g}" for v in table[n])
        print(f"{n:<{width}}  {vals}   {spreads[n]:.3f}")
    walls = [r["wall_s"] for r in runs]
    print(f"\nwall per calibration: {', '.join(f'{w:.1f}' for w in walls)} s")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "calibration_module": calibration.__file__,
                    "runs": runs,
                    "spread": {n: (s if math.isfinite(s) else None) for n, s in spreads.items()},
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
