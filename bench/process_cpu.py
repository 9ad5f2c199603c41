"""Where one real run's time goes: every process's CPU per step in its steady state.

    python bench/process_cpu.py WxS [--epochs 6] [--costs PATH] [--json PATH]

Runs config ``WxS`` exactly as bench/simulate_real.py does (``estuary train
examples/criteo.yaml``, W trainers, S PS shards, one torch thread, batch 1024),
reads every process of the run from /proc every 0.1 s, and reports over the
steady window (the first time-series sample after epoch 1 to the last one):
each process's CPU seconds per step (user + system, clock ticks of 10 ms: ~1%
over a 2-3 s window), their sum, and the cores the job used (that sum over the
window's wall time). A job whose processes overlapped as the rate law's phases say
uses more cores than one whose step is a chain. With ``--costs`` it also prints
the law's figures for the layout (trainer and all shards' CPU a step, the step)
so the two can be compared process by process. With ``--threads`` it reads
every thread's ``/proc/PID/task/TID/schedstat`` too and prints, per thread, its
CPU and its run-queue wait a step (the time it was runnable but waited for a
core: where 4 processes share 2 cores, the wake-ups that wait) and its time
slices a step (docs/deploy.md, "Where 2x2's extra step goes"). A diagnosis, not
a figure of the validation: nothing here feeds the calibration or the simulator.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

import simulate_real

from estuary.plan.costs import load_costs
from estuary.plan.model import Layout, predict_shared

SAMPLE_EVERY_S = 0.1


def _tree(root: int) -> list[int]:
    """``root`` and every process descended from it (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone since the listing
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    out, stack = [], [root]
    while stack:
        pid = stack.pop()
        out.append(pid)
        stack.extend(children.get(pid, []))
    return out


def _cpu_s(pid: int) -> float | None:
    """CPU seconds of ``pid`` so far, its exited threads included (/proc ticks)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _threads(pid: int) -> dict[int, tuple[str, float, float, int]]:
    """tid -> (name, CPU s, run-queue wait s, time slices) of ``pid``'s live threads
    (``/proc/PID/task/TID/schedstat``: nanoseconds on a core, waiting for one, slices)."""
    out: dict[int, tuple[str, float, float, int]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:  # gone
        return out
    for tid in tids:
        try:
            run_ns, wait_ns, slices = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except (OSError, ValueError):  # exited since the listing
            continue
        out[int(tid)] = (name, int(run_ns) / 1e9, int(wait_ns) / 1e9, int(slices))
    return out


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[-70:]
    except OSError:
        return "?"


def measure(trainers: int, shards: int, epochs: int, *, threads: bool = False) -> dict[str, Any]:
    """One run of ``trainers`` x ``shards``: per process CPU a step over the steady
    window, with the load average before and after; with ``threads``, per thread
    CPU, run-queue wait and time slices a step too."""
    samples: list[tuple[float, dict[int, float]]] = []
    thread_samples: list[dict[tuple[int, int], tuple[str, float, float, int]]] = []
    names: dict[int, str] = {}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="estuary-cpu-") as out:
        cmd = simulate_real.train_command(trainers, shards, epochs, out)
        run = subprocess.Popen(cmd, env=simulate_real.train_env(), stdout=subprocess.DEVNULL)
        while run.poll() is None:
            now, cpu = time.time(), {}
            for pid in _tree(run.pid):
                value = _cpu_s(pid)
                if value is not None:
                    cpu[pid] = value
                    names.setdefault(pid, _name(pid))
            samples.append((now, cpu))
            if threads:
                thread_samples.append(
                    {(pid, tid): t for pid in cpu for tid, t in _threads(pid).items()}
                )
            time.sleep(SAMPLE_EVERY_S)
        if run.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited with {run.returncode}")
        summary = json.loads((Path(out) / "summary.json").read_text())
        per_epoch = int(summary["train_rows"]) // max(epochs, 1)
        steady = simulate_real.steady_samples(Path(out) / "timeseries.jsonl", per_epoch)
    if len(steady) < 2:
        raise RuntimeError("fewer than two time-series samples after the first epoch")
    (t0, rows0), (t1, rows1) = steady[0], steady[-1]
    # The /proc readings nearest the window's ends (0.1 s apart at most).
    a = min(samples, key=lambda s: abs(s[0] - t0))
    b = min(samples, key=lambda s: abs(s[0] - t1))
    steps = (rows1 - rows0) / (trainers * simulate_real.BATCH_ROWS)
    both = [pid for pid in b[1] if pid in a[1]]
    per_process = {pid: (b[1][pid] - a[1][pid]) / steps for pid in both}
    wall = b[0] - a[0]
    per_thread: dict[str, dict[str, float]] = {}
    if threads:
        ta, tb = thread_samples[samples.index(a)], thread_samples[samples.index(b)]
        for key in tb.keys() & ta.keys():
            name, cpu_s, wait_s, slices = tb[key]
            per_thread[f"{key[0]}/{key[1]} {name}"] = {
                "cpu_s": (cpu_s - ta[key][1]) / steps,
                "runqueue_wait_s": (wait_s - ta[key][2]) / steps,
                "slices": (slices - ta[key][3]) / steps,
            }
    return {
        "config": f"{trainers}x{shards}",
        "rows_per_s": (rows1 - rows0) / (t1 - t0),
        "window_s": t1 - t0,
        "steps": steps,
        "step_s": (t1 - t0) / steps,
        "cpu_s_per_step": {f"{pid} {names[pid]}": cpu for pid, cpu in per_process.items()},
        "cpu_s_per_step_all": sum(per_process.values()),
        "cores_used": sum(per_process.values()) * steps / wall if wall > 0 else None,
        "load_avg_1m": [load_before, os.getloadavg()[0]],
        "per_thread_per_step": per_thread,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="WxS, e.g. 2x1")
    ap.add_argument("--epochs", type=int, default=simulate_real.EPOCHS)
    ap.add_argument("--costs", type=Path, help="a calibration, to print the law's figures")
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--threads", action="store_true", help="per thread CPU and run-queue wait a step"
    )
    args = ap.parse_args()
    ((w, s),) = simulate_real.parse_configs(args.config)
    got = measure(w, s, args.epochs, threads=args.threads)
    print(
        f"{got['config']}: {got['rows_per_s']:,.0f} rows/s over {got['window_s']:.1f} s, "
        f"step {1e3 * got['step_s']:.1f} ms, load {got['load_avg_1m'][0]:.1f} -> "
        f"{got['load_avg_1m'][1]:.1f}"
    )
    for name, cpu in sorted(got["cpu_s_per_step"].items(), key=lambda x: -x[1]):
        if cpu > 1e-4:
            print(f"  {1e3 * cpu:6.2f} ms CPU a step  {name}")
    print(
        f"  {1e3 * got['cpu_s_per_step_all']:6.2f} ms CPU a step in all: "
        f"{got['cores_used']:.2f} cores used"
    )
    if args.threads:
        threads = got["per_thread_per_step"]
        for name, t in sorted(threads.items()):
            if t["cpu_s"] + t["runqueue_wait_s"] > 5e-5:
                print(
                    f"  {1e3 * t['cpu_s']:6.2f} ms CPU, {1e3 * t['runqueue_wait_s']:6.2f} ms "
                    f"waiting for a core, {t['slices']:5.1f} slices a step  {name}"
                )
        wait = sum(t["runqueue_wait_s"] for t in threads.values())
        print(f"  {1e3 * wait:6.2f} ms a step in all that threads waited for a core")
    if args.costs:
        costs = load_costs(args.costs)
        # As bench/simulate.py predicts a round, on an idle machine (probes 1 and all cores).
        layout = Layout(w, s, 0, simulate_real.BATCH_ROWS, preloaded=True)
        law = predict_shared(costs, layout, cores_1=1.0, cores_n=float(costs.cores))
        b = simulate_real.BATCH_ROWS
        got["law"] = {
            "step_s": law.step_s,
            "trainer_cpu_s_per_step": law.cpu_s_per_row["trainer"] * b,
            "shards_cpu_s_per_step": law.cpu_s_per_row["ps"] * w * b,
            "rows_per_s": law.rows_per_s,
        }
        print(
            f"  law: trainer {1e3 * got['law']['trainer_cpu_s_per_step']:.2f} ms CPU a step each, "
            f"shards {1e3 * got['law']['shards_cpu_s_per_step']:.2f} ms in all, step "
            f"{1e3 * law.step_s:.1f} ms, {law.rows_per_s:,.0f} rows/s ({law.bottleneck})"
        )
    if args.json:
        args.json.write_text(json.dumps(got, indent=1))


if __name__ == "__main__":
    main()
