"""Progressive evaluation (predict, then train) of ``data.dataset`` runs
(``train.progressive_eval``; docs/mixture.md).

The training step's forward already scores its batch with the model as it was
before the step's update; ``ProgressiveEval.record`` takes those logits (no second
forward, no extra pass over the data) and files every row under:

* its **event-time window**: the ``[start_s, end_s)`` of the task the row was read
  from, decoded from ``Batch.row_ids`` by the data ``Progress`` (before the step's
  rows are committed, while their tasks are still open);
* its **origin**: ``stream/source`` of that task, and also ``new_ids`` when the
  row holds an id never seen in an earlier training batch (``SeenIds``);
* the **event -> trained lag**: wall time at the step minus the window's *end*
  (the newest event time a row of the window can have, so the lag is a lower
  bound of each row's own, and exact to within one window).

With ``train.mixed_buffer`` rows are scored as they **arrive**, before the
buffer (``score_on_arrival``; in hybrid/async mode on the read-ahead thread by
an ``ArrivalScorer``): every offered row, including those the buffer later
drops, by the model as it was when the row arrived. ``hold_scores`` keeps each
score (``PendingScores``) until the row is committed: ``file_dropped`` when the
buffer drops it, ``file_trained`` (with the lag) after its step, both as the
data progress records them, so the figures a checkpoint saves cover exactly the
rows its data progress counts and a resume, which reads the rows still waiting
again, scores each row once. With several trainers rank 0 reads every row (its
buffer feeds all ranks), so it scores them all with its replica of the dense
model (the same as every rank's in sync mode) and the PS's rows, and files every
rank's share of each step.

The figures (in bounded memory, ``metrics.progressive_groups``) and the seen-ids
bitmap are saved with each checkpoint (``CHECKPOINT_NAME``; ``FitLoop`` hands
``ProgressiveEval`` to ``Checkpointer.add_extra``) and restored on resume. A row
still waiting at a checkpoint has marked its ids in the bitmap saved, so read
again after a resume it would find them seen: the rows waiting that held a new
id are saved too (``held_new``), and keep that on their second arrival.

Cost when on: a sigmoid and a device-to-host copy of the (B,) logits (a CPU-GPU
sync point on CUDA), a pass over the B split codes, one bitmap probe per id, and
~0.1 ms a step of 1,000 rows for the figures (docs/mixture.md).
When off, the loop does none of it. With several trainers rank 0 records its own
share of each step (it alone holds the data progress); nothing is gathered.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import torch

from estuary.config.errors import ConfigError
from estuary.config.spec import JobSpec
from estuary.data.graph.progress import Progress
from estuary.data.types import Batch, Int64Array
from estuary.metrics.progressive import NEW_IDS, ProgressiveCollector, ProgressiveStats
from estuary.metrics.progressive_state import restore_stats, stats_arrays
from estuary.metrics.training import TrainingMetrics
from estuary.train.arrival import ArrivalScorer
from estuary.train.callbacks import LoopState
from estuary.train.engine import Engine
from estuary.train.feeds import Feed, GraphFeed
from estuary.train.pending_scores import PendingScores, Taken

__all__ = ["CHECKPOINT_NAME", "ProgressiveEval", "SeenIds", "progressive_for", "score_on_arrival"]

logger = logging.getLogger(__name__)

CHECKPOINT_NAME = "progressive"
"""Checkpoint extra state (``extra/progressive.safetensors``): the figures so far
(``metrics.progressive_state``, ``stats.`` prefix), the seen-ids bitmap
(``SeenIds.state``, ``seen_ids.`` prefix) and ``HELD_NEW``."""

HELD_NEW = "held_new"
"""int64 (K,): the rows waiting at the checkpoint (scored on arrival, not yet
committed) that held an id never seen before when they arrived."""

BoolArray = npt.NDArray[np.bool_]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class SeenIds:
    """Which ids were seen before: one bit per slot of ``2**bits``, an id's slot
    being the top bits of ``id * golden`` (ids are already hashed 64-bit values).

    Approximate in one direction: a new id whose slot an earlier id set reads as
    seen. With ``n`` ids seen, a new id is missed with probability about
    ``1 - exp(-n / 2**bits)`` (2**26 bits = 8 MiB: 1.5% at a million ids, 14% at
    ten million). A seen id never reads as new, evicted or not.

    Thread-safe: with a mixed buffer rows arrive (and mark their ids) on the
    read-ahead thread while the step's thread copies the bitmap for a checkpoint.

    Args:
        bits: log2 of the slots.
    """

    def __init__(self, bits: int = 26) -> None:
        self.bitmap = np.zeros(1 << (bits - 3), np.uint8)  # (2**bits / 8,)
        self._shift = np.uint64(64 - bits)
        self._lock = threading.Lock()

    def first_seen(self, ids: Int64Array) -> BoolArray:
        """bool (N,): True where ``ids[i]`` was not seen before this call; then
        marks every id seen (so duplicates within the call are all new)."""
        slot = (ids.view(np.uint64) * _GOLDEN) >> self._shift  # wraps mod 2**64
        byte = slot >> np.uint64(3)
        bit = np.left_shift(np.uint8(1), (slot & np.uint64(7)).astype(np.uint8))
        with self._lock:
            new: BoolArray = (self.bitmap[byte] & bit) == 0
            np.bitwise_or.at(self.bitmap, byte, bit)
        return new

    def state(self) -> dict[str, np.ndarray]:
        """A copy for a checkpoint: ``size`` int64 (1,), the bitmap's bytes, and
        its nonzero bytes as ``at`` int32 (K,) + ``bytes`` uint8 (K,) (5 bytes
        each) while they are under a fifth of it, else the whole ``bitmap``."""
        with self._lock:
            at = np.flatnonzero(self.bitmap)
            size = np.array([self.bitmap.shape[0]], np.int64)
            if at.shape[0] * 5 < self.bitmap.shape[0]:
                return {"size": size, "at": at.astype(np.int32), "bytes": self.bitmap[at]}
            return {"size": size, "bitmap": self.bitmap.copy()}

    def restore(self, state: dict[str, np.ndarray]) -> bool:
        """Back to a ``state()``; False (and left as is) when it is of another
        size or incomplete."""
        size = state.get("size")
        if size is None or int(size[0]) != self.bitmap.shape[0]:
            return False
        if "bitmap" in state:
            bitmap = np.asarray(state["bitmap"], np.uint8).copy()
        elif "at" in state and "bytes" in state:
            bitmap = np.zeros_like(self.bitmap)
            bitmap[np.asarray(state["at"], np.int64)] = state["bytes"]
        else:
            return False
        with self._lock:
            self.bitmap = bitmap
        return True

    def new_rows(self, batch: Batch) -> BoolArray:
        """bool (B,): rows with at least one id (any feature) not seen before."""
        out = np.zeros(batch.num_rows, np.bool_)
        for bag in batch.sparse.values():
            new = self.first_seen(bag.values.astype(np.int64, copy=False))
            seen = np.zeros(new.shape[0] + 1, np.int64)
            np.cumsum(new, out=seen[1:])
            out |= seen[bag.offsets[1:]] > seen[bag.offsets[:-1]]  # any new id in the bag
        return out


def _under(prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The arrays named ``prefix + name``, by ``name``."""
    return {k[len(prefix) :]: v.numpy() for k, v in tensors.items() if k.startswith(prefix)}


class ProgressiveEval:
    """Files each training batch's pre-update predictions by window and origin.

    Args:
        progress: the feed's data progress (decodes row ids to tasks).
        stats: where the figures go.
        clock: wall time in seconds since 1970 (for the lag).
    """

    def __init__(
        self,
        progress: Progress,
        stats: ProgressiveStats,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.progress, self.stats, self.clock = progress, stats, clock
        self.seen = SeenIds()
        self.pending = PendingScores()  # scored on arrival, not yet committed
        # After a resume: rows that waited at the checkpoint holding a new id on
        # their first arrival (read again, they find their ids marked seen).
        self._held_new: Int64Array | None = None

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """The figures, the seen-ids bitmap and the waiting rows that held a new
        id, copied (``CheckpointExtra``)."""
        stats = {f"stats.{k}": v for k, v in stats_arrays(self.stats).items()}
        seen = {f"seen_ids.{k}": v for k, v in self.seen.state().items()}
        # After the bitmap: a row arriving between the two copies is in both.
        # Rows waiting since before the last resume, not yet read again, before
        # the held rows: ``hold_scores`` (on the read-ahead thread in hybrid or
        # async mode) holds a row before it leaves ``_held_new``, so a row read
        # again meanwhile is in one of the two.
        before = self._held_new
        held_new = self.pending.new_row_ids()
        if before is not None:
            held_new = np.union1d(held_new, before)
        tensors = {**stats, **seen, HELD_NEW: held_new}
        return {k: torch.from_numpy(v) for k, v in tensors.items()}

    def restore_state(self, tensors: dict[str, torch.Tensor] | None) -> None:
        """Continue from a checkpoint's figures and bitmap. ``None`` (a checkpoint
        written without them) or a state it cannot read (another format): start
        afresh, saying so once; the figures never stop a resume."""
        if tensors is None:
            logger.warning(
                "the checkpoint has no progressive-evaluation state (written before "
                "it was saved): the progressive figures start afresh"
            )
            return
        try:
            restore_stats(self.stats, _under("stats.", tensors))
        except ValueError as exc:
            logger.warning("%s: the progressive figures start afresh", exc)
            return
        if not self.seen.restore(_under("seen_ids.", tensors)):
            # ids seen before the resume read as new (new_ids overcounts a while)
            logger.warning("the checkpoint's seen-ids bitmap does not fit: it starts empty")
            return
        held = tensors.get(HELD_NEW)  # absent in checkpoints written before it was saved
        self._held_new = (
            held.numpy().astype(np.int64) if held is not None and held.numel() else None
        )

    def record(self, batch: Batch, logits: torch.Tensor) -> None:
        """``logits`` (B,): the step's forward on ``batch``, before its update."""
        if batch.row_ids is None:
            raise ValueError("progressive evaluation needs Batch.row_ids (data.dataset batches)")
        probs = torch.sigmoid(logits.detach().float()).cpu().numpy()  # (B,) a sync point
        self._record(batch, probs, lag=True)

    def hold_scores(self, batch: Batch, probs: np.ndarray) -> None:
        """``probs`` (B,): the rows' scores as they arrive, before any training on
        them; filed once each row is committed (``file_trained``, ``file_dropped``).
        Whether a row holds a new id is decided now, on arrival."""
        if batch.row_ids is None:
            raise ValueError("progressive evaluation needs Batch.row_ids (data.dataset batches)")
        labels = batch.labels.astype(np.int8)
        new = self.seen.new_rows(batch)
        held = self._held_new
        again = None if held is None else np.isin(batch.row_ids, held)
        if again is not None:  # read again after a resume: new as on the first arrival
            new |= again
        self.pending.hold(batch.row_ids, labels, np.asarray(probs, np.float32), new)
        if held is not None and again is not None and again.any():
            # Out of _held_new once held (checkpoint_state reads it first).
            rest = np.setdiff1d(held, batch.row_ids[again], assume_unique=True)
            self._held_new = rest if rest.shape[0] else None

    def file_trained(self, row_ids: Int64Array | None) -> None:
        """The held scores of a step's rows ``row_ids`` (every rank's), with their
        event -> trained lag, once the step is done."""
        if row_ids is None:
            raise ValueError("progressive evaluation needs Batch.row_ids (data.dataset batches)")
        self._file(self.pending.take(row_ids), lag=True)

    def file_dropped(self, row_ids: Int64Array) -> None:
        """The held scores of rows the buffer dropped (no lag: never trained)."""
        self._file(self.pending.take(row_ids), lag=False)

    def _file(self, taken: Taken, lag: bool) -> None:
        if not taken.rows:
            return
        now = self.clock()
        tasks, index = self.progress.row_tasks(taken.row_ids)
        for t, task in enumerate(tasks):
            rows = index == t if len(tasks) > 1 else slice(None)
            self.stats.record(
                (task.start_s, task.end_s),
                [f"{task.stream}/{task.source}"],
                taken.labels[rows],
                taken.probs[rows],
                lag_s=now - task.end_s if lag else None,
            )
        self.stats.record_origin(NEW_IDS, taken.labels[taken.new], taken.probs[taken.new])

    def _record(self, batch: Batch, probs: np.ndarray, lag: bool) -> None:
        assert batch.row_ids is not None
        labels = batch.labels.astype(np.int8)  # (B,)
        now = self.clock()
        tasks, index = self.progress.row_tasks(batch.row_ids)
        for t, task in enumerate(tasks):
            rows = index == t if len(tasks) > 1 else slice(None)
            self.stats.record(
                (task.start_s, task.end_s),
                [f"{task.stream}/{task.source}"],
                labels[rows],
                probs[rows],
                lag_s=now - task.end_s if lag else None,
            )
        new = self.seen.new_rows(batch)
        self.stats.record_origin(NEW_IDS, labels[new], probs[new])


def progressive_for(
    job: JobSpec, feed: Feed, state: LoopState, metrics: TrainingMetrics
) -> ProgressiveEval | None:
    """The run's ``ProgressiveEval`` (rank 0 of a ``train.progressive_eval`` run),
    its figures exported on ``metrics``; ``None`` otherwise.

    Raises:
        ConfigError: ``train.progressive_eval`` without ``data.dataset``.
    """
    if not job.train.progressive_eval:
        return None
    if not isinstance(feed, GraphFeed):
        raise ConfigError(
            "train.progressive_eval", "needs data.dataset (windows come from its task graph)"
        )
    if not state.chief:
        return None
    world = state.world_size
    scope = "all rows" if world == 1 else f"rank 0's share of each step (1 of {world} trainers)"
    stats = ProgressiveStats(scope)
    metrics.registry.register(ProgressiveCollector(stats))
    return ProgressiveEval(feed.progress, stats)


def score_on_arrival(
    feed: Feed, engine: Engine, progressive: ProgressiveEval | None, state: LoopState
) -> bool:
    """With ``train.mixed_buffer`` (rank 0 holds the buffer): each arriving
    batch is scored before the buffer takes it (for ``importance: loss``, and
    for ``progressive`` at arrival, dropped rows included). In sync mode by
    ``engine.predict``, between two steps; in ``hybrid``/``async`` mode rank 0
    reads ahead on the prefetch thread while the step runs, so by an
    ``ArrivalScorer`` (an eval twin bound to the live dense weights, read-only lookups).
    Returns whether progressive scores are filed on arrival (the loop then files
    only the lag of trained steps)."""
    mixed = feed.mixed if isinstance(feed, GraphFeed) else None
    if mixed is None or (progressive is None and not mixed.scores_on_arrival):
        return False
    # sync: between two steps, on the step's thread; else on the read-ahead
    # thread while the step runs, with an eval twin bound to the live weights.
    mixed.scorer = engine.predict if engine.train.mode == "sync" else ArrivalScorer(engine)
    if progressive is not None:
        mixed.on_scored = progressive.hold_scores
        mixed.on_dropped = progressive.file_dropped
        if state.world_size > 1:
            progressive.stats.scope = (
                f"all rows, scored on arrival by rank 0 for {state.world_size} trainers"
            )
    return progressive is not None
