"""Several trainers on one machine: the dense network replicated with DDP, the
embedding tables on one parameter-server process that every trainer shares.

::

    run_distributed(job, trainers=W)
      ServerProcess ---- hosts every table; step t is applied once, when all W
      |                  ranks have pushed it (sum of their gradients per id)
      spawn W trainers, rank r:
        init_process_group(gloo | nccl)   dense grads averaged by DDP (nccl: CUDA models)
        rows of an epoch: perm[r::W]      same permutation on every rank
          (data.dataset: rank 0 reads, sends rank r its part of each step)
        lookup(step t) -> forward/backward -> dense step -> push(t, r, grads / W)
      rank 0: eval + checkpoint (tables pulled from the server) -> FitResult

Gradient scaling: each rank's loss is the mean over its B rows, DDP averages
the dense gradients over ranks, and each rank pushes its sparse gradients times
1/W, which the server sums. Both halves therefore follow the gradient of the
mean loss over all W x B rows: a W-trainer step is the step one trainer would
take on the union of the W batches (see docs/distributed.md).
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException
from torch.nn.parallel import DistributedDataParallel

from estuary.config import JobSpec
from estuary.data import TabularDataset
from estuary.ps import HostedTable, PSClient, ServerConfig, ServerProcess
from estuary.ps.types import Address
from estuary.train.checkpoint_chain import LATEST
from estuary.train.engine import resolve_device
from estuary.train.feeds import rank_batches, rank_rows
from estuary.train.plan import TrainPlan, server_staleness
from estuary.train.result import FitResult, TrainingStopped
from estuary.train.stop import STOP_POLL_STEPS, CollectiveStop
from estuary.train.trainer import Trainer

__all__ = [
    "STOP_POLL_STEPS",
    "DistributedError",
    "DistributedTrainer",
    "rank_batches",
    "rank_rows",
    "run_distributed",
    "server_staleness",
    "stop_value",
    "table_plan",
]

BACKENDS = ("gloo", "nccl")  # nccl: dense models on CUDA (``train.device``)
# How long a rank waits for rank 0's next data.dataset batch: as long as rank 0
# may wait for data (readiness, idle streams); a failed rank 0 ends the run anyway.
DATA_TIMEOUT = datetime.timedelta(days=7)


class DistributedError(RuntimeError):
    """A trainer process of a multi-trainer run failed; the message names its rank
    and the error's last line (the full traceback is the ``__cause__``)."""


def default_backend(job: JobSpec) -> str:
    """``nccl`` when the job's dense model runs on CUDA, else ``gloo``."""
    return "nccl" if resolve_device(job.train.device).type == "cuda" else "gloo"


def table_plan(job: JobSpec) -> dict[str, HostedTable]:
    """The job's tables as ``Trainer`` builds them (``TrainPlan.hosted_tables``)."""
    return TrainPlan.from_job(job).hosted_tables()


class DistributedTrainer(Trainer):
    """One rank of a multi-trainer run: tables are ``RemoteTable``s of a parameter
    server, the dense model is wrapped in ``DistributedDataParallel``, stops are
    agreed on by all ranks (``CollectiveStop``) and only rank 0 restores the
    tables. Everything else is the ``Trainer``'s: the feeds split the data by
    rank (``EpochFeed``: rows ``perm[r::W]``; ``GraphFeed``: rank 0 reads and
    scatters).

    Args:
        job: the job (every rank gets the same one).
        client: the parameter server's client.
        rank: this trainer's rank r.
        world_size: W; the process group must be initialised when W > 1.
        model: as for ``Trainer``.
        dataset: as for ``Trainer`` (every rank reads the whole dataset and trains
            its share).
        stop_signal: a shared int the launcher sets to a signal number to stop.

    ``train.batch_size`` is per rank: a step trains W x batch_size rows.
    """

    def __init__(
        self,
        job: JobSpec,
        client: PSClient,
        *,
        rank: int,
        world_size: int,
        model: torch.nn.Module | None = None,
        dataset: TabularDataset | None = None,
        stop_signal: Any = None,
    ) -> None:
        self.client = client
        self.remote_tables = client.tables(rank=rank, grad_scale=1.0 / world_size)
        stop = CollectiveStop(stop_signal, world_size)
        super().__init__(
            job,
            model,
            dataset=dataset,
            tables=self.remote_tables,
            rank=rank,
            world_size=world_size,
            stop=stop,
        )
        self.restores_tables = rank == 0  # into the server, for every rank
        if world_size > 1:
            # Construction broadcasts rank 0's parameters (a collective).
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self.engine.train_model = DistributedDataParallel(self.model, device_ids=device_ids)
            # data.dataset batches go from rank 0 to the others on their own gloo
            # group (CPU tensors, never ordered against DDP's collectives). Its
            # timeout is long: a rank waits as long as rank 0 waits for data.
            self.data_group = dist.new_group(backend="gloo", timeout=DATA_TIMEOUT)
            # Stop polls: a one-int all-reduce every STOP_POLL_STEPS steps, on its own
            # group so it never interleaves with the data group's scatters.
            stop.group = dist.new_group(backend="gloo")

    def server_figures(self) -> dict[str, int]:
        """The parameter server's step figures, once every rank's last step has
        landed (summary.json: ``ps_applied_steps``, ``ps_duplicate_pushes``, ...)."""
        for table in self.remote_tables.values():
            table.wait_applied()  # Blocking wait: every rank's last step has landed.
        ps = self.client.server_stats()
        return {
            "trainers": self.world_size,
            "ps_applied_steps": min((s["applied"] for s in ps.values()), default=0),
            "ps_duplicate_pushes": sum(s["duplicates"] for s in ps.values()),
            "ps_waits": sum(s["waits"] for s in ps.values()),
            "ps_max_behind": max((s["max_behind"] for s in ps.values()), default=0),
        }


@dataclass(frozen=True)
class _Launch:
    """What every trainer process gets (pickled once per process by spawn)."""

    job: JobSpec
    world_size: int
    address: Address
    authkey: bytes
    init_method: str
    backend: str
    pg_timeout_s: float
    ps_timeout_s: float
    startup_timeout_s: float
    threads: int
    progress: bool
    resume: bool


def _loopback_interface() -> str | None:
    names = {name for _, name in socket.if_nameindex()}
    return next((name for name in ("lo", "lo0") if name in names), None)


def _trainer_main(rank: int, launch: _Launch, results: Any, stop_signal: Any) -> None:
    """Entry point of trainer process ``rank`` (spawned by ``run_distributed``)."""
    # Ctrl-C reaches the whole process group: the launcher decides (``stop_signal``).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    loopback = _loopback_interface()
    if loopback is not None:
        # All ranks share this machine: gloo need not resolve the host name.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    if not launch.job.train.threads:
        torch.set_num_threads(launch.threads)  # W trainers share the machine's cores
    if rank == 0 and launch.job.output.metrics_port is not None:
        from estuary.metrics.training import show_metrics_url

        show_metrics_url()  # rank 0 serves the metrics; its port line reaches stderr
    if launch.backend == "nccl":  # one GPU per rank, round robin over the GPUs
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        launch.backend,
        init_method=launch.init_method,
        rank=rank,
        world_size=launch.world_size,
        timeout=datetime.timedelta(seconds=launch.pg_timeout_s),
    )
    client = PSClient(
        launch.address,
        launch.authkey,
        timeout_s=launch.ps_timeout_s,
        connect_timeout_s=launch.startup_timeout_s,
    )
    try:
        trainer = DistributedTrainer(
            launch.job, client, rank=rank, world_size=launch.world_size, stop_signal=stop_signal
        )
        out = launch.job.resolve(launch.job.output.dir)
        if launch.resume and (out / "checkpoints" / LATEST).is_file():
            trainer.load_checkpoint(out)  # nothing writes a checkpoint before the barrier
        dist.barrier()  # Blocking wait: rank 0 has loaded the tables into the server.
        try:
            fitted = trainer.fit(progress=launch.progress and rank == 0)
            fitted.extra.update(trainer.server_figures())
            result: FitResult | TrainingStopped = fitted
        except TrainingStopped as stop:  # every rank, after the same step
            result = stop
        if rank == 0:
            results.put(result)
        dist.barrier()  # Blocking wait: ranks leave together, after rank 0's eval/checkpoint.
    finally:
        client.close()
        dist.destroy_process_group()


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
) -> FitResult:
    """Train ``job`` with W trainer processes and one parameter server on this
    machine; returns rank 0's ``FitResult`` (rank 0 also writes the checkpoint).

    Args:
        job: the job; ``train.batch_size`` is per trainer.
        trainers: W (default ``runtime.trainers``).
        progress: show rank 0's progress bar (only with W = 1; see ``fit``).
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

    Raises:
        DistributedError: a trainer failed (its rank and error in the message).
        PSError: the parameter server failed to start.
        TrainingStopped: ``stop_signal`` was set; the run stopped with a checkpoint.
    """
    world_size = job.runtime.trainers if trainers is None else trainers
    if world_size < 1:
        raise ValueError(f"trainers must be >= 1, got {world_size}")
    backend = default_backend(job) if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "nccl" and resolve_device(job.train.device).type != "cuda":
        raise ValueError("backend 'nccl' needs train.device 'cuda' (or 'auto' with CUDA present)")
    config = ServerConfig(
        table_plan(job),
        world_size=world_size,
        staleness=server_staleness(job.train),
        wait_timeout_s=ps_wait_timeout_s,
    )
    # The server starts while the trainers import torch; they retry their connect.
    server = ServerProcess(config, startup_timeout_s=startup_timeout_s, wait=False)
    context = None
    try:
        with tempfile.TemporaryDirectory(prefix="estuary-pg-") as folder:
            launch = _Launch(
                job=job,
                world_size=world_size,
                address=server.address,
                authkey=server.authkey,
                init_method=f"file://{os.path.join(folder, 'rendezvous')}",
                backend=backend,
                pg_timeout_s=pg_timeout_s,
                ps_timeout_s=ps_wait_timeout_s + 60.0,
                startup_timeout_s=startup_timeout_s,
                threads=max(1, (os.cpu_count() or 1) // world_size),
                progress=bool(job.output.progress if progress is None else progress),
                resume=resume,
            )
            results = torch_mp.get_context("spawn").SimpleQueue()
            if stop_signal is None:
                stop_signal = stop_value()
            context = torch_mp.start_processes(
                _trainer_main,
                args=(launch, results, stop_signal),
                nprocs=world_size,
                join=False,
                start_method="spawn",
            )
            server.wait_ready()
            out: list[FitResult | TrainingStopped] = []
            try:
                # Blocking wait: trainers run; the first failure stops the others.
                while not context.join(timeout=0.5):
                    while not results.empty():
                        out.append(results.get())
            except ProcessRaisedException as exc:
                raise DistributedError(
                    f"trainer rank {exc.error_index} failed: {_last_line(exc.msg)}"
                ) from exc
            except ProcessExitedException as exc:
                how = f"signal {exc.signal_name}" if exc.signal_name else f"code {exc.exit_code}"
                raise DistributedError(f"trainer rank {exc.error_index} exited with {how}") from exc
            while not results.empty():
                out.append(results.get())
    finally:
        if context is not None:
            _stop(context.processes)
        server.stop()
    if not out:
        raise DistributedError("rank 0 finished without a result")
    if isinstance(out[0], TrainingStopped):
        raise out[0]
    return out[0]


def stop_value() -> Any:
    """A shared int for ``run_distributed(stop_signal=...)`` (0 = keep training)."""
    return torch_mp.get_context("spawn").Value("i", 0)


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
