"""Automatic recovery: run a job's attempts until one finishes or the failure
policy gives up.

::

    supervise(attempt, job)
      attempt(resume)  -> FitResult          the runtime starts every role; when one
                                             dies or raises it asks its FailurePolicy:
        FAIL    -> DistributedError          naming the role and its cause
        RESTART -> RoleFailed                -> attempt(resume=True): every role again,
                                             from the newest checkpoint (tables,
                                             dense state, data progress)

The result's ``extra`` (summary.json) gets ``restarts`` and ``restart_log``: per
restart the role, its cause, when it failed, the work lost (time since the
newest checkpoint, or since the attempt began) and how long the roles took to
come back (``recovery_s``: failure noticed -> next attempt launched), and
``lost_s``, the sum of both over the restarts.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from estuary.config import JobSpec
from estuary.runtime.types import RoleFailure
from estuary.train import FitResult
from estuary.train.checkpoint_chain import LATEST

__all__ = ["DistributedError", "RestartRecord", "RoleFailed", "supervise"]

logger = logging.getLogger(__name__)


class DistributedError(RuntimeError):
    """A role of a multi-process run failed; the message names it (a trainer's
    or server's rank) and the error's last line (the full traceback is the
    ``__cause__``)."""


class RoleFailed(DistributedError):
    """A role failed and the policy decided to restart (``failure`` says which;
    ``noticed`` is the ``time.monotonic()`` when the runtime saw it)."""

    def __init__(self, failure: RoleFailure, message: str, noticed: float) -> None:
        super().__init__(message)
        self.failure = failure
        self.noticed = noticed


@dataclass
class RestartRecord:
    """One restart, for summary.json's ``restart_log``."""

    role: str
    rank: int
    reason: str
    at_s: float  # since the run began
    lost_work_s: float  # training since the newest checkpoint (done again)
    recovery_s: float = 0.0  # failure noticed -> every role running again


def _newest_checkpoint_time(job: JobSpec) -> float | None:
    pointer = Path(job.resolve(job.output.dir)) / "checkpoints" / LATEST
    try:
        return pointer.stat().st_mtime
    except OSError:
        return None


def supervise(
    attempt: Callable[[bool, Callable[[], None]], FitResult],
    job: JobSpec,
    *,
    resume: bool,
) -> FitResult:
    """Run ``attempt(resume, running)`` until it returns, again from the newest
    checkpoint after each ``RoleFailed`` (the runtime's policy decided to
    restart; a decision to fail is a ``DistributedError`` that passes through).
    An attempt calls ``running()`` once all its roles run (the end of a recovery).
    """
    started = time.monotonic()
    records: list[RestartRecord] = []

    def running() -> None:
        if records and not records[-1].recovery_s:
            records[-1].recovery_s = round(time.monotonic() - noticed, 3)

    noticed = started
    while True:
        attempt_wall = time.time()
        try:
            result = attempt(resume, running)
            break
        except RoleFailed as failed:
            noticed = failed.noticed
            checkpointed = _newest_checkpoint_time(job)
            since = attempt_wall if checkpointed is None else max(checkpointed, attempt_wall)
            logger.warning("%s; continuing from the newest checkpoint", failed)
            print(f"{failed}; continuing from the newest checkpoint", file=sys.stderr)
            records.append(
                RestartRecord(
                    failed.failure.role,
                    failed.failure.rank,
                    failed.failure.reason,
                    at_s=round(noticed - started, 3),
                    lost_work_s=round(max(0.0, time.time() - since), 3),
                )
            )
            resume = True
    result.extra["restarts"] = len(records)
    result.extra["restart_log"] = [asdict(r) for r in records]
    result.extra["lost_s"] = round(sum(r.lost_work_s + r.recovery_s for r in records), 3)
    return result
