"""``runtime.backend: local``: the job runs on this machine.

One trainer (``runtime.trainers: 1``, ``runtime.ps_shards: 1``) trains in this
process, tables in memory; otherwise W trainer processes share N parameter-server
processes (``estuary.runtime.launcher``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from estuary.config import JobSpec
from estuary.runtime.failure import FailFast, policy_for
from estuary.runtime.launcher import run_distributed, stop_value
from estuary.runtime.recovery import supervise
from estuary.runtime.types import FailurePolicy, JobState, RoleState, StopRequest, tracking
from estuary.runtime.worker import resume_if_asked
from estuary.train import FitResult, Trainer

__all__ = ["LocalRuntime"]


class LocalRuntime:
    """Runs a job on this machine (see module docstring).

    Args:
        policy: what a trainer's failure means (default: the job's
            ``runtime.max_restarts``, ``policy_for``). With restarts a failed
            multi-process run starts its processes again from the newest
            checkpoint (``estuary.runtime.recovery``).

    ``state`` is the job's ``JobState``; ``roles`` each trainer rank's
    ``RoleState`` (rank 0 only, in-process, with one trainer).
    """

    def __init__(self, policy: FailurePolicy | None = None) -> None:
        self._policy = policy
        self.policy: FailurePolicy = FailFast() if policy is None else policy
        self.state = JobState.PENDING
        self.roles: dict[int, RoleState] = {}

    def run(
        self,
        job: JobSpec,
        *,
        resume: bool = False,
        stop: StopRequest | None = None,
        progress: bool | None = None,
    ) -> FitResult:
        stop = StopRequest() if stop is None else stop
        self.policy = policy_for(job) if self._policy is None else self._policy
        with tracking(self):
            if job.runtime.uses_servers:
                return self._run_processes(job, resume, stop, progress)
            return self._run_here(job, resume, stop, progress)

    def _run_here(
        self, job: JobSpec, resume: bool, stop: StopRequest, progress: bool | None
    ) -> FitResult:
        self.roles[0] = RoleState.STARTING
        trainer = Trainer(job)
        out = job.resolve(job.output.dir)
        if resume_if_asked(trainer, job, resume):
            print(f"resumed from {out / 'checkpoints'} at step {trainer.step}", file=sys.stderr)
        elif resume:
            print(f"--resume: no checkpoint in {out}; starting fresh", file=sys.stderr)
        stop.on_request(trainer.request_stop)
        self.roles[0] = RoleState.RUNNING
        try:
            result = trainer.fit(progress=progress)
        except BaseException:
            self.roles[0] = RoleState.FAILED
            raise
        self.roles[0] = RoleState.FINISHED
        return result

    def _run_processes(
        self, job: JobSpec, resume: bool, stop: StopRequest, progress: bool | None
    ) -> FitResult:
        shared = stop_value()  # the trainers poll it and agree on the step to stop after

        def forward(reason: str) -> None:
            shared.value = StopRequest.signal_number(reason)

        stop.on_request(forward)

        def attempt(resume: bool, running: Callable[[], None]) -> FitResult:
            return run_distributed(
                job,
                progress=progress,
                resume=resume,
                stop_signal=shared,
                policy=self.policy,
                roles=self.roles,
                on_running=running,
            )

        return supervise(attempt, job, resume=resume)
