"""One local Ray instance on loopback for every test that needs it (its ~3 s
start is paid once per session), shut down after the last of them (idle, with
its workers, it keeps ~11% of a core busy: the rest of the suite runs without
it); the tests skip where Ray is not installed."""

from __future__ import annotations

import os
import sys
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


def _uses_shared_instance(item: pytest.Item) -> bool:
    return "ray_instance" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Ray tests that start a cluster of their own (``test_multinode.py``, a Ray
    instance in a subprocess) run right after the last test of the shared
    instance, which is gone by then, so it does not compete with them for the
    cores (the Ray Client case took 65 s in one run of the whole suite with the
    instance still up, 34 s run alone, 28 s in this order)."""
    users = [i for i, item in enumerate(items) if _uses_shared_instance(item)]
    if not users:
        return
    last = users[-1]
    own = [
        item
        for item in items[:last]
        if item.get_closest_marker("ray") is not None and not _uses_shared_instance(item)
    ]
    if own:
        moved = set(map(id, own))
        head = [item for item in items[: last + 1] if id(item) not in moved]
        items[:] = [*head, *own, *items[last + 1 :]]


def _last_ray_test(session: pytest.Session) -> pytest.Item | None:
    """The last test of the session's run order that asks for ``ray_instance``."""
    cached: list[pytest.Item | None] | None = getattr(session, "_estuary_last_ray", None)
    if cached is None:
        users = [i for i in session.items if _uses_shared_instance(i)]
        cached = [users[-1] if users else None]
        session._estuary_last_ray = cached  # type: ignore[attr-defined]
    return cached[0]


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the last test that asks for it, the instance goes (no later test
    needs it; the session fixture's own shutdown is then a no-op)."""
    if item is not _last_ray_test(item.session):
        return
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
