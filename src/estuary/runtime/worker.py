"""The bootstrap of one trainer process of a multi-trainer run.

::

    trainer_main(rank)                     started by the launcher, one per rank
      worker_session: gloo/nccl process group + parameter-server client
        DistributedTrainer(job, client)    (DDP, data and stop groups: collectives)
        resume_if_asked                    every rank its dense state, rank 0 the tables
        barrier                            nobody trains before the tables are loaded
        fit -> result (rank 0 sends it)    or TrainingStopped, after the same step
        barrier                            ranks leave together
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from estuary.config import JobSpec
from estuary.metrics.logs import LogSettings
from estuary.ps import PSClient, ShardedPSClient, connect_servers
from estuary.ps.types import Address
from estuary.train import FitResult, Trainer, TrainingStopped
from estuary.train.checkpoint_chain import LATEST
from estuary.train.distributed import DistributedTrainer

__all__ = ["WorkerLaunch", "resume_if_asked", "run_trainer", "trainer_main", "worker_session"]


@dataclass(frozen=True)
class WorkerLaunch:
    """What every trainer process gets (pickled once per process by spawn).

    Args:
        job: the job.
        world_size: W.
        addresses: the parameter servers' addresses, in server order (one
            server: every table; N: each table split by id, ``runtime.ps_shards``).
        authkeys: their keys.
        init_method: the process group's rendezvous (``file://...``).
        backend: ``gloo`` or ``nccl``.
        pg_timeout_s: timeout of the process group's collectives.
        ps_timeout_s: longest a parameter-server request may take.
        startup_timeout_s: longest wait to connect to the server.
        threads: torch threads per process (unless ``train.threads``).
        progress: rank 0 shows its progress bar.
        resume: continue from ``output.dir``'s newest checkpoint, if any.
        one_machine: every rank runs on this machine (gloo then uses loopback).
        server_actors: the servers' Ray actors, when trainers reach them through
            actor calls (``runtime.ray.data_plane: actor``) instead of sockets.
        split_pool: rank 0, ``data.dataset``: makes the pool its driver reads whole
            splits with (the Ray runtime's data executors); ``None``: its threads.
        part_routes: with ``split_pool``, direct delivery: how rank 0's parts
            reach the ranks and every rank fetches its rows (``PartRoutes``).
        embedding_workers: per rank, its embedding worker's Ray actor
            (``runtime.embedding_workers``); empty: the trainer looks up itself.
        sharded_ps: a sharded client even of one server: the scaling manager may
            add servers (``estuary.runtime.ray.scaling``), the client follows.
    """

    job: JobSpec
    world_size: int
    addresses: tuple[Address, ...]
    authkeys: tuple[bytes, ...]
    init_method: str
    backend: str
    pg_timeout_s: float
    ps_timeout_s: float
    startup_timeout_s: float
    threads: int
    progress: bool
    resume: bool
    one_machine: bool = True
    server_actors: tuple[Any, ...] = ()
    split_pool: Any = None
    part_routes: Any = None
    embedding_workers: tuple[Any, ...] = ()
    sharded_ps: bool = False


def _loopback_interface() -> str | None:
    names = {name for _, name in socket.if_nameindex()}
    return next((name for name in ("lo", "lo0") if name in names), None)


@contextlib.contextmanager
def worker_session(rank: int, launch: WorkerLaunch) -> Iterator[PSClient | ShardedPSClient]:
    """The process group and a parameter-server client for rank ``rank``; both
    are closed on exit."""
    loopback = _loopback_interface() if launch.one_machine else None
    if loopback is not None:
        # All ranks share this machine: gloo need not resolve the host name.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    if not launch.job.train.threads:
        torch.set_num_threads(launch.threads)  # W trainers share the machine's cores
    if launch.backend == "nccl":  # one GPU per rank, round robin over the GPUs
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        launch.backend,
        init_method=launch.init_method,
        rank=rank,
        world_size=launch.world_size,
        timeout=datetime.timedelta(seconds=launch.pg_timeout_s),
    )
    client: PSClient | ShardedPSClient
    if launch.server_actors:
        from estuary.runtime.ray.plane import actor_clients, connect_actor

        actors = actor_clients(launch.server_actors, timeout_s=launch.ps_timeout_s)
        if len(actors) == 1 and not launch.sharded_ps:
            client = actors[0]
        else:  # a sharded client follows a split or merge (servers named by their actors)
            client = ShardedPSClient(actors, connect=connect_actor)
    else:
        client = connect_servers(
            launch.addresses,
            launch.authkeys,
            sharded=launch.sharded_ps,
            timeout_s=launch.ps_timeout_s,
            connect_timeout_s=launch.startup_timeout_s,
        )
    try:
        yield client
    finally:
        client.close()
        dist.destroy_process_group()


def resume_if_asked(trainer: Trainer, job: JobSpec, resume: bool) -> bool:
    """Restore ``trainer`` from ``output.dir``'s newest checkpoint when ``resume``
    and there is one; returns whether it did."""
    out = job.resolve(job.output.dir)
    if not resume or not (out / "checkpoints" / LATEST).is_file():
        return False
    trainer.load_checkpoint(out)
    return True


def trainer_main(
    rank: int,
    launch: WorkerLaunch,
    results: Any,
    stop_signal: Any,
    environ: dict[str, str] | None = None,
    cwd: str | None = None,
    stdio: object = None,
) -> None:
    """Entry point of trainer process ``rank`` (started by the launcher, from a
    fork server); ``environ`` and ``cwd``: the launcher's at launch, taken on
    before anything reads them; ``stdio``: its standard streams, already made
    this process's own as the arguments were unpickled
    (``estuary.runtime.launcher.LauncherStdio``)."""
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    if cwd is not None:
        os.chdir(cwd)
    # Ctrl-C reaches the whole process group: the launcher decides (``stop_signal``).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    result = run_trainer(rank, launch, stop_signal)
    if result is not None:
        results.put(result)


def run_trainer(
    rank: int, launch: WorkerLaunch, stop_signal: Any
) -> FitResult | TrainingStopped | None:
    """Train as rank ``rank`` of ``launch`` (any runtime's trainer process); rank 0
    returns the run's result (or the ``TrainingStopped`` every rank stopped with),
    the other ranks ``None``. ``stop_signal``: an object whose ``value`` is a
    signal number once a stop is asked (0 until then)."""
    # The CLI's --log-* settings (from the environment), else warnings and the
    # metrics port line (rank 0 serves the metrics); records carry this rank.
    (LogSettings.from_env() or LogSettings.parse([])).apply(rank=rank)
    with worker_session(rank, launch) as client:
        trainer = DistributedTrainer(
            launch.job, client, rank=rank, world_size=launch.world_size, stop_signal=stop_signal
        )
        if rank == 0:
            trainer.split_pool = launch.split_pool
        trainer.part_routes = launch.part_routes
        if launch.embedding_workers:
            from estuary.runtime.ray.embedding_workers import use_embedding_worker

            use_embedding_worker(trainer, launch.embedding_workers[rank])
        resume_if_asked(trainer, launch.job, launch.resume)  # nothing checkpoints yet
        dist.barrier()  # Blocking wait: rank 0 has loaded the tables into the server.
        try:
            fitted = trainer.fit(progress=launch.progress and rank == 0)
            fitted.extra.update(trainer.server_figures())
            result: FitResult | TrainingStopped = fitted
        except TrainingStopped as stop:  # every rank, after the same step
            result = stop
        dist.barrier()  # Blocking wait: ranks leave together, after rank 0's eval/checkpoint.
    return result if rank == 0 else None
