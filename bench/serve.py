"""Benchmark: the prediction server's latency and throughput, still and under live updates.

    python bench/serve.py [--json PATH] [--duration-s 10] [--rounds 3] [--concurrency 8]
                          [--rows 180000] [--prepare process|thread]

Needs ``hey`` (a standard HTTP load generator; Debian package ``hey``, see
bench/install-extras.sh) and the serve extra. Everything runs on loopback
(127.0.0.1) and is bounded: a load is hey runs of a fixed count (``-n``, 20
requests a client) one after another until ``--duration-s`` has passed; each
request times out after 10 s and each hey run is killed after 300 s.

Steps:

1. Data and a run: ``--rows`` Criteo-like rows (13 counts, 26 categorical
   columns, Zipf ids over vocabularies of 1e3..1e5) in a TSV; a DLRM (dim 16,
   bottom 13-64-16, top 64-1) trained one epoch with batch 512 and a checkpoint
   every 4 steps, the first full and the rest deltas of one chain.
2. The server: ``estuary serve --follow RUN --dense-every-s 10 --poll-s 0.05
   --prepare P`` (``--prepare``: process by default) in a subprocess,
   following a folder that holds only the first (full) checkpoint.
3. Still: hey posts one fixed body of 1 row (``--concurrency`` clients), then
   one of 256 rows (``--concurrency`` / 2 clients), each for ``--duration-s``:
   p50 / p99 latency over every reply (hey's per-request CSV), rows/s.
4. Under updates: the same two loads while the training run's delta checkpoints
   land in the followed folder one per second (copied in under a temporary name,
   renamed, then ``latest`` replaced: as a trainer on another machine writes
   them to a shared file system), so the server applies a delta every second
   and swaps the dense network every 10 s. Freshness: a thread reads /healthz
   every 20 ms; a checkpoint's event -> servable time is from its ``latest``
   replace to the first /healthz naming it.
   Steps 3 and 4 alternate for ``--rounds`` rounds (even rounds still first,
   odd rounds under updates first, so a drift of the machine's load favours
   neither). The ratio judged is pooled: the p99 of every reply under updates,
   all rounds, over the p99 of every reply still. The latency figures are each
   its best round (lowest p99): other processes on a shared machine only slow
   a load down. Every round's figures are in the JSON (``rounds``).
5. Row encodings: the run's final checkpoint exported with float32, float16,
   bfloat16 and int8 rows, each served in-process on the held-out last 20% of
   the rows: AUC, table file bytes and the served tables' resident bytes.

The checkpoints are written before step 4 (by a real training run), so the
figures under updates measure the server's cost of applying them, not a
trainer's CPU competing with it on this machine.

JSON keys: ``latency.b1.p50_ms``, ``latency.b1.p99_ms``, ``latency.b256.p50_ms``,
``latency.b256.p99_ms``, ``rows_per_s.b1``, ``rows_per_s.b256`` (still), the same
under ``under_updates``, ``ratios.p99_under_updates`` (the larger of the b1 and
b256 ratios pooled p99 under updates / pooled p99 still, each also given as
``ratios.p99_under_updates_b1`` / ``_b256``; the pooled p99s in
``pooled_p99_ms``), ``ratios.best_round`` (the ratio of the best rounds' p99s,
the judged figure before), ``ratios.per_round`` and ``ratios.median_of_rounds``
(each round's ratio, and their median), ``failed_requests``
(non-200 replies and transport errors, all loads), ``freshness_p50_s``,
``freshness_max_s``, ``updates_applied``, ``update_stall_mean_ms`` (how long an
update held predictions back, from the server's metrics), ``update_cpu_mean_ms``
(the serving process's CPU time per update: its follower thread's),
``prepare_cpu_mean_ms`` (the preparing process's, ``--prepare process``),
``rows.<encoding>.auc``,
``.table_bytes`` (files) and ``.resident_table_bytes`` (the loaded export's
tables, ``ServingModel.table_bytes``), and the machine's ``cpus`` and load average.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import yaml

NUM_DENSE, NUM_SPARSE = 13, 26
BATCH = 512
EVERY_STEPS = 4
KEYS = ("b1", "b256")
PHASES = ("still", "under_updates")


def write_data(path: Path, rows: int, seed: int = 0) -> list[dict[str, Any]]:
    """Criteo-like TSV rows; returns the last 20% (the held-out rows) as dicts."""
    rng = np.random.default_rng(seed)
    vocab = np.logspace(3, 5, NUM_SPARSE).astype(np.int64)
    dense = rng.lognormal(1.0, 1.5, size=(rows, NUM_DENSE)).astype(np.int64)
    ids = np.stack([(rng.zipf(1.2, rows) - 1) % v for v in vocab], axis=1)
    logit = -1.5 + 0.6 * np.sin(ids[:, 0] * 0.37) + 0.4 * np.cos(ids[:, 1] * 0.11)
    labels = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    header = ["label", *(f"I{i + 1}" for i in range(NUM_DENSE))]
    header += [f"C{i + 1}" for i in range(NUM_SPARSE)]
    lines = ["\t".join(header)]
    held: list[dict[str, Any]] = []
    for r in range(rows):
        values = [str(labels[r]), *map(str, dense[r]), *(f"{v:x}" for v in ids[r])]
        lines.append("\t".join(values))
        if r >= rows - rows // 5:
            typed = [int(labels[r]), *dense[r].tolist(), *values[1 + NUM_DENSE :]]
            held.append(dict(zip(header, typed, strict=True)))
    path.write_text("\n".join(lines) + "\n")
    return held


def train(folder: Path, rows: int) -> list[dict[str, Any]]:
    held = write_data(folder / "train.tsv", rows)
    job = {
        "name": "bench",
        "data": {
            "sources": [{"path": "train.tsv", "format": "tsv"}],
            "schema": {
                "dense": [f"I{i + 1}" for i in range(NUM_DENSE)],
                "sparse": [f"C{i + 1}" for i in range(NUM_SPARSE)],
            },
            "eval_fraction": 0.2,
        },
        "model": {
            "type": "dlrm",
            "params": {"bottom_mlp": [64, 16], "top_mlp": [64]},
            "embedding": {"default": {"dim": 16}},
        },
        "train": {"batch_size": BATCH, "epochs": 1, "threads": 1},
        "output": {
            "dir": "run",
            "progress": False,
            "checkpoint_every_steps": EVERY_STEPS,
            "checkpoint_full_every": 1000,
        },
    }
    (folder / "job.yaml").write_text(yaml.safe_dump(job))
    run = [sys.executable, "-m", "estuary.cli", "train", str(folder / "job.yaml"), "-q"]
    subprocess.run(run, check=True, timeout=600, stdout=subprocess.DEVNULL)
    return held


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return json.loads(reply.read())  # type: ignore[no-any-return]


def land(src: Path, root: Path) -> float:
    """One checkpoint lands as a trainer writes it; returns when ``latest`` names it."""
    tmp = root / f"{src.name}.tmp-bench"
    shutil.copytree(src, tmp)
    os.replace(tmp, root / src.name)
    (root / "latest.tmp").write_text(src.name + "\n")
    os.replace(root / "latest.tmp", root / "latest")
    return time.time()


def hey(url: str, body: Path, clients: int, requests: int) -> tuple[list[float], int]:
    """One hey run of ``requests`` requests: the latencies (s) of the 200 replies,
    and the failures (other replies, and requests with no reply: hey's CSV has a
    line per reply only)."""
    requests -= requests % clients  # hey splits -n evenly over its clients
    cmd = ["hey", "-n", str(requests), "-c", str(clients), "-t", "10", "-m", "POST"]
    cmd += ["-T", "application/json", "-D", str(body), "-o", "csv", url]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    records = list(csv.DictReader(io.StringIO(done.stdout)))
    ok = [float(r["response-time"]) for r in records if r["status-code"] == "200"]
    return ok, requests - len(ok)


def load(
    url: str, body: Path, clients: int, duration_s: float, pool: list[float] | None = None
) -> dict[str, float]:
    """hey runs of 20 requests a client, one after another, for ``duration_s``:
    p50/p99 latency (ms), requests, failures, rows/s; every reply's latency (s)
    is also added to ``pool``."""
    rows = len(json.loads(body.read_text())["instances"])
    latencies: list[float] = []
    failed = requests = 0
    started = time.perf_counter()
    while time.perf_counter() - started < duration_s:
        ok, bad = hey(url, body, clients, 20 * clients)
        latencies += ok
        failed += bad
        requests += len(ok) + bad
    wall_s = time.perf_counter() - started
    if pool is not None:
        pool += latencies
    return {
        "p50_ms": float(np.percentile(latencies, 50) * 1000) if latencies else float("nan"),
        "p99_ms": float(np.percentile(latencies, 99) * 1000) if latencies else float("nan"),
        "requests": requests,
        "failed": failed,
        "rows_per_s": len(latencies) * rows / wall_s,
        "wall_s": wall_s,
    }


def loads(
    url: str,
    bodies: dict[str, Path],
    clients: int,
    duration_s: float,
    pools: dict[str, list[float]],
) -> Any:
    """The b1 load (``clients`` clients), then the b256 load (half as many);
    latencies added to ``pools[key]``."""
    return {
        "b1": load(url, bodies["b1"], clients, duration_s, pools["b1"]),
        "b256": load(url, bodies["b256"], max(1, clients // 2), duration_s, pools["b256"]),
    }


def p99_ms(latencies: list[float]) -> float:
    return float(np.percentile(latencies, 99) * 1000) if latencies else float("nan")


def encodings(run: Path, held: list[dict[str, Any]], folder: Path) -> dict[str, Any]:
    from estuary.metrics.evaluation import evaluate_predictions
    from estuary.serve.export import ROW_ENCODINGS, export_checkpoint, load_export

    labels = np.array([row.pop("label") for row in held], dtype=np.float32)
    out: dict[str, Any] = {}
    for name in ROW_ENCODINGS:
        export = export_checkpoint(run, folder / f"export-{name}", rows=name).path
        model = load_export(export)
        chunks = [held[i : i + 4096] for i in range(0, len(held), 4096)]  # the row limit
        parts = [model.predict(model.pipeline.parse(rows)).probabilities for rows in chunks]
        probabilities = np.concatenate(parts)
        table_bytes = sum(f.stat().st_size for f in (export / "tables").iterdir())
        auc = evaluate_predictions(labels, probabilities).auc
        out[name] = {
            "auc": round(float(auc), 5),
            "table_bytes": table_bytes,
            "resident_table_bytes": model.table_bytes,  # rows kept as stored
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--duration-s", type=float, default=10.0, help="seconds per load")
    parser.add_argument("--concurrency", type=int, default=8, help="hey clients (b1)")
    parser.add_argument("--rows", type=int, default=180_000, help="training rows")
    parser.add_argument("--rounds", type=int, default=3, help="still + updating rounds")
    parser.add_argument(
        "--prepare",
        choices=("process", "thread"),
        default="process",
        help="the server's --prepare: updates prepared in a child process or on a thread",
    )
    args = parser.parse_args()
    if shutil.which("hey") is None:
        sys.exit("bench/serve.py needs hey: apt-get install -y hey (bench/install-extras.sh)")

    work = Path(tempfile.mkdtemp(prefix="estuary-bench-serve-"))
    try:
        t0 = time.time()
        held = train(work, args.rows)
        staged = sorted((work / "run" / "checkpoints").glob("step-*"))
        print(f"trained: {len(staged)} checkpoints in {time.time() - t0:.1f} s", file=sys.stderr)
        followed = work / "followed" / "checkpoints"
        followed.mkdir(parents=True)
        land(staged[0], followed)
        bodies = {}
        for key, n in (("b1", 1), ("b256", 256)):
            rows = [{k: v for k, v in row.items() if k != "label"} for row in held[:n]]
            bodies[key] = work / f"{key}.json"
            bodies[key].write_text(json.dumps({"instances": rows}))

        port = free_port()
        base = f"http://127.0.0.1:{port}"
        serve = ["serve", "--follow", str(followed.parent), "--host", "127.0.0.1"]
        serve += ["--port", str(port), "--dense-every-s", "10", "--poll-s", "0.05", "-q"]
        serve += ["--prepare", args.prepare]
        server = subprocess.Popen([sys.executable, "-m", "estuary.cli", *serve])
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    get_json(f"{base}/healthz")
                    break
                except OSError:
                    if time.monotonic() > deadline or server.poll() is not None:
                        raise RuntimeError("the server did not start") from None
                    time.sleep(0.2)
            url = f"{base}/predict"
            # Warm-up at the measured concurrency: first calls compile numba
            # kernels and grow buffers for every batch size the loads will see.
            for key in KEYS:
                load(url, bodies[key], args.concurrency if key == "b1" else 4, 4.0)
            landed: dict[str, float] = {}
            seen: dict[str, float] = {}
            landing, stop = threading.Event(), threading.Event()

            def lander() -> None:  # one checkpoint a second while ``landing`` is set
                # It stands for a trainer on another machine: on this one it
                # yields the CPU (a per-thread nice value on Linux).
                with contextlib.suppress(AttributeError, OSError):
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
                pending = iter(staged[1:])
                while not stop.is_set():
                    if not landing.wait(0.1) or stop.wait(1.0):
                        continue
                    src = next(pending, None)
                    if src is None:
                        return
                    landed[src.name] = land(src, followed)

            def watcher() -> None:
                while not stop.wait(0.02):
                    version = get_json(f"{base}/healthz")["model_version"]
                    name = version.split("@", 1)[1].split("+", 1)[0]
                    seen.setdefault(name, time.time())

            threads = [threading.Thread(target=f, daemon=True) for f in (lander, watcher)]
            for thread in threads:
                thread.start()
            rounds: list[dict[str, Any]] = []
            pools: dict[str, dict[str, list[float]]] = {
                phase: {k: [] for k in KEYS} for phase in PHASES
            }
            for i in range(args.rounds):  # still and under updates, interleaved
                # Even rounds run still first, odd ones under updates first, so a
                # drift of the machine's load does not favour one phase.
                figures: dict[str, Any] = {}
                for phase in PHASES if i % 2 == 0 else PHASES[::-1]:
                    if phase == "under_updates":
                        landing.set()
                    figures[phase] = loads(
                        url, bodies, args.concurrency, args.duration_s, pools[phase]
                    )
                    landing.clear()
                rounds.append({phase: figures[phase] for phase in PHASES})
                print(f"round {i}: {json.dumps(rounds[-1])}", file=sys.stderr)
            stop.set()
            for thread in threads:
                thread.join()
            metrics = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
        finally:
            server.terminate()
            server.wait(timeout=30)
        # Each figure: its best round (other processes on a shared machine only
        # slow a load down), as bench/train.py does.
        still = {k: min((r["still"][k] for r in rounds), key=lambda x: x["p99_ms"]) for k in KEYS}
        updating = {
            k: min((r["under_updates"][k] for r in rounds), key=lambda x: x["p99_ms"]) for k in KEYS
        }

        def sample(name: str) -> float:
            """A metric of the server's last scrape (0 when absent)."""
            for line in metrics.splitlines():
                if line.startswith(f"estuary_serve_{name} "):
                    return float(line.split()[-1])
            return 0.0

        def mean_ms(name: str) -> float | None:
            """The mean of a histogram of seconds, in ms (``None``: no sample)."""
            count = sample(f"{name}_count")
            return round(1000 * sample(f"{name}_sum") / count, 4) if count else None

        fresh = [seen[name] - at for name, at in landed.items() if name in seen]
        # p99 of every reply of a phase, all rounds pooled: the ratio judged.
        pooled = {phase: {k: p99_ms(pools[phase][k]) for k in KEYS} for phase in PHASES}
        ratios = {key: pooled["under_updates"][key] / pooled["still"][key] for key in KEYS}
        best_ratios = {key: updating[key]["p99_ms"] / still[key]["p99_ms"] for key in KEYS}
        per_round = {
            key: [r["under_updates"][key]["p99_ms"] / r["still"][key]["p99_ms"] for r in rounds]
            for key in KEYS
        }
        failed = sum(r[phase][k]["failed"] for r in rounds for phase in r for k in KEYS)
        result: dict[str, Any] = {
            "latency": {k: {m: round(still[k][m], 3) for m in ("p50_ms", "p99_ms")} for k in still},
            "rows_per_s": {k: round(still[k]["rows_per_s"], 1) for k in still},
            "load_s": {k: round(still[k]["wall_s"], 1) for k in still},
            "under_updates": {
                "latency": {
                    k: {m: round(updating[k][m], 3) for m in ("p50_ms", "p99_ms")} for k in updating
                },
                "rows_per_s": {k: round(updating[k]["rows_per_s"], 1) for k in updating},
            },
            "pooled_p99_ms": {p: {k: round(v, 3) for k, v in f.items()} for p, f in pooled.items()},
            "ratios": {
                "p99_under_updates": round(max(ratios.values()), 3),
                **{f"p99_under_updates_{k}": round(v, 3) for k, v in ratios.items()},
                "best_round": {k: round(v, 3) for k, v in best_ratios.items()},
                "per_round": {k: [round(v, 3) for v in vs] for k, vs in per_round.items()},
                "median_of_rounds": {
                    k: round(float(np.median(v)), 3) for k, v in per_round.items()
                },
            },
            "requests": sum(r[phase][k]["requests"] for r in rounds for phase in r for k in KEYS),
            "rounds": rounds,
            "failed_requests": failed,
            "updates_landed": len(landed),
            "updates_applied": sum(
                float(line.split()[-1])
                for line in metrics.splitlines()
                if line.startswith("estuary_serve_updates_total")
            ),
            "update_stall_mean_ms": round(1000 * sample("update_stall_seconds_sum") / count, 4)
            if (count := sample("update_stall_seconds_count"))
            else None,
            "update_cpu_mean_ms": mean_ms("update_cpu_seconds"),
            "prepare_cpu_mean_ms": mean_ms("prepare_cpu_seconds"),
            "freshness_p50_s": round(float(np.median(fresh)), 3) if fresh else None,
            "freshness_max_s": round(max(fresh), 3) if fresh else None,
            "rows": encodings(work / "run", held, work),
            "cpus": os.cpu_count(),
            "load_average_1m": round(os.getloadavg()[0], 2),
            "settings": {
                "load_s": args.duration_s,
                "concurrency_b1": args.concurrency,
                "concurrency_b256": max(1, args.concurrency // 2),
                "training_rows": args.rows,
                "rounds": args.rounds,
                "prepare": args.prepare,
            },
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
