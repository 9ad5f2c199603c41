"""Where a sync step's shard phase goes: W clients against S PS servers, no torch.

    python bench/shard_phase.py [--layouts 1x1,1x2,2x1,2x2] [--compute-ms 14]
                                [--rounds 5] [--steps 30] [--json PATH]

Each layout runs ``estuary.plan.probes.ps_layout_rounds`` on the data of
bench/simulate_real.py's job (examples/criteo.yaml, batch 1024): W client
processes against S ``ServerProcess``es in sync mode (``world_size`` W,
staleness 0, so the clients move in lockstep through the servers' barrier), a
busy loop of ``--compute-ms`` CPU standing for the dense step between each
lookup and push, after a warm-up of one pass over the batches. Per step, the
medians over ``--rounds`` windows of ``--steps`` steps: wall time, one
client's own CPU (the busy loop taken off), all servers' CPU, and the *chain*
(wall less the busy loop and the client's own CPU). It prints, too, the rate
law's chain (the client's CPU, then the hottest shard's: ``estuary.plan.model``)
over the measured one (chain + client's CPU). A diagnosis, not a figure of the
validation: nothing here feeds the calibration or the simulator
(docs/deploy.md, "The training loop timed after its first epoch").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import simulate_real

from estuary.config import load_job
from estuary.plan import calibration
from estuary.plan.probes import ps_layout_rounds
from estuary.ps.types import HostedTable


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default="1x1,1x2,2x1,2x2", help="WxS, comma-separated")
    ap.add_argument("--compute-ms", type=float, default=14.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    compute = args.compute_ms / 1e3
    layouts = [tuple(int(x) for x in s.split("x")) for s in args.layouts.split(",")]

    job = load_job(simulate_real.JOB, [f"train.batch_size={simulate_real.BATCH_ROWS}"])
    _, _, unique, _, _ = calibration._data_costs(job, 1)
    features = list(unique[0])
    tables = {f: HostedTable(job.table_spec(f), seed=i) for i, f in enumerate(features)}
    full = [[b[f] for f in features] for b in unique]
    warm = calibration._ps_warmup(10, len(full))  # one pass: the runs' first epoch
    out = []
    print(
        f"{'WxS':>4} {'wall':>7} {'client':>7} {'servers':>8} {'/shard':>7} "
        f"{'chain':>7} {'meas/law':>8}"
    )
    for w, s in layouts:
        timed = ps_layout_rounds(
            tables,
            [full],
            features,
            w,
            s,
            steps=args.steps,
            warmup=warm,
            rounds=args.rounds,
            compute_s=compute,
        )
        wall = statistics.median(r[0].wall_s for r in timed)
        client = statistics.median(r[0].client_cpu_s for r in timed) - compute
        servers = statistics.median(r[0].server_cpu_s for r in timed)
        chain = wall - compute - client
        law = client + servers / s  # the client's CPU, then the hottest (an even) shard's
        row = {
            "layout": f"{w}x{s}",
            "wall_ms": wall * 1e3,
            "client_cpu_ms": client * 1e3,
            "servers_cpu_ms": servers * 1e3,
            "chain_ms": chain * 1e3,
            "measured_over_law": (chain + client) / law,
        }
        out.append(row)
        print(
            f"{w}x{s:<2} {wall * 1e3:>7.2f} {client * 1e3:>7.2f} {servers * 1e3:>8.2f} "
            f"{servers / s * 1e3:>7.2f} {chain * 1e3:>7.2f} {row['measured_over_law']:>8.2f}",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps({"compute_ms": args.compute_ms, "layouts": out}, indent=1))


if __name__ == "__main__":
    main()
