"""Failure policies: what a role's failure means for the job."""

from __future__ import annotations

from estuary.runtime.types import FailureAction, FailureDecision, RoleFailure

__all__ = ["FailFast"]


class FailFast:
    """Any failure ends the job with an error naming the role and its rank (the
    other roles are stopped; ``--resume`` continues from the last checkpoint)."""

    def decide(self, failure: RoleFailure) -> FailureDecision:
        return FailureDecision(
            FailureAction.FAIL, f"{failure.role} rank {failure.rank} {failure.reason}"
        )
