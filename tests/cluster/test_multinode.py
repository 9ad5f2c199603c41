"""The Ray runtime on a cluster of two nodes (``multinode.py``: two raylets and
two object stores on this machine), joined the way a user joins one: by its
address (``runtime.ray.address: HOST:PORT``) and through Ray Client
(``ray://HOST:PORT``), from an ``estuary train`` process of its own.

Each node has 3 CPUs and the job's roles ask 6 (2 PS shards, 2 trainers, 2 data
executors), so the roles must spread over both nodes: the trainers' process
group spans them and the data executors' blocks travel between object stores
to the trainer they are routed to."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..graph.conftest import assert_every_row_once, write_hours
from ..graph.test_multi_trainer import write_job
from .conftest import PRISTINE_ENV

pytestmark = pytest.mark.ray
HOURS = 3


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[str, int]]:
    """(address, Ray Client port) of a two-node cluster held by a subprocess."""
    pytest.importorskip("ray", reason="the ray extra is not installed")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        client_port = probe.getsockname()[1]
    script = Path(__file__).with_name("multinode.py")
    holder = subprocess.Popen(
        [sys.executable, str(script), "3", str(client_port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=PRISTINE_ENV,
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        address = holder.stdout.readline().strip()  # Blocking wait: both nodes are up
        assert address, "the two-node cluster did not start"
        yield address, client_port
    finally:
        holder.stdin.close()
        holder.wait(timeout=120)  # Blocking wait: the cluster shuts down


@pytest.mark.parametrize("join", ["address", "client"])
def test_a_dataset_job_spreads_over_two_nodes_and_trains_every_row_once(
    cluster: tuple[str, int], tmp_path: Path, join: str
) -> None:
    address, client_port = cluster
    if join == "client":
        address = f"ray://127.0.0.1:{client_port}"
    written = write_hours(tmp_path, HOURS, 200)
    job = write_job(tmp_path, HOURS, mode="sync")
    runtime = {
        "backend": "ray",
        "ray.address": address,
        "trainers": 2,
        "ps_shards": 2,
        "data_executors": 2,
    }
    sets = [arg for k, v in runtime.items() for arg in ("--set", f"runtime.{k}={v}")]
    cmd = [sys.executable, "-m", "estuary.cli", "train", str(job), "--no-progress", *sets]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, check=False, env=PRISTINE_ENV
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["runtime"] == "ray" and summary["ray_nodes"] == 2
    assert summary["data_delivery"] == "direct"
    assert summary["rows_committed"] == written.rows
    assert_every_row_once(job, written, HOURS)
