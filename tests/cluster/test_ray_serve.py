"""``estuary serve --ray``: the application as a Ray Serve deployment of 2
replicas on the shared local Ray instance, started from the command line and
answering over HTTP on loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("ray.serve", reason="the ray-serve extra is not installed")

from estuary.cli import main
from estuary.serve.export import export_checkpoint, load_export

pytestmark = pytest.mark.ray

SRC = Path(__file__).resolve().parents[2] / "src"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _replica_states(serve: Any) -> dict[str, int]:
    states = serve.status().applications["estuary"].deployments["estuary"].replica_states
    return dict(states)


def _tiny_export(folder: Path) -> Path:
    import yaml

    rng = np.random.default_rng(0)
    lines = ["label\tI1\tC1"] + [
        f"{int(rng.random() < 0.3)}\t{rng.integers(0, 9)}\t{rng.integers(0, 50):x}"
        for _ in range(400)
    ]
    (folder / "train.tsv").write_text("\n".join(lines) + "\n")
    job = {
        "name": "ray-serve",
        "data": {
            "sources": [{"path": "train.tsv", "format": "tsv"}],
            "schema": {"dense": ["I1"], "sparse": ["C1"]},
        },
        "model": {"type": "deepfm", "params": {"mlp": [4]}, "embedding": {"default": {"dim": 4}}},
        "train": {"batch_size": 64, "epochs": 1, "threads": 1},
        "output": {"dir": "out", "progress": False},
    }
    (folder / "job.yaml").write_text(yaml.safe_dump(job))
    assert main(["train", str(folder / "job.yaml"), "-q"]) == 0
    return export_checkpoint(folder / "out", folder / "export").path


def test_estuary_serve_ray_runs_two_replicas_that_answer_as_the_in_process_model_does(
    ray_instance: Any, tmp_path: Path
) -> None:
    """``estuary serve DIR --ray --replicas 2`` from the command line, on the shared
    Ray instance (``RAY_ADDRESS``): both replicas run and answer over HTTP."""
    from ray import serve

    export_dir = _tiny_export(tmp_path)
    port = _free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(SRC),
        "RAY_ADDRESS": ray_instance.get_runtime_context().gcs_address,
    }
    argv = ["serve", str(export_dir), "--ray", "--replicas", "2"]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    cli = subprocess.Popen([sys.executable, "-m", "estuary.cli", *argv], env=env)
    rows = [{"I1": i, "C1": f"{i:x}"} for i in range(8)]
    try:
        deadline = time.monotonic() + 180
        while True:  # until both replicas run and the proxy routes to them
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5):
                    pass
                if _replica_states(serve) == {"RUNNING": 2}:
                    break
            except (OSError, KeyError):  # no proxy yet, or no application yet
                pass
            assert cli.poll() is None, "estuary serve --ray exited"
            assert time.monotonic() < deadline, "2 Ray Serve replicas did not run in 180 s"
            time.sleep(0.5)
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/predict",
            data=json.dumps({"instances": rows}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as reply:
            body = json.loads(reply.read())
        assert _replica_states(serve) == {"RUNNING": 2}
    finally:
        cli.terminate()
        cli.wait(timeout=60)
        serve.shutdown()
    model = load_export(export_dir)
    expected = model.predict(model.pipeline.parse(rows)).probabilities
    assert body["model_version"] == model.version
    np.testing.assert_allclose(body["predictions"], expected, atol=1e-6)
