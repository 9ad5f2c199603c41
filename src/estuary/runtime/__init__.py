"""Where a job's roles run: the ``Runtime`` interface and its backends.

A backend is found by the job's ``runtime.backend`` in ``BACKENDS``
(``estuary.plugins.RUNTIMES``: lazy ``"module:attr"`` entries imported on first
use, plus ``estuary.runtimes`` entry points), and ``run(job)`` is the whole entry
point the CLI uses::

    runtime = get_runtime(job.runtime.backend)
    result = runtime.run(job, resume=..., stop=..., progress=...)

Adding a backend is one module with a class that has ``run`` (``Runtime``) and
one registry entry (a line in ``estuary/plugins.py``, ``register_runtime``, or an
entry point of another package).
"""

from __future__ import annotations

from typing import Any

from estuary.config import JobSpec
from estuary.plugins import RUNTIMES
from estuary.registry import Registry
from estuary.runtime.types import (
    FailureAction,
    FailureDecision,
    FailurePolicy,
    JobState,
    RoleFailure,
    RoleState,
    Runtime,
    StopRequest,
)
from estuary.train import FitResult

__all__ = [
    "BACKENDS",
    "FailureAction",
    "FailureDecision",
    "FailurePolicy",
    "JobState",
    "RoleFailure",
    "RoleState",
    "Runtime",
    "StopRequest",
    "get_runtime",
    "register_runtime",
    "run",
]

BACKENDS: Registry[Any] = RUNTIMES
"""``runtime.backend`` name -> a ``Runtime`` class (``estuary.plugins.RUNTIMES``)."""


def register_runtime(name: str, target: Any) -> None:
    """Make ``runtime.backend: name`` run ``target``: a class whose instances are
    ``Runtime``s, built without arguments, or its ``"module:attr"``."""
    BACKENDS.register(name, target)


def get_runtime(name: str) -> Runtime:
    """A new runtime of backend ``name``.

    Raises:
        ConfigError: no backend of that name (the message lists the known ones).
    """
    factory = BACKENDS.get(name, "runtime.backend")
    runtime: Runtime = factory()
    return runtime


def run(
    job: JobSpec,
    *,
    resume: bool = False,
    stop: StopRequest | None = None,
    progress: bool | None = None,
) -> FitResult:
    """Train ``job`` on its ``runtime.backend``; see ``Runtime.run``."""
    return get_runtime(job.runtime.backend).run(job, resume=resume, stop=stop, progress=progress)
