"""The runtime's interfaces: a ``Runtime`` runs a job somewhere; job and role
lifecycles are enums; a ``FailurePolicy`` turns a role's failure into a
``FailureDecision`` that the runtime's controller acts on."""

from __future__ import annotations

import contextlib
import enum
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from estuary.config import JobSpec
from estuary.train.result import FitResult, TrainingStopped

__all__ = [
    "FailureAction",
    "FailureDecision",
    "FailurePolicy",
    "JobState",
    "RoleFailure",
    "RoleState",
    "Runtime",
    "StopRequest",
    "tracking",
]


class JobState(enum.Enum):
    """A job's lifecycle in a runtime."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    STOPPED = "stopped"  # a stop was asked; the run checkpointed and ended
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.STOPPED, JobState.FAILED)


class _Tracked(Protocol):
    state: JobState


@contextlib.contextmanager
def tracking(runtime: _Tracked) -> Iterator[None]:
    """A runtime's ``state`` through one run: ``RUNNING`` in the block, then
    ``SUCCEEDED``, ``STOPPED`` (``TrainingStopped``) or ``FAILED`` (any other error)."""
    runtime.state = JobState.RUNNING
    try:
        yield
    except TrainingStopped:
        runtime.state = JobState.STOPPED
        raise
    except BaseException:
        runtime.state = JobState.FAILED
        raise
    runtime.state = JobState.SUCCEEDED


class RoleState(enum.Enum):
    """One role's lifecycle (a trainer rank, the parameter server)."""

    STARTING = "starting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in (RoleState.FINISHED, RoleState.FAILED)


@dataclass(frozen=True)
class RoleFailure:
    """A role that failed.

    Args:
        role: the role's name, e.g. ``trainer``.
        rank: its rank among the roles of its kind.
        reason: one line: the error's last line, or how the process exited.
    """

    role: str
    rank: int
    reason: str


class FailureAction(enum.Enum):
    FAIL = "fail"  # end the job with an error naming the role
    RESTART = "restart"  # restart the roles; the run continues from the newest checkpoint


@dataclass(frozen=True)
class FailureDecision:
    """What to do about a ``RoleFailure``.

    Args:
        action: what the controller does.
        message: the error the job fails with (``FAIL``), or the line logged
            about the restart (``RESTART``).
    """

    action: FailureAction
    message: str


class FailurePolicy(Protocol):
    """Decides what a role's failure means for the job."""

    def decide(self, failure: RoleFailure) -> FailureDecision: ...


class StopRequest:
    """A stop asked of a running job (the CLI asks on SIGTERM / SIGINT). A runtime
    subscribes to it with ``on_request`` and passes the request to its roles; the
    run then stops after a step, with a checkpoint of it (``TrainingStopped``)."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self._listeners: list[Callable[[str], None]] = []

    def request(self, reason: str) -> None:
        """Ask for the stop (safe from a signal handler)."""
        self.reason = reason
        for listener in list(self._listeners):
            listener(reason)

    def on_request(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(reason)`` on a request (at once if one came already)."""
        self._listeners.append(listener)
        if self.reason is not None:
            listener(self.reason)

    @staticmethod
    def signal_number(reason: str) -> int:
        """The reason as a signal number (a signal name, else SIGTERM)."""
        known = reason in signal.Signals.__members__
        return int(signal.Signals[reason] if known else signal.SIGTERM)


class Runtime(Protocol):
    """Runs a job's roles somewhere and returns rank 0's result."""

    def run(
        self,
        job: JobSpec,
        *,
        resume: bool = False,
        stop: StopRequest | None = None,
        progress: bool | None = None,
    ) -> FitResult:
        """Train ``job`` (continuing from ``output.dir``'s newest checkpoint with
        ``resume``) and return the result.

        Raises:
            TrainingStopped: ``stop`` was requested; the run checkpointed its step.
        """
        ...
