"""One rank of a multi-trainer run: ``DistributedTrainer``.

The dense network is replicated with DDP; the embedding tables live on one
parameter-server process every trainer shares (``RemoteTable``s). The runtime
(the runtime package) starts the server and the W trainer processes; each rank
builds a ``DistributedTrainer`` (in its worker bootstrap).

Gradient scaling: each rank's loss is the mean over its B rows, DDP averages
the dense gradients over ranks, and each rank pushes its sparse gradients times
1/W, which the server sums. Both halves therefore follow the gradient of the
mean loss over all W x B rows: a W-trainer step is the step one trainer would
take on the union of the W batches (see docs/distributed.md).
"""

from __future__ import annotations

import datetime
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from estuary.config import JobSpec
from estuary.data import TabularDataset
from estuary.ps import HostedTable, PSClient, ShardedPSClient
from estuary.train.feeds import rank_batches, rank_rows
from estuary.train.mixture import IdsGather, MixturePlans
from estuary.train.plan import TrainPlan, server_staleness
from estuary.train.stop import STOP_POLL_STEPS, CollectiveStop
from estuary.train.trainer import Trainer

__all__ = [
    "DATA_TIMEOUT",
    "STOP_POLL_STEPS",
    "DistributedTrainer",
    "gather_ids",
    "rank_batches",
    "rank_rows",
    "server_staleness",
    "table_plan",
]

# How long a rank waits for rank 0's next data.dataset batch: as long as rank 0
# may wait for data (readiness, idle streams); a failed rank 0 ends the run anyway.
DATA_TIMEOUT = datetime.timedelta(days=7)


def gather_ids(group: Any, world_size: int) -> IdsGather:
    """An ``IdsGather`` over ``group``: every rank's int64 array, in rank order
    (two all-gathers: the lengths, then the arrays padded to the longest)."""

    def gather(ids: np.ndarray) -> list[np.ndarray]:
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
        dist.all_gather(sizes, torch.tensor([ids.size], dtype=torch.int64), group=group)
        longest = max(int(n) for n in sizes)
        padded = torch.zeros(longest, dtype=torch.int64)
        padded[: ids.size] = torch.from_numpy(np.ascontiguousarray(ids, np.int64))
        parts = [torch.empty(longest, dtype=torch.int64) for _ in range(world_size)]
        dist.all_gather(parts, padded, group=group)
        return [p[: int(n)].numpy() for p, n in zip(parts, sizes, strict=True)]

    return gather


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
        client: the parameter server's client (several servers: ``ShardedPSClient``).
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
        client: PSClient | ShardedPSClient,
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
            plans = self.plan_for
            if isinstance(plans, MixturePlans) and plans.history_ids is not None:
                # Each history step's ids reach every rank, on a group of their own.
                plans.gather = gather_ids(dist.new_group(backend="gloo"), world_size)

    def server_figures(self) -> dict[str, int]:
        """The parameter server's step figures, once every rank's last step has
        landed (summary.json: ``ps_applied_steps``, ``ps_duplicate_pushes``, ...)."""
        for table in self.remote_tables.values():
            table.wait_applied()  # Blocking wait: every rank's last step has landed.
        ps = self.client.server_stats()
        return {
            "trainers": self.world_size,
            "ps_shards": getattr(self.client, "servers", 1),
            "ps_applied_steps": min((s["applied"] for s in ps.values()), default=0),
            "ps_duplicate_pushes": sum(s["duplicates"] for s in ps.values()),
            "ps_waits": sum(s["waits"] for s in ps.values()),
            "ps_max_behind": max((s["max_behind"] for s in ps.values()), default=0),
        }
