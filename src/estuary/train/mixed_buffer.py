"""A bounded buffer where history and stream rows meet, with row-level priority.

Rows arrive from sources (``offer``) and leave for training (``take``). The
buffer is bounded in bytes; each row gets an **importance** and a **priority**
(docs/mixture.md, "Mixed scheduler")::

    importance_i = w[source_i] * (label_weight if y_i = 1 else 1) * user_i * g_i
        g_i = max(|y_i - p_i|, loss_floor) with ``importance="loss"`` (p_i: the
              model's probability for the row when it arrived, ``offer(scores=)``;
              |y - p| = 1 - exp(-log loss), the size of the log loss's gradient
              in the logit), else 1
    priority_i(t) = importance_i ** gamma * 2 ** (-(t - t_i) / half_life)   t: rows offered
                                                       (gamma = order_by_importance, 0 default)
    fill f = bytes / capacity (before the offer), B = the offered rows' bytes
    keep fraction k = 1 when bytes + B <= high_water * capacity, else
        k = min(1, (capacity - bytes) / B) * sqrt(1 - pressure),
        pressure = max(0, (f - high_water) / (1 - high_water))
    keep q_i = clip(k * importance_i / mean importance, min_keep, 1)
    a kept row's loss weight *= 1 / q_i                       (the loss stays unbiased;
                                  take() scales a batch's weights to mean 1 by default)
    take(n): the n rows of highest priority_i(t), older first among equals

Under a surge (rows offered faster than taken) the fill rises, rows are sampled
down in proportion to their importance, and low-priority rows wait (delayed)
while newer, more important ones are trained. Rows that still do not fit are the
lowest-priority ones in the buffer and are dropped (``evicted``): the buffer
never holds more than ``capacity_bytes``. Policies:

  priority  the above
  uniform   the same pressure, every row kept with probability clip(1 - p,
            min_keep, 1) (weight 1 / q), taken oldest first
  fifo      nothing sampled or dropped: ``offer`` takes only the rows that fit
            and returns how many; the caller keeps the rest (backpressure: its
            backlog, and the rows' lag, grow), taken oldest first

With ``max_age_rows`` a row still waiting once that many rows were offered
after it is dropped (``expired``), at the offer that aged it (before any
eviction) or the next ``take``: a bound on how stale a trained row (and its
1 / q weight) can be. Under fifo the clock counts only the rows admitted, so
rows waiting in the producer's backlog do not age.

Every count is per source: offered, kept, sampled_out, evicted, expired, delayed (rows
passed over by a ``take`` that took a younger row, once per such take), taken; ``stats()`` for a
summary, ``MixedBufferCollector`` for Prometheus.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from estuary.data.types import Batch

__all__ = ["BufferPolicy", "MixedBuffer", "MixedBufferCollector", "row_bytes"]

Policy = Literal["priority", "uniform", "fifo"]
Importance = Literal["none", "loss"]
COUNTS = ("offered", "kept", "sampled_out", "evicted", "expired", "delayed", "taken")


def row_bytes(batch: Batch) -> npt.NDArray[np.int64]:
    """Bytes each row of ``batch`` holds (label, dense, ids, offsets, weight)."""
    n = batch.num_rows
    per_row = np.full(n, 4 + 4 + batch.dense.shape[1] * 4, np.int64)  # label, weight, dense
    for ids in batch.sparse.values():
        per_row += 8 + 8 * np.diff(ids.offsets)  # an offset, then the row's ids
    return per_row


@dataclass(frozen=True)
class BufferPolicy:
    """How the buffer keeps and orders rows (see the module docstring).

    Args:
        capacity_bytes: the most bytes the buffer holds.
        policy: ``priority``, ``uniform`` or ``fifo``.
        source_weights: source -> w (default 1).
        label_weight: importance factor of positive rows.
        half_life_rows: the age (in rows offered since) at which a row's priority halves.
        high_water: the fill level above which rows are sampled down.
        min_keep: the least keep probability (so a weight is at most 1 / min_keep).
        importance: a user function (batch, source) -> float (B,) factors.
        importance_from: ``none``, or ``loss``: each row's importance is also
            ``max(|y - p|, loss_floor)``, p its score at arrival (``offer``'s
            ``scores``): rows the model gets wrong are kept (and, with
            ``order_by_importance``, trained) first, with 1 / q weights.
        shed: ``sample`` (the default): above the high water, rows are sampled
            down at the offer (keep q_i, weight 1 / q_i); ``evict`` (delay
            before drop): every offered row is admitted at weight 1, and only
            when the bytes exceed the capacity are the lowest-priority rows
            (the oldest, and with ``order_by_importance`` the least important)
            dropped, so rows wait for spare steps after a surge.
        loss_floor: the least loss factor (a row the model already gets right
            still has a chance, and a weight of at most 1 / max(loss_floor, min_keep)).
        order_by_importance: gamma, the exponent of importance in the priority
            that orders ``take`` and eviction (0: recency alone, the default:
            ordering by label or source skews what is trained and evicted, a
            bias the weights do not undo).
        normalize_weights: ``take`` scales a batch's weights to mean 1 (the
            step's loss: a self-normalized estimate of the offered rows' mean
            loss, at the configured learning rate); ``False``: the raw 1 / q
            (Horvitz-Thompson: the weighted sum is unbiased for the offered sum,
            but a step of heavily sampled rows weighs up to 1 / min_keep more).
        max_age_rows: a bound on staleness: a row still waiting once this many
            rows were offered after it is dropped unseen (``expired``) instead
            of being trained late; ``None`` (the default): no bound.
        seed: the sampling's random seed.
    """

    capacity_bytes: int
    policy: Policy = "priority"
    source_weights: Mapping[str, float] = field(default_factory=dict)
    label_weight: float = 1.0
    half_life_rows: float = 10_000.0
    high_water: float = 0.5
    min_keep: float = 0.05
    importance: Callable[[Batch, str], np.ndarray] | None = None
    importance_from: Importance = "none"
    loss_floor: float = 0.05
    shed: Literal["sample", "evict"] = "sample"
    normalize_weights: bool = True
    order_by_importance: float = 0.0
    max_age_rows: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes: expected > 0, got {self.capacity_bytes}")
        if self.policy not in ("priority", "uniform", "fifo"):
            raise ValueError(f"policy: expected priority, uniform or fifo, got {self.policy!r}")
        if not 0 <= self.high_water < 1:
            raise ValueError(f"high_water: expected in [0, 1), got {self.high_water}")
        if not 0 < self.min_keep <= 1:
            raise ValueError(f"min_keep: expected in (0, 1], got {self.min_keep}")
        if self.importance_from not in ("none", "loss"):
            raise ValueError(
                f"importance_from: expected none or loss, got {self.importance_from!r}"
            )
        if self.shed not in ("sample", "evict"):
            raise ValueError(f"shed: expected sample or evict, got {self.shed!r}")
        if not 0 < self.loss_floor <= 1:
            raise ValueError(f"loss_floor: expected in (0, 1], got {self.loss_floor}")
        if self.half_life_rows <= 0 or self.label_weight <= 0:
            raise ValueError("half_life_rows and label_weight must be > 0")
        if self.max_age_rows is not None and not self.max_age_rows >= 1:
            raise ValueError(f"max_age_rows: expected >= 1 or None, got {self.max_age_rows}")
        for source, weight in self.source_weights.items():
            if not weight > 0:
                raise ValueError(f"source_weights[{source!r}]: expected > 0, got {weight}")


@dataclass
class _Chunk:
    """Rows of one offered batch still in the buffer."""

    batch: Batch  # weights: the importance weights (1 / q) times the batch's own
    source: str
    seq: npt.NDArray[np.int64]  # (n,) arrival number of each row
    importance: npt.NDArray[np.float64]  # (n,)
    nbytes: npt.NDArray[np.int64]  # (n,)


class MixedBuffer:
    """The bounded, prioritized buffer (module docstring); thread-safe."""

    def __init__(self, policy: BufferPolicy) -> None:
        self.policy = policy
        self._rng = np.random.default_rng(policy.seed)
        self._lock = threading.Lock()
        self._chunks: list[_Chunk] = []
        self._seq = 0  # rows offered so far: the clock of recency
        self._mean_importance = 1.0  # running mean (rows offered)
        self.bytes = 0
        self.peak_bytes = 0
        self.counts: dict[str, dict[str, int]] = {}
        self._dropped: list[npt.NDArray[np.int64]] = []  # row ids sampled out, evicted or expired

    def pop_dropped(self) -> npt.NDArray[np.int64]:
        """The ``row_ids`` of rows sampled out, evicted or expired since the last call
        (rows of batches without ``row_ids`` are counted but not listed), so the
        caller can record them as consumed and dropped."""
        with self._lock:
            dropped, self._dropped = self._dropped, []
        if not dropped:
            return np.zeros(0, np.int64)
        return np.concatenate(dropped).astype(np.int64, copy=False)

    @property
    def fill(self) -> float:
        return self.bytes / self.policy.capacity_bytes

    @property
    def rows(self) -> int:
        return sum(c.batch.num_rows for c in self._chunks)

    def _count(self, source: str, what: str, n: int) -> None:
        counts = self.counts.setdefault(source, dict.fromkeys(COUNTS, 0))
        counts[what] += int(n)

    def _importance(
        self, batch: Batch, source: str, scores: np.ndarray | None
    ) -> npt.NDArray[np.float64]:
        p = self.policy
        imp = np.full(batch.num_rows, p.source_weights.get(source, 1.0), np.float64)
        imp *= np.where(batch.labels > 0.5, p.label_weight, 1.0)
        if p.importance is not None:
            imp *= np.asarray(p.importance(batch, source), np.float64)
        if p.importance_from == "loss":
            assert scores is not None  # offer() checked
            imp *= np.maximum(np.abs(batch.labels - scores), p.loss_floor)
        return imp

    def offer(self, batch: Batch, source: str, scores: np.ndarray | None = None) -> int:
        """Admit ``batch``'s rows from ``source``; returns how many rows the call
        consumed (all of them, except under ``fifo`` when the buffer is full:
        then the first rows that fit, and the caller offers the rest later).

        Args:
            scores: (B,) the model's click probabilities for the rows as they
                arrive (required by ``importance_from="loss"``, else unused).

        Raises:
            ValueError: ``importance_from="loss"`` without ``scores`` of (B,).
        """
        if self.policy.importance_from == "loss" and self.policy.policy != "fifo":
            if scores is None or np.shape(scores) != (batch.num_rows,):
                got = None if scores is None else np.shape(scores)
                raise ValueError(
                    f"importance_from='loss' needs offer(scores=) of shape "
                    f"({batch.num_rows},), got {got}"
                )
            scores = np.asarray(scores, np.float64)
        with self._lock:
            n = batch.num_rows
            nbytes = row_bytes(batch)
            p = self.policy
            if p.policy == "fifo":
                free = p.capacity_bytes - self.bytes
                fit = int(np.searchsorted(np.cumsum(nbytes), free, side="right"))
                if fit:
                    self._admit(batch.slice(0, fit), source, nbytes[:fit], np.ones(fit))
                    self._count(source, "offered", fit)
                    self._count(source, "kept", fit)
                self.peak_bytes = max(self.peak_bytes, self.bytes)
                return fit
            self._count(source, "offered", n)
            imp = self._importance(batch, source, scores)
            self._mean_importance += (imp.mean() - self._mean_importance) * min(1.0, n / 1000)
            k = 1.0 if p.shed == "evict" else self._keep_fraction(int(nbytes.sum()))
            if k >= 1:
                q = np.ones(n)
            elif p.policy == "uniform":
                q = np.full(n, max(k, p.min_keep))
            else:
                q = np.clip(k * imp / self._mean_importance, p.min_keep, 1.0)
            keep = self._rng.random(n) < q
            self._count(source, "sampled_out", n - int(keep.sum()))
            if batch.row_ids is not None and not keep.all():
                self._dropped.append(batch.row_ids[~keep])
            rows = np.flatnonzero(keep).astype(np.int64)
            if rows.size:
                kept = batch.take(rows)
                own = kept.weights if kept.weights is not None else 1.0
                weights = (own / q[rows]).astype(np.float32)
                kept = Batch(
                    kept.labels, kept.dense, kept.sparse, kept.row_ids, kept.origin, weights
                )
                self._admit(kept, source, nbytes[rows], imp[rows], at=rows)
                self._count(source, "kept", rows.size)
            self._seq += n  # every offered row ages the clock, sampled out or not
            self._expire()  # rows the offer aged past the bound leave before evicting
            self._evict()  # the offered batch is the caller's until then
            self.peak_bytes = max(self.peak_bytes, self.bytes)
            return n

    def _keep_fraction(self, incoming: int) -> float:
        """k: 1 while the buffer with the offered rows stays under the high water;
        above it, the share of the rows that fits the room left below the
        capacity, shrunk by the pressure of the fill (module docstring)."""
        p = self.policy
        cap = p.capacity_bytes
        if self.bytes + incoming <= p.high_water * cap:
            return 1.0
        pressure = max(0.0, (self.bytes / cap - p.high_water) / (1 - p.high_water))
        room = max(0, cap - self.bytes)
        return min(1.0, room / max(1, incoming)) * (1 - pressure) ** 0.5

    def _admit(
        self,
        batch: Batch,
        source: str,
        nbytes: npt.NDArray[np.int64],
        imp: np.ndarray,
        at: npt.NDArray[np.int64] | None = None,
    ) -> None:
        """Hold ``batch``'s rows; ``at``: their positions among the rows just
        offered (the caller then advances the clock past the offer), else they
        are the next rows of the clock."""
        n = batch.num_rows
        if at is None:
            seq = np.arange(self._seq, self._seq + n, dtype=np.int64)
            self._seq += n
        else:
            seq = self._seq + at.astype(np.int64)
        self._chunks.append(_Chunk(batch, source, seq, np.asarray(imp, np.float64), nbytes))
        self.bytes += int(nbytes.sum())

    def _priorities(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """All rows: (chunk index, row in chunk, priority now, arrival number)."""
        which = np.concatenate([np.full(c.seq.size, i) for i, c in enumerate(self._chunks)])
        row = np.concatenate([np.arange(c.seq.size) for c in self._chunks])
        seq = np.concatenate([c.seq for c in self._chunks])
        imp = np.concatenate([c.importance for c in self._chunks])
        if self.policy.policy == "priority":
            age = (self._seq - seq).astype(np.float64)
            prio = imp**self.policy.order_by_importance * np.exp2(-age / self.policy.half_life_rows)
        else:
            prio = -seq.astype(np.float64)  # oldest first
        return which, row, prio, seq

    def _evict(self) -> None:
        """Drop the lowest-priority rows until the bytes fit the capacity."""
        over = self.bytes - self.policy.capacity_bytes
        if over <= 0:
            return
        which, row, prio, seq = self._priorities()
        nbytes = np.concatenate([c.nbytes for c in self._chunks])
        order = np.lexsort((-seq, prio))  # lowest priority first, then newest
        cut = int(np.searchsorted(np.cumsum(nbytes[order]), over, side="left")) + 1
        self._drop(which[order[:cut]], row[order[:cut]], "evicted")

    def _expire(self) -> None:
        """Drop the rows older than ``max_age_rows`` (rows offered since)."""
        limit = self.policy.max_age_rows
        if limit is None or not any(self._seq - c.seq[0] > limit for c in self._chunks):
            return  # a chunk's first row is its oldest
        which, row, _, seq = self._priorities()
        old = self._seq - seq > limit
        if old.any():
            self._drop(which[old], row[old], "expired")

    def _drop(self, which: np.ndarray, row: np.ndarray, count: str) -> None:
        """Remove rows (chunk, row) unseen, counted ``count``, for ``pop_dropped``."""
        for part in self._remove(which, row, count):
            if part.row_ids is not None:
                self._dropped.append(part.row_ids)

    def _remove(self, which: np.ndarray, row: np.ndarray, count: str) -> list[Batch]:
        """Take rows (chunk, row) out; returns the removed rows per chunk."""
        out: list[Batch] = []
        keep_chunks: list[_Chunk] = []
        for i, chunk in enumerate(self._chunks):
            mine = np.sort(row[which == i])
            if mine.size == 0:
                keep_chunks.append(chunk)
                continue
            out.append(chunk.batch.take(mine))
            self._count(chunk.source, count, mine.size)
            self.bytes -= int(chunk.nbytes[mine].sum())
            rest = np.setdiff1d(np.arange(chunk.seq.size), mine)
            if rest.size:
                keep_chunks.append(
                    _Chunk(
                        chunk.batch.take(rest),
                        chunk.source,
                        chunk.seq[rest],
                        chunk.importance[rest],
                        chunk.nbytes[rest],
                    )
                )
        self._chunks = keep_chunks
        return out

    def take(self, n: int) -> Batch | None:
        """Up to ``n`` rows for one training step, highest priority first (see
        the policy); their ``weights`` are the importance weights. ``None``
        when empty. The batch's origin is its rows' source when they share one."""
        with self._lock:
            self._expire()
            if not self._chunks:
                return None
            which, row, prio, seq = self._priorities()
            order = np.lexsort((seq, -prio))[:n]  # highest priority, then oldest
            youngest = seq[order].max()
            passed = np.setdiff1d(np.flatnonzero(seq < youngest), order)
            for i in np.unique(which[passed]):  # older rows left waiting: delayed
                self._count(self._chunks[i].source, "delayed", int((which[passed] == i).sum()))
            sources = {self._chunks[i].source for i in np.unique(which[order])}
            parts = self._remove(which[order], row[order], "taken")
            batch = Batch.concatenate(parts)
            weights = np.concatenate(
                [p.weights if p.weights is not None else np.ones(p.num_rows) for p in parts]
            ).astype(np.float32)
            if self.policy.normalize_weights:
                weights /= weights.mean()
            origin = next(iter(sources)) if len(sources) == 1 else None
            row_ids = None  # kept when every part has them (e.g. arrival times)
            if all(p.row_ids is not None for p in parts):
                row_ids = np.concatenate([p.row_ids for p in parts])
            return Batch(batch.labels, batch.dense, batch.sparse, row_ids, origin, weights)

    def stats(self) -> dict[str, Any]:
        """For a summary: per-source counts, bytes now and at the peak, capacity."""
        with self._lock:
            return {
                "policy": self.policy.policy,
                "capacity_bytes": self.policy.capacity_bytes,
                "bytes": self.bytes,
                "peak_bytes": self.peak_bytes,
                "rows": self.rows,
                "sources": {s: dict(c) for s, c in sorted(self.counts.items())},
            }


class MixedBufferCollector(Collector):
    """Prometheus figures of a ``MixedBuffer``: ``estuary_mixed_rows_total{source,
    what}`` (what: offered, kept, sampled_out, evicted, expired, delayed, taken) and
    ``estuary_mixed_buffer_bytes{kind}`` (now, peak, capacity)."""

    def __init__(self, buffer: MixedBuffer) -> None:
        self.buffer = buffer

    def collect(self) -> Iterator[Metric]:
        stats = self.buffer.stats()
        rows = CounterMetricFamily(
            "estuary_mixed_rows",
            "Rows through the mixed buffer, per source and fate.",
            labels=["source", "what"],
        )
        for source, counts in stats["sources"].items():
            for what, n in counts.items():
                rows.add_metric([source, what], n)
        yield rows
        size = GaugeMetricFamily(
            "estuary_mixed_buffer_bytes", "Bytes in the mixed buffer.", labels=["kind"]
        )
        for kind, key in (("now", "bytes"), ("peak", "peak_bytes"), ("capacity", "capacity_bytes")):
            size.add_metric([kind], stats[key])
        yield size
