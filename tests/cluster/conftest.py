"""One local Ray instance on loopback for every test that needs it (its ~3 s
start is paid once per session); the tests skip where Ray is not installed."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

# The environment before any test's ray.init: ray.init sets variables in its own
# process (RAY_AUTH_MODE=token, RAY_CLIENT_MODE, PYTHONBREAKPOINT) that a
# subprocess holding another cluster must not inherit (its Ray Client server
# then fails to start).
PRISTINE_ENV = dict(os.environ)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "ray: runs on a local Ray instance")


@pytest.fixture(scope="session")
def ray_instance() -> Iterator[Any]:
    ray = pytest.importorskip("ray", reason="the ray extra is not installed")
    if not ray.is_initialized():
        # 8 logical CPUs: room for 2 PS shards and 2 trainers (and a spare) on 2 cores.
        ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()
