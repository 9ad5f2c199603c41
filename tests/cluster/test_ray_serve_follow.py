"""``estuary serve --follow RUN --ray --replicas 2``: the replicas of the node
share one preparer (a Ray actor) and its two slot files, on the shared local
Ray instance. One test, in phases (a Ray Serve application takes tens of
seconds to start on this machine): both replicas serve each new version, one
preparer and two slot files exist, predictions equal the single-process
follower's; a silent subscriber and a killed replica are dropped while the
other replica keeps getting versions; a killed preparer is replaced, its
files removed; the preparer ends, its files removed,
when the application is deleted."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("ray.serve", reason="the ray-serve extra is not installed")

from estuary.serve.node_preparer import NAMESPACE, actor_name
from estuary.serve.ray_serve import run_on_ray
from estuary.serve.server import ServeOptions, open_served

from ..serve.conftest import TinyRun, instances, tiny_run  # noqa: F401 (a fixture)
from ..serve.test_follow import D1, D2, D3, FULL, NEXT_FULL, land

pytestmark = pytest.mark.ray

TIMEOUT_S = 4.0  # the preparer drops a subscriber silent this long
WAIT_S = 180.0  # a bound for Ray Serve to start or replace a replica on a loaded machine


def wait_for(condition: Callable[[], Any], what: str, wait_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            value = condition()
        except (OSError, KeyError, ValueError):  # not up yet
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {wait_s} s: {what}")
        time.sleep(0.1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _prepare_children(pids: set[int]) -> list[int]:
    """Processes ``python -m estuary.serve.prepare_process`` whose parent is in ``pids``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes()
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"estuary.serve.prepare_process" in cmd and ppid in pids:
            found.append(int(proc.name))
    return found


def _predict(port: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/predict",
        data=json.dumps({"instances": rows}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        body: dict[str, Any] = json.loads(reply.read())
    return body


def test_replicas_of_a_node_share_one_preparer_and_its_two_slot_files(
    ray_instance: Any,
    tiny_run: TinyRun,  # noqa: F811
    tmp_path: Path,
) -> None:
    ray = ray_instance
    from ray import serve

    land(tiny_run, tmp_path, FULL)
    port = _free_port()
    options = ServeOptions(port=port, poll_s=0.05, prepare_timeout_s=TIMEOUT_S)
    # The single-process follower, as the reference: its own child, its own slots.
    reference = open_served(None, tmp_path, ServeOptions(poll_s=0.05))
    assert reference.follower is not None
    reference.follower.start()
    run_on_ray(None, tmp_path, options, 2, blocking=False)
    node = ray.get_runtime_context().get_node_id()
    name = actor_name("estuary", tmp_path, node)
    try:
        actor = wait_for(lambda: ray.get_actor(name, namespace=NAMESPACE), "the preparer")

        def state() -> dict[str, Any]:
            return dict(ray.get(actor.state.remote(), timeout=60))

        def all_serve(checkpoint: str, count: int = 2) -> dict[str, Any] | None:
            s = state()
            current = s["current"]
            if current is None or current["checkpoint"] != checkpoint:
                return None
            slots = [sub["slot"] for sub in s["subscribers"].values()]
            return s if len(slots) == count and set(slots) == {s["current_slot"]} else None

        wait_for(lambda: len(state()["subscribers"]) == 2, "2 replicas subscribed")
        # The version they loaded at start is handed over first: from now on
        # they serve the node's copy, not each its own.
        wait_for(lambda: all_serve(FULL), f"both replicas serving {FULL} from the node's slot")
        land(tiny_run, tmp_path, D1)
        wait_for(lambda: all_serve(D1), f"both replicas serving {D1}")
        land(tiny_run, tmp_path, D2)
        s = wait_for(lambda: all_serve(D2), f"both replicas serving {D2}")

        # One preparer on the node: no replica has a preparing child, and the
        # actor's folder holds the two slot files, nothing more.
        replicas = {int(sub["pid"]) for sub in s["subscribers"].values()}
        assert len(replicas) == 2 and s["pid"] not in replicas
        assert _prepare_children(replicas) == []
        assert len(s["files"]) == 2 and all(f.endswith(".slot") for f in s["files"])
        wait_for(lambda: reference.model.version.endswith(f"@{D2}"), "the reference at D2")
        rows = instances(tiny_run.eval_rows)[:64]
        expected = reference.model.predict(reference.model.pipeline.parse(rows)).probabilities
        for _ in range(6):  # spread over both replicas by Ray Serve
            body = _predict(port, rows)
            assert body["model_version"] == reference.model.version
            np.testing.assert_allclose(body["predictions"], expected, atol=1e-6)

        # A silent subscriber (joins, never calls again; its process, this
        # one, lives) is dropped after its deadline; the replicas get the next
        # version meanwhile.
        assert ray.get(actor.join.remote("silent", os.getpid()))
        land(tiny_run, tmp_path, D3)
        s = wait_for(lambda: all_serve(D3), f"both replicas serving {D3}")
        assert "silent" not in s["subscribers"] and s["drops"].get("timeout", 0) >= 1

        # A killed replica is dropped; the other keeps getting versions, and
        # the replica Ray Serve starts in its place joins and is served too.
        killed = min(replicas)
        os.kill(killed, signal.SIGKILL)
        land(tiny_run, tmp_path, NEXT_FULL)
        s = wait_for(lambda: all_serve(NEXT_FULL), f"both replicas serving {NEXT_FULL}")
        pids = {int(sub["pid"]) for sub in s["subscribers"].values()}
        assert killed not in pids and replicas - {killed} <= pids
        assert s["drops"].get("exited", 0) >= 1  # seen gone, not waited out
        assert len(s["files"]) == 2

        # The preparer killed: the replicas make a new one (new files, the old
        # folder removed) and are served by it.
        old = s
        ray.kill(actor)

        def new_preparer() -> Any:
            try:
                handle = ray.get_actor(name, namespace=NAMESPACE)
                fresh = ray.get(handle.state.remote(), timeout=60)
            except ray.exceptions.RayActorError:
                return None
            return handle if fresh["pid"] != old["pid"] and len(fresh["subscribers"]) == 2 else None

        actor = wait_for(new_preparer, "a new preparer with both replicas")
        pointer = tmp_path / "checkpoints" / "latest.tmp"  # back to the first checkpoint:
        pointer.write_text(FULL + "\n")  # one not served, prepared whole
        os.replace(pointer, tmp_path / "checkpoints" / "latest")
        s = wait_for(lambda: all_serve(FULL), f"both replicas serving {FULL} anew")
        assert s["folder"] != old["folder"] and not Path(old["folder"]).exists()
    finally:
        serve.delete("estuary")
        reference.follower.stop()
    # The preparer ends with its last subscriber, its folder removed.
    folder = Path(s["folder"])
    wait_for(lambda: not folder.exists(), "the preparer's folder removed", 60)

    def gone() -> bool:
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return True
        return False

    wait_for(gone, "the preparer ended", 60)
