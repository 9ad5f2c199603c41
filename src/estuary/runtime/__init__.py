"""Where a job's roles run: the ``Runtime`` interface and its backends.

A backend is found by the job's ``runtime.backend`` in ``BACKENDS`` (a lazy
``"module:attr"`` entry, imported on first use), and ``run(job)`` is the whole
entry point the CLI uses::

    runtime = get_runtime(job.runtime.backend)
    result = runtime.run(job, resume=..., stop=..., progress=...)

Adding a backend is one module with a class that has ``run`` (``Runtime``) and
one entry here (or ``register_runtime`` from a plugin).
"""

from __future__ import annotations

import importlib
from typing import Any

from estuary.config import JobSpec
from estuary.config.errors import ConfigError
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

BACKENDS: dict[str, str] = {"local": "estuary.runtime.local:LocalRuntime"}
"""``runtime.backend`` name -> ``"module:attr"`` of a ``Runtime`` class."""


def register_runtime(name: str, target: str) -> None:
    """Make ``runtime.backend: name`` run ``target`` (``"module:attr"``, a class
    whose instances are ``Runtime``s, built without arguments)."""
    BACKENDS[name] = target


def get_runtime(name: str) -> Runtime:
    """A new runtime of backend ``name``.

    Raises:
        ConfigError: no backend of that name (the message lists the known ones).
    """
    if name not in BACKENDS:
        known = ", ".join(sorted(BACKENDS))
        raise ConfigError("runtime.backend", f"unknown backend {name!r} (known: {known})")
    module, _, attr = BACKENDS[name].partition(":")
    factory: Any = getattr(importlib.import_module(module), attr)
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
