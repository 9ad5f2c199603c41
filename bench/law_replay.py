"""Replay bench/simulate.py's validation with today's rate law, from its saved JSON.

    python bench/law_replay.py RUN.json [RUN.json ...] [--chain-utilisation 0.81]

For each ``--json`` file of ``bench/simulate.py`` it re-predicts every real
config from the run's own calibrated costs and the cores probed in each of its
rounds (no new runs), and prints the signed error per config (positive: the
law predicts more rows/s than were measured) and the all-reduce figure that
would have made that config exact, the other figures as calibrated (a
bisection of the law on ``allreduce_s_per_step``; "none" when the config
measured faster than the law even with no all-reduce). A diagnosis of where
the validation error comes from (docs/deploy.md, "An eighth run, and the
errors' signs"); it measures nothing. Costs saved before ``chain_utilisation``
existed (costs version 4) take ``--chain-utilisation``. A paired run (one
calibration per round, bench/simulate.py's default since 2026-12-03) is
replayed as it was validated: each round from its own calibration.

``--pool-multi`` replays every run with the figures timed in the multi-process
layout (``MULTI_PROCESS``: the PS and RPC requests' and the all-reduce's) at
their median over all the given runs' calibrations (a paired run counts each
of its rounds' calibrations, so it weighs as many times as it has rounds),
the other figures each run's own: how much of the error one
calibration's reading of them makes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from simulate import pool, read_real, validate

from estuary.plan.costs import ADDED_IN_6, COSTS_VERSION, Costs

# The figures `calibration._layout_costs` times with several processes at once.
MULTI_PROCESS = (
    "rpc_s_per_request",
    "rpc_s_per_id",
    "rpc_sharded_s_per_request",
    "rpc_sharded_s_per_id",
    "ps_s_per_request",
    "ps_s_per_id",
    "allreduce_s_per_step",
)


def load_run(path: Path, chain: float) -> tuple[Costs, list[Costs] | None]:
    """A bench/simulate.py JSON's costs (a version-4 file's ``chain_utilisation``
    is ``chain``), and a paired run's per-round calibrations (None otherwise)."""
    run = json.loads(path.read_text())

    def costs_of(raw: dict[str, Any]) -> Costs:
        raw = dict(raw)
        raw.setdefault("chain_utilisation", chain)
        for name in ADDED_IN_6:
            raw.setdefault(name, 1.0)  # before version 6: the law without them
        raw["version"] = COSTS_VERSION
        return Costs.from_dict(raw, source=str(path))

    paired = [costs_of(c) for c in run.get("calibrations", [])]
    return costs_of(run["costs"]), paired or None


def calibrations(path: Path, chain: float) -> list[Costs]:
    """Every calibration of a run: one, or a paired run's one per round."""
    costs, paired = load_run(path, chain)
    return paired or [costs]


def pooled_multi(costs: list[Costs]) -> dict[str, float]:
    """Each ``MULTI_PROCESS`` figure's median over ``costs``."""
    return {name: statistics.median(getattr(c, name) for c in costs) for name in MULTI_PROCESS}


def with_figures(
    costs: Costs, paired: list[Costs] | None, **figures: float
) -> tuple[Costs, list[Costs] | None]:
    """``costs`` and every round's calibration with ``figures`` in place of theirs."""
    return replace(costs, **figures), (
        None if paired is None else [replace(c, **figures) for c in paired]
    )


def predicted(costs: Costs, cfg: dict[str, Any], paired: list[Costs] | None = None) -> float:
    """The law's rows/s of one real config, as bench/simulate.py's validation has it."""
    return float(validate(paired or costs, [cfg])[0]["predicted_rows_per_s"])


def implied_allreduce(
    costs: Costs, cfg: dict[str, Any], paired: list[Costs] | None = None, hi: float = 0.05
) -> float | None:
    """The ``allreduce_s_per_step`` at which the law meets the measured rows/s (in
    every round's calibration of a paired run)."""
    measured = cfg["rows_per_s"]

    def over(ar: float) -> bool:
        c, p = with_figures(costs, paired, allreduce_s_per_step=ar)
        return predicted(c, cfg, p) > measured

    lo = 0.0
    if not over(lo):
        return None
    while over(hi) and hi < 1.0:  # a config far slower than the law: widen the search
        hi *= 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if over(mid) else (lo, mid)
    return lo


def replay(path: Path, chain: float, multi: dict[str, float] | None = None) -> dict[str, Any]:
    """The run at ``path`` re-predicted (``multi``: those figures instead of its own);
    a paired run's rounds each from their own calibration, as it was validated."""
    costs, paired = load_run(path, chain)
    if multi is not None:
        costs, paired = with_figures(costs, paired, **multi)
    real = pool([read_real(path)])  # its rounds, as bench/simulate.py --real reads them
    configs = []
    for cfg, v in zip(real, validate(paired or costs, real), strict=True):
        measured, pred = v["measured_rows_per_s"], v["predicted_rows_per_s"]
        configs.append(
            {
                "config": v["config"],
                "measured": measured,
                "predicted": pred,
                "signed_error": (pred - measured) / measured,
                "implied_allreduce_s": (
                    implied_allreduce(costs, cfg, paired) if cfg["trainers"] > 1 else None
                ),
            }
        )
    return {
        "file": str(path),
        # A paired run's: the median over its calibrations (each round had its own).
        "calibrations": 1 if paired is None else len(paired),
        "allreduce_s_per_step": costs.allreduce_s_per_step,
        "ps_s_per_request": costs.ps_s_per_request,
        "validation_error": max(abs(c["signed_error"]) for c in configs),
        "configs": configs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="bench/simulate.py --json files")
    ap.add_argument(
        "--chain-utilisation",
        type=float,
        default=0.81,
        help="for costs saved before the figure existed (default 0.81: calibrations "
        "since have read 0.79-0.85)",
    )
    ap.add_argument(
        "--pool-multi",
        action="store_true",
        help="the multi-process figures at their median over all the given runs",
    )
    ap.add_argument("--json", type=Path, help="write the replay here too")
    args = ap.parse_args()
    multi = None
    if args.pool_multi:
        every = [c for p in args.runs for c in calibrations(p, args.chain_utilisation)]
        multi = pooled_multi(every)
    out = [replay(path, args.chain_utilisation, multi) for path in args.runs]
    for r in out:
        median = f" (median of {r['calibrations']} calibrations)" if r["calibrations"] > 1 else ""
        print(
            f"{r['file']}: allreduce{median} {r['allreduce_s_per_step'] * 1e3:.1f} ms, "
            f"ps request {r['ps_s_per_request'] * 1e3:.2f} ms, "
            f"validation_error {r['validation_error']:.3f}"
        )
        for c in r["configs"]:
            ar = c["implied_allreduce_s"]
            implied = (
                ""
                if c["config"].startswith("1x")
                else ("none" if ar is None else f"{ar * 1e3:.1f} ms")
            )
            print(
                f"  {c['config']:>4} measured {c['measured']:>9,.0f} predicted "
                f"{c['predicted']:>9,.0f} {c['signed_error']:+.3f}  implied all-reduce {implied}"
            )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
