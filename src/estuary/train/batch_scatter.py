"""Several trainers on one ``data.dataset``: rank 0 reads, every rank trains a share.

::

    rank 0: Driver(batch_size = W x B) -> one batch of <= W B rows per step
            split_rows -> W contiguous parts (sizes differ by at most 1)
            part 0 trained here; part r sent to rank r (gloo, its own group)
            Progress.record(the whole batch's row ids) after the step
    rank r: receives part r: header int64 (4 + F,), ints int64, floats float32
            (labels, dense, per-row weights when the batch has them), origin bytes

Why one reader: a stream's windows and splits depend on when data arrived, so
W ranks planning on their own could disagree about what a task holds; rank 0
plans, reads and accounts for every row, and its ``Progress`` (the one a
one-trainer run keeps) goes into the checkpoint with the model. A resume, with
any W, reads it like a one-trainer checkpoint.

Every rank learns each step's total rows N and the end of the data from the
same header, so all ranks take the same number of steps and DDP's collectives
never wait for a rank that ran out of data. A rank whose part is empty (the
last batch had fewer than W rows) still runs the step: zero rows, zero dense
gradients, one empty push per table (the parameter server applies a step once
all W ranks have pushed it).

Loss: each rank's loss is the sum over its part times W / N (the feed's
``StepShare.loss_scale``, applied by ``Engine.step``);
DDP averages over W ranks and the ranks push sparse gradients times 1/W, so
both halves follow the gradient of the mean loss over the step's N rows: a
W-trainer step is the step one trainer takes on the whole batch of W x B rows.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from estuary.data.types import Batch, Int64Array, JaggedIds

__all__ = ["BatchScatter", "StepShare", "split_rows"]

_END = -1  # header[0] of the message that ends the data
_HEAD = 4  # header slots before the per-feature id counts (see ``_header``)


def split_rows(batch: Batch, world_size: int) -> list[Batch]:
    """``batch`` -> W contiguous parts; part r has ``n // W`` rows, plus one for
    ``r < n mod W`` (so a batch of fewer than W rows leaves some parts empty)."""
    if world_size == 1:
        return [batch]
    n = batch.num_rows
    sizes = [n // world_size + (1 if r < n % world_size else 0) for r in range(world_size)]
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return [batch.slice(int(a), int(b)) for a, b in itertools.pairwise(bounds)]


@dataclass(frozen=True)
class StepShare:
    """What a rank knows about a step besides its own rows.

    Args:
        rows: N, the step's rows over all ranks.
        row_ids: rank 0: int64 (N,) every rank's row ids (for ``Progress.record``);
            other ranks: ``None``.
    """

    rows: int
    row_ids: Int64Array | None


class BatchScatter:
    """Each step's batch for this rank, and the step's ``StepShare`` (see module
    docstring).

    Args:
        rank: this trainer's rank r.
        world_size: W.
        features: sparse features in model order (F); every batch has them all.
        num_dense: Dd.
        source: rank 0: the Driver's batches of up to W x B rows; others: ``None``.
        group: a gloo process group of all W ranks used only for this (with W > 1),
            so its messages never interleave with DDP's collectives.

    ``batches()`` may run on a prefetch thread; ``next_share()`` is called once per
    step, in order, by the training loop (the shares queue up in step order).
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        features: Sequence[str],
        num_dense: int,
        source: Iterator[Batch] | None,
        group: Any = None,
    ) -> None:
        if (source is None) != (rank != 0):
            raise ValueError("rank 0, and only rank 0, reads the batches")
        if world_size > 1 and group is None:
            raise ValueError("several trainers need a process group for the batches")
        self.rank = rank
        self.world_size = world_size
        self.features = list(features)
        self.num_dense = num_dense
        self.source = source
        self.group = group
        self.send_s = 0.0  # rank 0: seconds spent handing parts to the other ranks
        self._shares: deque[StepShare] = deque()

    def batches(self) -> Iterator[Batch]:
        """This rank's part of every step, until the data ends (on all ranks at once)."""
        if self.source is None:
            yield from self._receive_all()
            return
        for batch in self.source:
            parts = split_rows(batch, self.world_size)
            self._send(parts[1:], batch.num_rows)
            self._shares.append(StepShare(batch.num_rows, batch.row_ids))
            yield parts[0]
        self._send([], _END)

    def next_share(self) -> StepShare:
        """The ``StepShare`` of the next step (call after taking its batch)."""
        return self._shares.popleft()

    # -- wire format -------------------------------------------------------------------

    def _header(self, part: Batch | None, rows: int) -> torch.Tensor:
        """int64 (4 + F,): part rows (``_END``: no more steps), step rows N, 1 when
        per-row weights follow the dense values, the origin's length in UTF-8
        bytes, then each feature's number of ids."""
        header = torch.zeros(_HEAD + len(self.features), dtype=torch.int64)
        header[0] = _END if part is None else part.num_rows
        header[1] = rows
        if part is not None:
            header[2] = part.weights is not None
            header[3] = len(part.origin.encode()) if part.origin else 0
            lengths = [part.sparse[f].values.shape[0] for f in self.features]
            header[_HEAD:] = torch.tensor(lengths, dtype=torch.int64)
        return header

    def _send(self, parts: Sequence[Batch], rows: int) -> None:
        if self.world_size == 1:
            return
        t0 = time.perf_counter()
        works, keep = [], []
        for dst in range(1, self.world_size):
            part = parts[dst - 1] if rows != _END else None
            tensors = [self._header(part, rows)]
            if part is not None:
                ints = [part.sparse[f].offsets for f in self.features]
                ints += [part.sparse[f].values for f in self.features]
                floats = [part.labels, part.dense.reshape(-1)]
                if part.weights is not None:
                    floats.append(part.weights)
                tensors.append(torch.from_numpy(np.concatenate(ints).astype(np.int64)))
                tensors.append(torch.from_numpy(np.concatenate(floats).astype(np.float32)))
                if part.origin:
                    origin = np.frombuffer(part.origin.encode(), dtype=np.uint8).copy()
                    tensors.append(torch.from_numpy(origin))
            for tensor in tensors:
                if tensor.numel():  # an empty part sends no floats; the receiver knows
                    work = dist.isend(tensor, dst=dst, group=self.group)
                    assert work is not None  # this rank is in the group
                    works.append(work)
                    keep.append(tensor)
        for work in works:
            work.wait()  # Blocking wait: every rank has its part (bounded by its prefetch)
        self.send_s += time.perf_counter() - t0

    def _recv(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.numel():
            # Blocking wait: for rank 0's next batch (as long as its data takes).
            dist.recv(tensor, src=0, group=self.group)
        return tensor

    def _receive_all(self) -> Iterator[Batch]:
        num_features = len(self.features)
        while True:
            header = self._recv(torch.empty(_HEAD + num_features, dtype=torch.int64)).numpy()
            n = int(header[0])
            if n == _END:
                return
            weighted, origin_bytes = bool(header[2]), int(header[3])
            lengths = header[_HEAD:]
            num_ints = num_features * (n + 1) + int(lengths.sum())
            ints = self._recv(torch.empty(num_ints, dtype=torch.int64))
            num_floats = n * (1 + self.num_dense + weighted)
            floats = self._recv(torch.empty(num_floats, dtype=torch.float32))
            origin = None
            if origin_bytes:
                raw = self._recv(torch.empty(origin_bytes, dtype=torch.uint8))
                origin = raw.numpy().tobytes().decode()
            values = ints.numpy()
            offsets = values[: num_features * (n + 1)].reshape(num_features, n + 1)
            starts = num_features * (n + 1) + np.concatenate([[0], np.cumsum(lengths)])
            sparse = {
                f: JaggedIds(values=values[starts[i] : starts[i + 1]], offsets=offsets[i])
                for i, f in enumerate(self.features)
            }
            labels = floats.numpy()[:n]
            dense = floats.numpy()[n : n * (1 + self.num_dense)].reshape(n, self.num_dense)
            weights = floats.numpy()[n * (1 + self.num_dense) :] if weighted else None
            self._shares.append(StepShare(int(header[1]), None))
            yield Batch(labels, dense, sparse, origin=origin, weights=weights)
