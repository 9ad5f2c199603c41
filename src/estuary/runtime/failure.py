"""Failure policies: what a role's failure means for the job."""

from __future__ import annotations

from estuary.config import JobSpec
from estuary.runtime.types import FailureAction, FailureDecision, FailurePolicy, RoleFailure

__all__ = ["FailFast", "RestartPolicy", "policy_for"]


class FailFast:
    """Any failure ends the job with an error naming the role and its rank (the
    other roles are stopped; ``--resume`` continues from the last checkpoint)."""

    def decide(self, failure: RoleFailure) -> FailureDecision:
        return FailureDecision(
            FailureAction.FAIL, f"{failure.role} rank {failure.rank} {failure.reason}"
        )


class RestartPolicy:
    """Restart after a failure, up to ``max_restarts`` times in one run (the run
    continues from its newest checkpoint); the next failure ends the job with an
    error naming the role, its cause and the restarts spent."""

    def __init__(self, max_restarts: int) -> None:
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        self.max_restarts = max_restarts
        self.restarts = 0

    def decide(self, failure: RoleFailure) -> FailureDecision:
        what = f"{failure.role} rank {failure.rank} {failure.reason}"
        if self.restarts < self.max_restarts:
            self.restarts += 1
            return FailureDecision(
                FailureAction.RESTART, f"restart {self.restarts}/{self.max_restarts}: {what}"
            )
        return FailureDecision(
            FailureAction.FAIL,
            f"{what} (after {self.restarts} restart(s); runtime.max_restarts is "
            f"{self.max_restarts})",
        )


def policy_for(job: JobSpec) -> FailurePolicy:
    """The job's policy: ``RestartPolicy(runtime.max_restarts)``, or ``FailFast``
    when it is 0."""
    restarts = job.runtime.max_restarts
    return RestartPolicy(restarts) if restarts > 0 else FailFast()
