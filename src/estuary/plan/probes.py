"""Timings of the real components in a multi-process layout, for the calibration.

Two probes, each a set of spawned processes doing one part of a sync training
step, ``steps`` times after ``warmup`` steps (first inserts, JIT and allocator
warm-up excluded):

  ``ps_layout``     W client processes against S ``ServerProcess``es (staleness 0,
                    world size W): every step each client's ``lookup_many`` (train)
                    and ``apply_gradients_many`` of its share of a fixed batch
                    stream, through the real client (``connect_servers``: a
                    ``PSClient`` for one server, a ``ShardedPSClient`` for more).
                    The figures: wall seconds per step (rank 0's), CPU seconds per
                    step of one client (their mean) and of all servers together.
  ``dense_layout``  W processes in a gloo process group, one torch thread each,
                    the job's dense model (wrapped in DDP when W > 1) on synthetic
                    inputs of the job's shapes: forward, backward (the embedding
                    input has a gradient, as in training) and the dense optimizer
                    step. Wall and CPU seconds per step of one process (the mean).
  ``parallel_dense`` N independent processes (no process group) doing the
                    same dense step at once for a fixed wall window: wall and CPU
                    seconds per step of one process (the mean). Against N = 1 it
                    says how the machine's cores scale for this work
                    (``parallel_efficiency``): SMT siblings, shared caches and
                    memory bandwidth show up as more CPU per step.

Nothing here is fitted to an ``estuary train`` run: these are the same code paths
timed on their own, so the request costs come from direct timings rather than from
differences of end-to-end figures.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "LayoutTiming",
    "dense_layout",
    "parallel_dense",
    "parallel_efficiency",
    "proc_cpu_s",
    "ps_layout",
    "ps_layout_rounds",
]


@dataclass(frozen=True)
class LayoutTiming:
    """Per-step figures of one probe.

    Args:
        trainers: W.
        shards: S (0 for the dense probe).
        wall_s: wall seconds of one step.
        client_cpu_s: CPU seconds of one step in one trainer/client process (mean).
        server_cpu_s: CPU seconds of one step in all servers together.
        steps: timed steps.
        admissions: ids the servers' tables gave a row to during the window
            (the PS probe's; 0 for the dense ones): 0 when the window, like the
            real runs' steady window, inserts nothing.
    """

    trainers: int
    shards: int
    wall_s: float
    client_cpu_s: float
    server_cpu_s: float
    steps: int
    admissions: int = 0


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` so far (Linux /proc): the
    on-CPU nanoseconds of its live threads (``task/*/schedstat``), or where the
    kernel keeps no schedstats the clock ticks of ``stat`` (10 ms each). Ticks
    are too coarse for the PS probe's one-id steps: their server CPU over 30
    steps is ~40 ms, 4 ticks, so one tick more or less moved
    ``ps_s_per_request`` by 25%. A thread that exits between two readings takes
    its time with it: read around spans in which none does."""
    try:
        return (
            sum(
                int((task / "schedstat").read_text().split()[0])
                for task in Path(f"/proc/{pid}/task").iterdir()
            )
            / 1e9
        )
    except (OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _ps_client(
    rank: int,
    world: int,
    addresses: list[Any],
    authkeys: list[bytes],
    features: list[str],
    streams: list[list[list[np.ndarray]]],
    warm: list[tuple[int, int]],
    windows: list[list[tuple[int, int]]],
    compute_s: float,
    barrier: Any,
    out: Any,
) -> None:
    from estuary.ps.sharded import connect_servers

    client = connect_servers(addresses, authkeys)
    try:
        remote = client.tables(rank=rank, grad_scale=1.0 / world)
        stores = [remote[f] for f in features]
        rng = np.random.default_rng(rank)
        # Every batch's gradients drawn up front, outside every timing.
        grads = [
            [
                [
                    rng.normal(size=(a.size, remote[f].dim)).astype(np.float32)
                    for f, a in zip(features, b, strict=True)
                ]
                for b in stream
            ]
            for stream in streams
        ]

        def step(k: int, i: int) -> None:
            client.lookup_many(stores, streams[k][i], train=True)
            if compute_s > 0:  # the trainer's dense step: CPU time, not a sleep
                until = time.process_time() + compute_s
                while time.process_time() < until:
                    pass
            client.apply_gradients_many(stores, streams[k][i], grads[k][i])

        for k, i in warm:
            step(k, i)
        # The warm-up is the runs' first epoch; from their second on a
        # multi-epoch run counts no sightings (``AdmissionSwitch``), so no id
        # is admitted in their steady window: the timed windows do the same.
        for table in stores:
            table.set_admission_counting(False)
        for window in windows:
            before = sum(t.admissions for t in client.stats_many(stores))
            barrier.wait()  # Blocking wait: every client is ready for the window
            barrier.wait()  # Blocking wait: the parent has read the servers' CPU
            t0, c0 = time.perf_counter(), time.process_time()
            for k, i in window:
                step(k, i)
            for table in stores:
                table.wait_applied()  # Blocking wait: every rank's last step has landed.
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            barrier.wait()  # Blocking wait: every client's last step has landed
            barrier.wait()  # Blocking wait: the parent has read the servers' CPU
            admitted = sum(t.admissions for t in client.stats_many(stores)) - before
            out.put((rank, wall, cpu, admitted))
    finally:
        client.close()


def ps_layout(
    tables: dict[str, Any],
    batches: list[list[np.ndarray]],
    features: list[str],
    trainers: int,
    shards: int,
    *,
    steps: int,
    warmup: int,
    compute_s: float = 0.0,
) -> LayoutTiming:
    """Time W = ``trainers`` clients against S = ``shards`` servers (see module doc):
    one window of ``steps`` steps after ``warmup`` (``ps_layout_rounds`` with one
    stream and one round).

    Args:
        tables: table name -> ``HostedTable`` (the job's tables as a server hosts them).
        batches: the stream, per batch the unique ids of each of ``features``;
            rank r takes batches ``r, r + W, ...`` (cycled to ``warmup + steps``).
        features: table names, in the order of each batch's arrays.
        compute_s: CPU seconds each client spends between its lookup and its push
            (a stand-in for the dense step; 0: none).
    """
    rounds = ps_layout_rounds(
        tables,
        [batches],
        features,
        trainers,
        shards,
        steps=steps,
        warmup=warmup,
        rounds=1,
        compute_s=compute_s,
    )
    return rounds[0][0]


def ps_layout_rounds(
    tables: dict[str, Any],
    streams: list[list[list[np.ndarray]]],
    features: list[str],
    trainers: int,
    shards: int,
    *,
    steps: int,
    warmup: int,
    rounds: int,
    compute_s: float = 0.0,
) -> list[list[LayoutTiming]]:
    """``rounds`` interleaved timings of each of ``streams`` through the same W
    clients and S servers: ``[round][stream]``, each a window of ``steps`` steps.

    The processes start once and warm up once (``warmup`` steps of
    ``streams[0]``); then every round times one window of each stream in turn,
    so a drift in the machine's speed lands on every stream alike instead of on
    whichever was timed last, and no window pays a process's start-up. Each
    window's server CPU is read while every client waits at a barrier. After
    the warm-up the clients turn the tables' admission counting off, as a
    multi-epoch run does after its first epoch (``AdmissionSwitch``): no timed
    step admits an id (ids seen too few times read the unknown row, as in the
    runs' steady window); each window's ``admissions`` says so. Later streams
    should hold subsets of ``streams[0]``'s ids (e.g. the same batches cut
    shorter), so that every id they look up was seen in the warm-up.

    Args:
        tables: table name -> ``HostedTable`` (the job's tables as a server hosts them).
        streams: batch streams, per batch the unique ids of each of ``features``;
            rank r takes batches ``r, r + W, ...`` of each (cycled), the timed
            ones after the warm-up's.
        features: table names, in the order of each batch's arrays.
        compute_s: CPU seconds each client spends between its lookup and its push
            (a stand-in for the dense step; 0: none).
    """
    from estuary.ps.process import ServerProcess
    from estuary.ps.sharded import server_share
    from estuary.ps.types import ServerConfig

    if trainers < 1 or shards < 1:
        raise ValueError(f"ps_layout needs >= 1 trainer and shard, got {trainers}x{shards}")
    if not streams or rounds < 1 or steps < 1:
        raise ValueError(
            f"ps_layout_rounds needs >= 1 stream, round and step, got "
            f"{len(streams)}, {rounds}, {steps}"
        )
    config = ServerConfig(
        tables={f: server_share(t, shards) for f, t in tables.items()},
        world_size=trainers,
        staleness=0,
    )
    ctx = multiprocessing.get_context("spawn")
    servers = [ServerProcess(config) for _ in range(shards)]
    barrier = ctx.Barrier(trainers + 1)
    out = ctx.SimpleQueue()
    clients = []
    # (round, stream) windows in the order they run: round by round.
    order = [(r, k) for r in range(rounds) for k in range(len(streams))]
    timings: list[list[LayoutTiming]] = [[] for _ in range(rounds)]
    try:
        for rank in range(trainers):

            def at(k: int, j: int, rank: int = rank) -> tuple[int, int]:
                return k, (rank + trainers * j) % len(streams[k])

            warm = [at(0, j) for j in range(warmup)]
            windows = [[at(k, warmup + r * steps + j) for j in range(steps)] for r, k in order]
            args = (
                rank,
                trainers,
                [s.address for s in servers],
                [s.authkey for s in servers],
                features,
                streams,
                warm,
                windows,
                compute_s,
                barrier,
                out,
            )
            clients.append(ctx.Process(target=_ps_client, args=args, daemon=True))
        for p in clients:
            p.start()
        for r, _ in order:
            # The servers' CPU is read while every client waits at a barrier: no
            # request is in flight and no connection (a server thread) closes
            # between the two readings, so their difference is the window's.
            barrier.wait()  # Blocking wait: every client is ready for the window
            s0 = sum(proc_cpu_s(s.pid or 0) for s in servers)
            barrier.wait()  # Blocking wait: the clients start their timed steps
            barrier.wait()  # Blocking wait: every client's last step has landed
            server_s = sum(proc_cpu_s(s.pid or 0) for s in servers) - s0
            barrier.wait()  # Blocking wait: the clients read the tables' admissions
            got = sorted(out.get() for _ in range(trainers))
            timings[r].append(
                LayoutTiming(
                    trainers=trainers,
                    shards=shards,
                    wall_s=got[0][1] / steps,
                    client_cpu_s=float(np.mean([g[2] for g in got])) / steps,
                    server_cpu_s=server_s / steps,
                    steps=steps,
                    admissions=int(got[0][3]),  # rank 0's reading: the tables are shared
                )
            )
        for p in clients:
            p.join(timeout=30)
    finally:
        for p in clients:
            if p.is_alive():
                p.kill()
        for s in servers:
            s.stop()
    return timings


def _results_of(procs: list[Any], out: Any) -> list[Any]:
    """Start ``procs``, take one result from each off ``out``, and join them;
    any still alive at the end (an error, or a join timing out) is killed."""
    try:
        for p in procs:
            p.start()
        got = [out.get() for _ in procs]  # Blocking wait: every process's figures
        for p in procs:
            p.join(timeout=30)
        return got
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


def _dense_model(model_args: dict[str, Any], optimizer: tuple[str, float]) -> tuple[Any, Any]:
    """A probe process's dense model (seed 0, one torch thread) and its optimizer."""
    import torch

    from estuary.nn.models import build_model
    from estuary.train.build import DENSE_OPTIMIZERS

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(**model_args)
    opt = DENSE_OPTIMIZERS.get(optimizer[0], "train.dense_optimizer.name")(
        model.parameters(), lr=optimizer[1]
    )
    return model, opt


def _dense_worker(
    rank: int,
    world: int,
    init: str,
    model_args: dict[str, Any],
    optimizer: tuple[str, float],
    batch_rows: int,
    steps: int,
    warmup: int,
    windows: int,
    out: Any,
) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    model, opt = _dense_model(model_args, optimizer)
    if world > 1:
        dist.init_process_group(
            "gloo",
            init_method=init,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=300),
        )
        train_model: torch.nn.Module = DistributedDataParallel(model)
    else:
        train_model = model
    g = torch.Generator().manual_seed(rank)
    f, d = model_args["num_sparse"], model_args["embedding_dim"]
    dense = torch.randn(batch_rows, model_args["num_dense"], generator=g)
    labels = (torch.rand(batch_rows, generator=g) < 0.25).float()

    def step() -> None:
        sparse = torch.randn(batch_rows, f, d, generator=g).requires_grad_(True)
        logits = train_model(dense, sparse)
        loss = F.binary_cross_entropy_with_logits(logits.float(), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(warmup):
        step()
    figures = []
    for _ in range(windows):
        if world > 1:
            dist.barrier()  # Blocking wait: every rank starts the window together
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            step()
        figures.append((time.perf_counter() - t0, time.process_time() - c0))
    out.put((rank, figures))
    if world > 1:
        dist.destroy_process_group()


def _model_args(job: Any) -> tuple[dict[str, Any], tuple[str, float]]:
    """(``build_model`` keyword arguments, (dense optimizer, lr)) of ``job``."""
    from estuary.train.plan import TrainPlan

    plan = TrainPlan.from_job(job)
    features = list(plan.features)
    dims = {job.table_spec(plan.feature_tables[f]).dim for f in features}
    if len(dims) != 1:
        raise ValueError(f"dense probe: the features' embedding dims differ: {sorted(dims)}")
    model_args = {
        "name": job.model.type,
        "params": dict(job.model.params),
        "num_dense": len(job.data.schema.dense),
        "num_sparse": len(features),
        "embedding_dim": dims.pop(),
        "features": features,
    }
    return model_args, (job.train.dense_optimizer.name, job.train.dense_optimizer.lr)


def dense_layout(
    job: Any, trainers: int, batch_rows: int, *, steps: int, warmup: int, windows: int = 1
) -> LayoutTiming:
    """Time W = ``trainers`` processes' dense steps of ``job``'s model (module doc):
    ``windows`` windows of ``steps`` steps after ``warmup``, in the same processes
    (one start-up); each figure is the median over windows of the ranks' mean."""
    if windows < 1 or steps < 1:
        raise ValueError(f"dense_layout: windows and steps must be >= 1, got {windows}, {steps}")
    model_args, optimizer = _model_args(job)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="estuary-probe-") as folder:
        init = f"file://{os.path.join(folder, 'rendezvous')}"
        procs = [
            ctx.Process(
                target=_dense_worker,
                args=(
                    r,
                    trainers,
                    init,
                    model_args,
                    optimizer,
                    batch_rows,
                    steps,
                    warmup,
                    windows,
                    out,
                ),
                daemon=True,
            )
            for r in range(trainers)
        ]
        got = _results_of(procs, out)
    # (windows, ranks, 2): wall and CPU seconds of each rank's window.
    per = np.array([figures for _, figures in sorted(got)]).transpose(1, 0, 2)
    return LayoutTiming(
        trainers=trainers,
        shards=0,
        wall_s=float(np.median(per[:, :, 0].mean(axis=1))) / steps,
        client_cpu_s=float(np.median(per[:, :, 1].mean(axis=1))) / steps,
        server_cpu_s=0.0,
        steps=steps * windows,
    )


def _parallel_worker(
    rank: int,
    model_args: dict[str, Any],
    optimizer: tuple[str, float],
    batch_rows: int,
    warmup: int,
    seconds: float,
    barrier: Any,
    out: Any,
) -> None:
    import torch
    import torch.nn.functional as F

    model, opt = _dense_model(model_args, optimizer)
    g = torch.Generator().manual_seed(rank)
    f, d = model_args["num_sparse"], model_args["embedding_dim"]
    dense = torch.randn(batch_rows, model_args["num_dense"], generator=g)
    labels = (torch.rand(batch_rows, generator=g) < 0.25).float()

    def step() -> None:
        sparse = torch.randn(batch_rows, f, d, generator=g).requires_grad_(True)
        loss = F.binary_cross_entropy_with_logits(model(dense, sparse).float(), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(warmup):
        step()
    barrier.wait()  # Blocking wait: every process starts its window together
    t0, c0, steps = time.perf_counter(), time.process_time(), 0
    while time.perf_counter() - t0 < seconds:
        step()
        steps += 1
    out.put((rank, steps, time.perf_counter() - t0, time.process_time() - c0))


def parallel_dense(
    job: Any, processes: int, batch_rows: int, *, seconds: float, warmup: int
) -> LayoutTiming:
    """``processes`` independent processes (one torch thread each, no process
    group) doing ``job``'s dense step at once, each for the same ``seconds`` of wall
    time after ``warmup`` steps: wall and CPU seconds per step of one process (the
    mean over processes)."""
    if processes < 1:
        raise ValueError(f"parallel_dense: processes must be >= 1, got {processes}")
    model_args, optimizer = _model_args(job)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.SimpleQueue()
    barrier = ctx.Barrier(processes)
    procs = [
        ctx.Process(
            target=_parallel_worker,
            args=(r, model_args, optimizer, batch_rows, warmup, seconds, barrier, out),
            daemon=True,
        )
        for r in range(processes)
    ]
    got = _results_of(procs, out)
    return LayoutTiming(
        trainers=processes,
        shards=0,
        wall_s=float(np.mean([wall / max(n, 1) for _, n, wall, _ in got])),
        client_cpu_s=float(np.mean([cpu / max(n, 1) for _, n, _, cpu in got])),
        server_cpu_s=0.0,
        steps=int(sum(n for _, n, _, _ in got)),
    )


def parallel_efficiency(
    alone: list[LayoutTiming], together: list[LayoutTiming]
) -> tuple[float, float]:
    """(efficiency, throughput) of N processes computing at once, from rounds of
    ``parallel_dense`` with 1 process (``alone``) and with N (``together``).

    efficiency: CPU per step alone over CPU per step together, the least CPU
        per step of each kept (other jobs on a shared machine only add to it),
        clamped to (0, 1]: the work a process does per CPU second while N
        compute, relative to alone.
    throughput: N x wall per step alone over wall per step together (the best
        of each): how many processes' worth of steps N at once complete per
        second; on an idle machine N x efficiency.
    """
    if not alone or not together:
        raise ValueError("parallel_efficiency: needs >= 1 round alone and together")
    n = together[0].trainers
    if alone[0].trainers != 1 or any(t.trainers != n for t in together):
        raise ValueError("parallel_efficiency: alone must be 1 process, together all N")
    cpu_1 = min(t.client_cpu_s for t in alone)
    cpu_n = min(t.client_cpu_s for t in together)
    wall_1 = min(t.wall_s for t in alone)
    wall_n = min(t.wall_s for t in together)
    if min(cpu_1, cpu_n, wall_1, wall_n) <= 0:
        raise ValueError("parallel_efficiency: every round needs > 0 seconds a step")
    return min(max(cpu_1 / cpu_n, 1e-3), 1.0), n * wall_1 / wall_n
