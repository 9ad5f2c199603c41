"""Leaving a Ray instance the runtime started undoes what ``ray.init`` set in
this process's environment, so subprocesses started afterwards (a user's own,
or a Ray Client server) do not inherit ``RAY_AUTH_MODE=token`` and the like."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from estuary.runtime.ray.cluster import restore_environ

from .conftest import PRISTINE_ENV

pytestmark = pytest.mark.ray

_CONNECT_AND_LEAVE = """
import json, os
from estuary.config.spec import RaySpec
from estuary.runtime.ray.cluster import connect
before = dict(os.environ)
disconnect = connect(RaySpec(num_cpus=1), [])
during = {k: v for k, v in os.environ.items() if before.get(k) != v}
disconnect()
after = {k: v for k, v in os.environ.items() if before.get(k) != v}
print(json.dumps({"during": during, "after": after, "gone": sorted(set(before) - set(os.environ))}))
"""


def test_leaving_a_ray_instance_restores_the_environment() -> None:
    pytest.importorskip("ray", reason="the ray extra is not installed")
    done = subprocess.run(
        [sys.executable, "-c", _CONNECT_AND_LEAVE],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env={k: v for k, v in PRISTINE_ENV.items() if not k.startswith("RAY_")},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["during"], "ray.init set nothing: this test would show nothing"
    assert seen["after"] == {} and seen["gone"] == []


def test_restore_environ_drops_added_and_puts_back_changed_and_removed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ESTUARY_T_KEEP", "1")
    monkeypatch.setenv("ESTUARY_T_CHANGE", "old")
    monkeypatch.setenv("ESTUARY_T_REMOVE", "here")
    saved = dict(os.environ)
    os.environ["ESTUARY_T_ADD"] = "new"
    os.environ["ESTUARY_T_CHANGE"] = "new"
    del os.environ["ESTUARY_T_REMOVE"]
    restore_environ(saved)
    assert dict(os.environ) == saved
    assert "ESTUARY_T_ADD" not in os.environ and os.environ["ESTUARY_T_REMOVE"] == "here"


@pytest.mark.parametrize("address", ["ray://head:10001", "head:6379"])
def test_a_ray_client_join_the_proxy_aborts_is_tried_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, address: str
) -> None:
    """Ray Client's proxy sometimes fails to start a driver's server on a busy
    head: the join is tried again (3 attempts), each failure logged; a plain
    address, or the last attempt, fails as Ray does."""
    from estuary.config.spec import RaySpec
    from estuary.runtime.ray import cluster

    calls: list[str] = []

    def init(address: str, **_: object) -> None:
        calls.append(address)
        if len(calls) < 3:
            raise ConnectionAbortedError(
                "Initialization failure from server:\nRuntimeError: Starting Ray client "
                "server failed. See ray_client_server_23000.err for detailed logs."
            )

    monkeypatch.setattr(cluster.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(cluster.ray, "init", init)
    monkeypatch.setattr(cluster.ray, "shutdown", lambda: None)
    monkeypatch.setattr(cluster.time, "sleep", lambda s: None)
    if address.startswith("ray://"):
        assert cluster.connect(RaySpec(address=address), []) is not None
        assert calls == [address] * 3
        failures = [r.getMessage() for r in caplog.records if "joining" in r.getMessage()]
        assert len(failures) == 2 and "Starting Ray client server failed" in failures[0]
        calls.clear()
        monkeypatch.setattr(cluster, "CLIENT_ATTEMPTS", 2)
    with pytest.raises(ConnectionAbortedError):
        cluster.connect(RaySpec(address=address), [])
    assert calls == [address] * (2 if address.startswith("ray://") else 1)
