"""Real ``estuary train`` runs for bench/simulate.py's validation (importable and runnable).

    python bench/simulate_real.py [--json PATH] [--repeats 3] [--epochs 6]
                                  [--configs 1x0,2x1,2x2,3x1]

Each config ``WxS`` is ``estuary train examples/criteo.yaml --nproc W --set
runtime.ps_shards=S`` (``1x0``: one process, in-process tables) with one torch
thread per trainer (``train.threads=1``: on a shared 2-core machine two threads
per trainer slow the step 3-5x whenever another process holds a core), batch
1024 rows per trainer, ``--epochs`` passes over the 31k training rows (default
6: the steady window below is 5 epochs, 2-3 s here). The figure
is the steady state the simulator predicts: rows over wall time from the end of
the first epoch to the last step, from rank 0's ``timeseries.jsonl`` samples (the
first epoch holds every id's first insert, the first calls into numba's and
torch's code and DDP's first-step set-up: the first step alone took 0.37 s in a
2x1 run, ~8 steady steps); ``rows_per_s_with_warmup`` keeps the run's
``samples_per_s`` (rows over the whole training loop). Rounds interleave the
configs and the median over ``--repeats`` rounds is kept, with every round's value,
the load average and the steady window's seconds (``steady_window_s``).
Around each run a probe measures the CPU the machine has free (busy loops for
1 s, before and after; their mean): ``cores_1`` for one process, ``cores_n`` for
as many as the run has. The simulator is given those cores, since on a shared
machine they, not the nominal 2, are what the run had. The same loops count
their iterations per CPU second (``loops_1``, ``loops_n``): how fast a core of
this guest runs, which moves by up to 1.5x within minutes with no steal time
shown. Recorded beside each run (and around each calibration of a paired
bench/simulate.py run), not used by its figure (docs/deploy.md, "Paired calibration").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "examples" / "criteo.yaml"
BATCH_ROWS = 1024
# 6 passes over the 31k training rows: the steady figure (epochs 2-6) spans ~155k
# rows, 2-3 s at these rates; with 3 it spanned ~62k rows, about 1 s, so one
# 0.1 s hiccup (another process, a GC pause) moved a round's figure by ~10%.
EPOCHS = 6


_PROBE = (
    "import time\n"
    "t0, c0, n = time.perf_counter(), time.process_time(), 0\n"
    "while time.perf_counter() - t0 < {s}: n += 1\n"
    "print(time.process_time() - c0, n)\n"
)


def probe(processes: int, seconds: float = 1.0) -> tuple[float, float]:
    """Cores ``processes`` busy processes get right now, their CPU seconds over
    ``seconds`` of wall time (2.0 on an idle 2-core machine with 2 or more), and
    how fast a core runs: the loop's iterations per CPU second, mean over them
    (the guest's speed, which moves with the host's other tenants though no
    steal time shows)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PROBE.format(s=seconds)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(processes)
    ]
    cpu, rates = 0.0, []
    for p in procs:
        out, _ = p.communicate()  # Blocking wait: each probe runs `seconds`
        used, loops = out.split()
        cpu += float(used)
        rates.append(int(loops) / max(float(used), 1e-9))
    return cpu / seconds, statistics.mean(rates)


def steady_samples(timeseries: Path, rows_per_epoch: int) -> list[tuple[float, int]]:
    """(wall time, cumulative rows) of every sample of ``timeseries`` (rank 0's
    ``timeseries.jsonl``) at or past the end of the first epoch."""
    samples = []
    for line in timeseries.read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "sample" and "rows" in record:
            samples.append((float(record["time"]), int(record["rows"])))
    return [s for s in samples if s[1] >= rows_per_epoch]


def steady_window(timeseries: Path, rows_per_epoch: int) -> tuple[float, float] | None:
    """(rows/s, seconds) between the first sample at or past the end of the first
    epoch and the last sample of ``timeseries`` (``steady_samples``); ``None``
    with fewer than two."""
    after = steady_samples(timeseries, rows_per_epoch)
    if len(after) < 2 or after[-1][0] <= after[0][0]:
        return None
    seconds = after[-1][0] - after[0][0]
    return (after[-1][1] - after[0][1]) / seconds, seconds


def train_command(trainers: int, shards: int, epochs: int, out: str) -> list[str]:
    """The ``estuary train`` command of config ``trainers`` x ``shards`` (module doc)."""
    cmd = [
        sys.executable,
        "-m",
        "estuary.cli",
        "train",
        str(JOB),
        "--output",
        out,
        "--no-progress",
        "-q",
        "--set",
        f"train.batch_size={BATCH_ROWS}",
        "--set",
        "train.threads=1",
        "--set",
        f"train.epochs={epochs}",
    ]
    if trainers > 1 or shards > 0:
        cmd += ["--nproc", str(trainers), "--set", f"runtime.ps_shards={shards}"]
    return cmd


def train_env() -> dict[str, str]:
    """The environment of a run: this checkout's sources first."""
    return dict(os.environ, PYTHONPATH=str(ROOT / "src"))


def run_once(trainers: int, shards: int, epochs: int) -> dict[str, Any]:
    """One ``estuary train`` run; its summary's rows/s and profile, and the cores
    a probe got just before and just after it (``cores_1``: one process;
    ``cores_n``: as many processes as the run has)."""
    processes = trainers + shards
    (before_1, loops_1_before), (before_n, loops_n_before) = probe(1), probe(processes)
    with tempfile.TemporaryDirectory(prefix="estuary-sim-") as out:
        cmd = train_command(trainers, shards, epochs, out)
        load = os.getloadavg()[0]
        subprocess.run(cmd, check=True, env=train_env(), stdout=subprocess.DEVNULL)
        summary = json.loads((Path(out) / "summary.json").read_text())
        per_epoch = int(summary["train_rows"]) // max(epochs, 1)
        steady = steady_window(Path(out) / "timeseries.jsonl", per_epoch)
    (after_1, loops_1_after), (after_n, loops_n_after) = probe(1), probe(processes)
    return {
        "rows_per_s": summary["samples_per_s"] if steady is None else steady[0],
        "steady_window_s": None if steady is None else steady[1],
        "rows_per_s_with_warmup": summary["samples_per_s"],
        "load_avg_1m": load,
        "cores_1": (before_1 + after_1) / 2,
        "cores_n": (before_n + after_n) / 2,
        "loops_1": (loops_1_before + loops_1_after) / 2,
        "loops_n": (loops_n_before + loops_n_after) / 2,
        "train_wall_s": summary["train_wall_s"],
        "profile": summary.get("profile", {}),
    }


def measure(
    configs: list[tuple[int, int]],
    repeats: int,
    epochs: int,
    before_round: Callable[[int], None] | None = None,
) -> list[dict[str, Any]]:
    """Median rows/s of each (W, S) config over ``repeats`` interleaved rounds;
    ``before_round(r)`` runs at the start of round ``r`` (bench/simulate.py's
    paired calibration)."""
    runs: dict[tuple[int, int], list[dict[str, Any]]] = {c: [] for c in configs}
    for r in range(repeats):
        if before_round is not None:
            before_round(r)
        for w, s in configs:
            runs[(w, s)].append(run_once(w, s, epochs))
            x = runs[(w, s)][-1]
            print(
                f"round {r}: {w}x{s} {x['rows_per_s']:,.0f} rows/s (load "
                f"{x['load_avg_1m']:.1f}, probed cores {x['cores_1']:.2f} / {x['cores_n']:.2f})",
                flush=True,
            )
    return [
        {
            "trainers": w,
            "ps_shards": s,
            "batch_rows": BATCH_ROWS,
            "epochs": epochs,
            "rows_per_s": statistics.median(x["rows_per_s"] for x in runs[(w, s)]),
            "rounds": runs[(w, s)],
            "load_avg_1m": [x["load_avg_1m"] for x in runs[(w, s)]],
        }
        for w, s in configs
    ]


def parse_configs(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        w, s = item.lower().split("x")
        out.append((int(w), int(s)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=EPOCHS)
    ap.add_argument("--configs", default="1x0,2x1,2x2,3x1")
    args = ap.parse_args()
    result = measure(parse_configs(args.configs), args.repeats, args.epochs)
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
