"""The local multi-process launcher: N parameter servers and W trainer
processes on this machine.

::

    run_distributed(job, trainers=W)       N = runtime.ps_shards
      N x ServerProcess - each hosts its share of every table (ids routed by a
      |                  stable hash); step t is applied once per server, when all
      |                  W ranks have pushed it (sum of their gradients per id)
      W trainers (estuary.runtime.worker.trainer_main) from a fork server, rank r:
        init_process_group(gloo | nccl)   dense grads averaged by DDP (nccl: CUDA models)
        rows of an epoch: perm[r::W]      same permutation on every rank
          (data.dataset: rank 0 reads, sends rank r its part of each step)
        lookup(step t) -> forward/backward -> dense step -> push(t, r, grads / W)
      rank 0: eval + checkpoint (tables pulled from the server) -> FitResult

A trainer's failure goes to the ``FailurePolicy``; the launcher acts on its
``FailureDecision``: ``FAIL`` raises an error naming the rank, ``RESTART`` raises
``RoleFailed`` for the runtime's ``supervise`` loop (``estuary.runtime.recovery``).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any, NoReturn, assert_never

import torch.multiprocessing as torch_mp
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

from estuary.config import JobSpec
from estuary.ps import ServerConfig, ServerProcess, server_share
from estuary.runtime.failure import FailFast
from estuary.runtime.recovery import DistributedError, RoleFailed
from estuary.runtime.types import (
    FailureAction,
    FailureDecision,
    FailurePolicy,
    RoleFailure,
    RoleState,
)
from estuary.runtime.worker import WorkerLaunch, trainer_main
from estuary.train import FitResult, TrainingStopped
from estuary.train.engine import resolve_device
from estuary.train.plan import TrainPlan

__all__ = [
    "BACKENDS",
    "DistributedError",
    "act",
    "default_backend",
    "run_distributed",
    "stop_value",
]

BACKENDS = ("gloo", "nccl")  # nccl: dense models on CUDA (``train.device``)

# Trainers start from a fork server that imported the trainer's modules once
# (torch, estuary: ~3 s of CPU a process): each trainer is a fork of it, ready
# in a fraction of a second, instead of a fresh interpreter importing them again
# (spawn). The fork server is a clean process (started by exec, it runs no
# threads and no torch op before forking) and lives as long as this process, so
# a second run, or a restart after a failure, forks from the same one. Each
# trainer takes the launcher's environment and working directory as they are
# at its launch, and its standard output and error (``LauncherStdio``): the fork
# server's are from when it started.
START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
PRELOAD = ["estuary.runtime.worker"]


class LauncherStdio:
    """The launcher's standard output and error as they are now, for a trainer
    process: pickled as it starts (the file descriptors go with it), and made
    the trainer's own as it is unpickled there, before the trainer runs."""

    def __reduce__(self) -> tuple[Any, ...]:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a replaced stream may not flush
                stream.flush()
        return (_adopt_stdio, (reduction.DupFd(1), reduction.DupFd(2)))


def _adopt_stdio(out: Any, err: Any) -> None:
    """In the trainer: the launcher's descriptors (``LauncherStdio``) become 1 and 2."""
    for fd, dup in ((1, out), (2, err)):
        received = dup.detach()
        os.dup2(received, fd)
        os.close(received)


def start_context() -> Any:
    """The multiprocessing context trainers start in (``START_METHOD``)."""
    context = torch_mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        context.set_forkserver_preload(PRELOAD)  # read when the fork server starts
    return context


def ps_server_config(
    job: JobSpec, plan: TrainPlan, world_size: int, shards: int, wait_timeout_s: float
) -> ServerConfig:
    """The configuration every one of ``shards`` PS servers of ``job`` starts with
    (each its ``1 / shards`` share of every table), on either runtime."""
    return ServerConfig(
        {name: server_share(t, shards) for name, t in plan.hosted_tables().items()},
        world_size=world_size,
        staleness=plan.staleness,
        compact_below=job.runtime.scaling.compact_below,
        wait_timeout_s=wait_timeout_s,
    )


def default_backend(job: JobSpec) -> str:
    """``nccl`` when the job's dense model runs on CUDA, else ``gloo``."""
    return "nccl" if resolve_device(job.train.device).type == "cuda" else "gloo"


def act(
    decision: FailureDecision,
    failure: RoleFailure,
    cause: BaseException,
    noticed: float,
) -> NoReturn:
    """The controller: carry out the policy's decision about a failed role
    (``RESTART``: ``RoleFailed``, which the runtime's ``supervise`` loop acts on)."""
    if decision.action is FailureAction.FAIL:
        raise DistributedError(decision.message) from cause
    if decision.action is FailureAction.RESTART:
        raise RoleFailed(failure, decision.message, noticed) from cause
    assert_never(decision.action)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else text


def run_distributed(
    job: JobSpec,
    *,
    trainers: int | None = None,
    progress: bool | None = None,
    backend: str | None = None,
    ps_wait_timeout_s: float = 300.0,
    pg_timeout_s: float = 600.0,
    startup_timeout_s: float = 120.0,
    resume: bool = False,
    stop_signal: Any = None,
    policy: FailurePolicy | None = None,
    roles: dict[int, RoleState] | None = None,
    on_running: Callable[[], None] | None = None,
) -> FitResult:
    """Train ``job`` with W trainer processes and ``runtime.ps_shards`` parameter
    servers on this machine; returns rank 0's ``FitResult`` (rank 0 also writes the
    checkpoint).

    Args:
        job: the job; ``train.batch_size`` is per trainer.
        trainers: W (default ``runtime.trainers``).
        progress: show the progress bar (rank 0's, counting every rank's rows).
        backend: torch.distributed backend for the dense all-reduce; default
            ``default_backend(job)``: ``nccl`` for CUDA dense models, else ``gloo``.
        ps_wait_timeout_s: longest a request waits at the server for a step (a
            stuck or dead rank fails the run after this, not never).
        pg_timeout_s: timeout of the process group's collectives.
        startup_timeout_s: longest wait for the server to start.
        resume: continue from the newest checkpoint in ``output.dir`` (if any):
            every rank restores the dense model and optimizer, rank 0 the tables
            (into the server) and the data progress (``estuary train --resume``).
        stop_signal: a shared int from ``stop_value()``; set it to a signal number
            (the CLI does on SIGTERM / SIGINT) and the trainers stop after a step
            they agree on (within ``STOP_POLL_STEPS``), rank 0 checkpoints it, and
            this raises ``TrainingStopped``.
        policy: decides what a trainer's failure means (default ``FailFast``: the
            run fails with an error naming the rank).
        roles: filled with each trainer rank's ``RoleState`` as the run goes.
        on_running: called once every process has started and the servers listen.

    Raises:
        DistributedError: a trainer failed (its rank and error in the message);
            ``RoleFailed`` when the policy decided to restart.
        PSError: the parameter server failed to start.
        TrainingStopped: ``stop_signal`` was set; the run stopped with a checkpoint.
    """
    policy = FailFast() if policy is None else policy
    roles = {} if roles is None else roles
    world_size = job.runtime.trainers if trainers is None else trainers
    if world_size < 1:
        raise ValueError(f"trainers must be >= 1, got {world_size}")
    backend = default_backend(job) if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "nccl" and resolve_device(job.train.device).type != "cuda":
        raise ValueError("backend 'nccl' needs train.device 'cuda' (or 'auto' with CUDA present)")
    plan = TrainPlan.from_job(job)
    shards = job.runtime.ps_shards
    config = ps_server_config(job, plan, world_size, shards, ps_wait_timeout_s)
    # The servers start while the trainers import torch; they retry their connect.
    servers: list[ServerProcess] = []
    context = None
    try:
        for _ in range(shards):
            servers.append(ServerProcess(config, startup_timeout_s=startup_timeout_s, wait=False))
        with tempfile.TemporaryDirectory(prefix="estuary-pg-") as folder:
            launch = WorkerLaunch(
                job=job,
                world_size=world_size,
                addresses=tuple(server.address for server in servers),
                authkeys=tuple(server.authkey for server in servers),
                init_method=f"file://{os.path.join(folder, 'rendezvous')}",
                backend=backend,
                pg_timeout_s=pg_timeout_s,
                ps_timeout_s=ps_wait_timeout_s + 60.0,
                startup_timeout_s=startup_timeout_s,
                threads=max(1, (os.cpu_count() or 1) // world_size),
                progress=bool(job.output.progress if progress is None else progress),
                resume=resume,
            )
            results = start_context().SimpleQueue()
            if stop_signal is None:
                stop_signal = stop_value()
            context = torch_mp.start_processes(
                trainer_main,
                args=(
                    launch,
                    results,
                    stop_signal,
                    dict(os.environ),
                    os.getcwd(),
                    LauncherStdio(),
                ),
                nprocs=world_size,
                join=False,
                start_method=START_METHOD,
            )
            roles.update((rank, RoleState.STARTING) for rank in range(world_size))
            for server in servers:
                server.wait_ready()
            roles.update((rank, RoleState.RUNNING) for rank in range(world_size))
            if on_running is not None:
                on_running()
            out: list[FitResult | TrainingStopped] = []
            try:
                # Blocking wait: trainers run; the first failure stops the others.
                while not context.join(timeout=0.5):
                    while not results.empty():
                        out.append(results.get())
                    lost = _lost_server(servers)
                    if lost is not None:
                        act(
                            policy.decide(lost),
                            lost,
                            DistributedError(lost.reason),
                            time.monotonic(),
                        )
            except ProcessRaisedException as exc:
                # A server's death fails the trainers too: name the cause, not the symptom.
                failure = _lost_server(servers, grace_s=1.0) or RoleFailure(
                    "trainer", exc.error_index, f"failed: {_last_line(exc.msg)}"
                )
                if failure.role == "trainer":
                    roles[failure.rank] = RoleState.FAILED
                act(policy.decide(failure), failure, exc, time.monotonic())
            except ProcessExitedException as exc:
                how = f"signal {exc.signal_name}" if exc.signal_name else f"code {exc.exit_code}"
                failure = RoleFailure("trainer", exc.error_index, f"exited with {how}")
                roles[failure.rank] = RoleState.FAILED
                act(policy.decide(failure), failure, exc, time.monotonic())
            while not results.empty():
                out.append(results.get())
            roles.update((rank, RoleState.FINISHED) for rank in range(world_size))
    finally:
        if context is not None:
            _stop(context.processes)
        for server in servers:
            server.stop()
    if not out:
        raise DistributedError("rank 0 finished without a result")
    if isinstance(out[0], TrainingStopped):
        raise out[0]
    return out[0]


def _lost_server(servers: list[ServerProcess], grace_s: float = 0.0) -> RoleFailure | None:
    """A parameter server that died, as a ``RoleFailure`` (``ps`` rank p), else ``None``;
    ``grace_s``: how long a dying server may take to be seen dead."""
    deadline = time.monotonic() + grace_s
    while True:
        for rank, server in enumerate(servers):
            code = server.exitcode
            if code is not None:
                how = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
                return RoleFailure("ps", rank, f"exited with {how}")
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def stop_value() -> Any:
    """A shared int for ``run_distributed(stop_signal=...)`` (0 = keep training)."""
    return start_context().Value("i", 0)


def _stop(processes: list[Any], grace_s: float = 5.0) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
