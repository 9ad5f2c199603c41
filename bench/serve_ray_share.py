"""``estuary serve --follow RUN --ray --replicas N``: what the preparers of one node
cost, shared (one ``NodePreparer`` actor and its two slot files for the node)
against per replica (each replica's own preparing child, as before).

Trains bench/serve.py's job (``--rows``), lands its first checkpoint, deploys N
replicas following the folder on a local Ray instance, lands ``--versions``
more checkpoints ``--every-s`` apart, then reports: the preparing processes,
their CPU seconds from the first landing to the end divided by the versions
landed (polling included), and the slot files in ``/dev/shm`` (count, bytes
backed by memory: ``st_blocks``, and apparent size). Prints JSON (``--json``
writes it too).

    python bench/serve_ray_share.py --rows 40000 --versions 10
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import ray
from ray import serve

from estuary.serve.node_preparer import NAMESPACE, actor_name
from estuary.serve.ray_serve import EstuaryReplica
from estuary.serve.server import Served, ServeOptions, open_served

_spec = importlib.util.spec_from_file_location("bench_serve", Path(__file__).with_name("serve.py"))
assert _spec is not None and _spec.loader is not None
bench_serve = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_serve)


class PerReplica(EstuaryReplica):
    """The replica as it was: its own preparing child and slot files."""

    def __init__(self, export_dir: Path | None, follow: Path | None, options: ServeOptions) -> None:
        self.options = options
        self.served: Served = open_served(export_dir, follow, options)
        if self.served.follower is not None:
            self.served.follower.start()


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_of(run: Path) -> list[int]:
    """The preparing child processes following ``run``."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"estuary.serve.prepare_process" in cmd and str(run).encode() in cmd:
                found.append(int(proc.name))
    return found


def slot_files(pids: list[int]) -> list[Path]:
    """The slot files in /dev/shm written by ``pids`` (named ``<pid>-<n>.slot``)."""
    prefixes = tuple(f"{p}-" for p in pids)
    return [
        p for p in Path("/dev/shm").glob("estuary-serve-*/*.slot") if p.name.startswith(prefixes)
    ]


def predict(port: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    body = json.dumps({"instances": rows}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/predict", data=body)
    with urllib.request.urlopen(request, timeout=60) as reply:
        answer: dict[str, Any] = json.loads(reply.read())
    return answer


def measure(
    mode: str,
    src: Path,
    folder: Path,
    held: list[dict[str, Any]],
    replicas: int,
    versions: int,
    every_s: float,
    port: int,
) -> dict[str, Any]:
    names = sorted(p.name for p in (src / "checkpoints").iterdir() if p.name.startswith("step-"))
    root = folder / "checkpoints"
    root.mkdir(parents=True)
    bench_serve.land(src / "checkpoints" / names[0], root)
    options = ServeOptions(port=port, poll_s=0.1)
    cls = PerReplica if mode == "per-replica" else EstuaryReplica
    ingress = serve.ingress()(cls)
    app = serve.deployment(name="estuary", num_replicas=replicas)(ingress).bind(
        None, folder, options
    )
    serve.start(http_options={"host": "127.0.0.1", "port": options.port})
    serve.run(app, name="estuary", route_prefix="/", blocking=False)
    deadline = time.monotonic() + 300
    while True:  # until the preparers run
        if mode == "per-replica":
            pids = children_of(folder)
        else:
            try:
                name = actor_name("estuary", folder, ray.get_runtime_context().get_node_id())
                state = ray.get(ray.get_actor(name, namespace=NAMESPACE).state.remote())
                pids = [state["pid"]] if len(state["subscribers"]) == replicas else []
            except ValueError:
                pids = []
        if len(pids) == (replicas if mode == "per-replica" else 1):
            break
        assert time.monotonic() < deadline, f"{mode}: preparers not running"
        time.sleep(0.5)
    time.sleep(3)  # the children's start (imports, base version) out of the count
    before = {p: cpu_s(p) for p in pids}
    for name in names[1 : 1 + versions]:
        bench_serve.land(src / "checkpoints" / name, root)
        time.sleep(every_s)
    last = names[min(versions, len(names) - 1)]
    caught_up = time.monotonic()
    while True:  # until every replica serves the last (20 answers in a row name it)
        answers = [predict(options.port, held)["model_version"] for _ in range(20)]
        if all(a.endswith(f"@{last}") for a in answers):
            break
        assert time.monotonic() < caught_up + 300, f"{mode}: not serving {last}: {answers}"
        time.sleep(0.5)
    spent = sum(cpu_s(p) - before[p] for p in pids)
    files = slot_files(pids)
    result = {
        "mode": mode,
        "replicas": replicas,
        "versions": min(versions, len(names) - 1),
        "preparing_processes": len(pids),
        "prepare_cpu_s_per_version": spent / max(1, min(versions, len(names) - 1)),
        "slot_files": len(files),
        "shm_bytes_backed": sum(p.stat().st_blocks * 512 for p in files),
        "shm_bytes_apparent": sum(p.stat().st_size for p in files),
        "seconds_to_serve_last": round(time.monotonic() - caught_up, 2),
    }
    serve.delete("estuary")
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=40_000, help="training rows")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--versions", type=int, default=10, help="checkpoints landed")
    parser.add_argument("--every-s", type=float, default=1.0, help="seconds between them")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="estuary-share-") as tmp:
        work = Path(tmp)
        held = bench_serve.train(work, args.rows)
        rows = [{k: v for k, v in row.items() if k != "label"} for row in held[:8]]
        port = bench_serve.free_port()
        ray.init(num_cpus=8, include_dashboard=False, logging_level="WARNING")
        results = [
            measure(
                mode,
                work / "run",
                work / f"follow-{mode}",
                rows,
                args.replicas,
                args.versions,
                args.every_s,
                port,  # Ray Serve's proxy keeps the port it started on
            )
            for mode in ("per-replica", "shared")
        ]
        serve.shutdown()
        ray.shutdown()
    out = {"load_avg": os.getloadavg(), "results": results}
    print(json.dumps(out, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
