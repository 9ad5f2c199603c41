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
