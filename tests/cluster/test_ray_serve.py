"""``estuary serve --ray``: the application as a Ray Serve deployment of 2
replicas on the shared local Ray instance, answering over HTTP on loopback."""

from __future__ import annotations

import json
import socket
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("ray.serve", reason="the ray-serve extra is not installed")

from estuary.cli import main
from estuary.serve.export import export_checkpoint, load_export
from estuary.serve.ray_serve import run_on_ray
from estuary.serve.server import ServeOptions

pytestmark = pytest.mark.ray


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def test_two_replicas_answer_as_the_in_process_model_does(
    ray_instance: Any, tmp_path: Path
) -> None:
    from ray import serve

    export_dir = _tiny_export(tmp_path)
    port = _free_port()
    options = ServeOptions(host="127.0.0.1", port=port)
    run_on_ray(export_dir, None, options, replicas=2, blocking=False)
    try:
        rows = [{"I1": i, "C1": f"{i:x}"} for i in range(8)]
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/predict",
            data=json.dumps({"instances": rows}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as reply:
            body = json.loads(reply.read())
        assert serve.status().applications["estuary"].deployments["estuary"].replica_states == {
            "RUNNING": 2
        }
    finally:
        serve.shutdown()
    model = load_export(export_dir)
    expected = model.predict(model.pipeline.parse(rows)).probabilities
    assert body["model_version"] == model.version
    np.testing.assert_allclose(body["predictions"], expected, atol=1e-6)
