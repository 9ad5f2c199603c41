"""``train.mixed_buffer``: the bounded buffer where a ``data.dataset`` job's
history and stream rows meet before training (``estuary.train.mixed_buffer``,
docs/mixture.md "Mixed buffer and priority")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from estuary.config.errors import ConfigError

if TYPE_CHECKING:
    from estuary.config.spec import JobSpec

__all__ = [
    "MixedBufferSpec",
    "check_max_age",
    "check_mixed_buffer",
    "live_origins",
    "min_row_bytes",
]

# Rows that must fit: the rows waiting for a step and the rows of the next offer.
STEPS_HELD = 2


@dataclass(frozen=True)
class MixedBufferSpec:
    """Settings of the mixed buffer (``BufferPolicy`` names them the same).

    Args:
        capacity_bytes: the most bytes of rows the buffer holds (required).
        policy: ``priority`` (sample down by importance, train the newest first),
            ``uniform`` (sample down uniformly, oldest first) or ``fifo`` (no
            sampling: the reader waits while the buffer is full).
        offer_per_take: rows offered to the buffer per row trained (>= 1): 1
            trains at the pace the data arrives; 10 replays the data at ten times
            the training rate (a surge), so the buffer sheds rows.
        source_weights: stream name (or ``stream/source``) -> importance factor.
        label_weight: importance factor of positive rows.
        half_life_rows: rows offered after which a row's priority halves.
        high_water: fill level above which rows are sampled down.
        min_keep: the least keep probability (an importance weight is <= 1 / min_keep).
        normalize_weights: scale each step's importance weights to mean 1.
        order_by_importance: exponent of importance in the take/evict order.
        importance: ``none``, or ``loss``: each offered row is scored by the
            model as it arrives (rank 0 scores every rank's rows) and its importance is
            also ``max(|y - p|, loss_floor)`` (rows the model gets wrong are
            kept first, with 1 / q weights).
        loss_floor: the least loss factor (in (0, 1]).
        shed: ``sample`` (sample rows down above the high water) or ``evict``
            (delay before drop: admit every row, evict the lowest-priority rows
            only when over the capacity).
        max_age_rows: drop a row still waiting once this many rows were offered
            after it (``expired``), instead of training it late; ``null``: no bound.
        live: ``paced`` (every row is read at the pace of training, so a live
            surge waits in its broker) or ``arrival`` (a reader drains the live
            sources, ``type: stream``, as their rows arrive and the buffer gets
            them between steps, so a live surge is shed by the policy; file
            sources stay paced by training). ``arrival`` needs a live source and
            ``offer_per_take: 1``.
    """

    capacity_bytes: int
    policy: Literal["priority", "uniform", "fifo"] = "priority"
    offer_per_take: float = 1.0
    source_weights: dict[str, float] = field(default_factory=dict)
    label_weight: float = 1.0
    half_life_rows: float = 10_000.0
    high_water: float = 0.5
    min_keep: float = 0.05
    normalize_weights: bool = True
    order_by_importance: float = 0.0
    importance: Literal["none", "loss"] = "none"
    loss_floor: float = 0.05
    shed: Literal["sample", "evict"] = "sample"
    max_age_rows: float | None = None
    live: Literal["paced", "arrival"] = "paced"

    def validate(self, path: str) -> None:
        if self.capacity_bytes < 1:
            raise ConfigError(f"{path}.capacity_bytes", "must be > 0")
        if self.offer_per_take < 1:
            raise ConfigError(f"{path}.offer_per_take", "must be >= 1")
        for name, weight in self.source_weights.items():
            if not weight > 0:
                raise ConfigError(f"{path}.source_weights.{name}", "must be > 0")
        for name in ("label_weight", "half_life_rows"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{path}.{name}", "must be > 0")
        if not 0 <= self.high_water < 1:
            raise ConfigError(f"{path}.high_water", "must be in [0, 1)")
        if not 0 < self.min_keep <= 1:
            raise ConfigError(f"{path}.min_keep", "must be in (0, 1]")
        if self.order_by_importance < 0:
            raise ConfigError(f"{path}.order_by_importance", "must be >= 0")
        if self.importance not in ("none", "loss"):
            raise ConfigError(
                f"{path}.importance", f"expected none or loss, got {self.importance!r}"
            )
        if not 0 < self.loss_floor <= 1:
            raise ConfigError(f"{path}.loss_floor", "must be in (0, 1]")
        if self.shed not in ("sample", "evict"):
            raise ConfigError(f"{path}.shed", f"expected sample or evict, got {self.shed!r}")
        if self.max_age_rows is not None and not self.max_age_rows >= 1:
            raise ConfigError(f"{path}.max_age_rows", "must be >= 1 (or null: no bound)")
        if self.live not in ("paced", "arrival"):
            raise ConfigError(f"{path}.live", f"expected paced or arrival, got {self.live!r}")
        if self.live == "arrival" and self.offer_per_take != 1:
            raise ConfigError(
                f"{path}.offer_per_take",
                f"is {self.offer_per_take} with live: arrival, which offers live rows as "
                "they arrive and file rows at the pace of training; set it to 1",
            )


def min_row_bytes(job: JobSpec) -> int:
    """The bytes a typical row of ``job`` takes in the buffer (``row_bytes``):
    label and weight, the dense values, and per sparse feature an offset and one
    id (the capacity check's unit; a row with more ids takes more)."""
    schema = job.data.schema
    features = len(schema.sparse) + len(schema.features)
    return 4 + 4 + 4 * len(schema.dense) + 16 * features


def live_origins(job: JobSpec) -> frozenset[str]:
    """The batch origins (``stream/source``) of ``job``'s live sources (``type:
    stream``); empty without ``data.dataset``."""
    dataset = job.data.dataset
    if dataset is None:
        return frozenset()
    return frozenset(
        f"{name}/{source.name}"
        for name, stream in dataset.streams.items()
        for source in stream.sources
        if source.type == "stream"
    )


def check_max_age(spec: MixedBufferSpec, step_rows: int) -> None:
    """``max_age_rows`` must outlast one step's offers (``offer_per_take`` x the
    step's rows, all trainers'), else every step expires rows with no surge.

    Raises:
        ConfigError: names ``train.mixed_buffer.max_age_rows`` and the least value.
    """
    least = spec.offer_per_take * step_rows
    if spec.max_age_rows is not None and spec.max_age_rows < least:
        raise ConfigError(
            "train.mixed_buffer.max_age_rows",
            f"{spec.max_age_rows:g} rows is less than one step's offers "
            f"(offer_per_take {spec.offer_per_take:g} x {step_rows} rows a step), so "
            f"every step would expire rows; set it to at least {least:g} (or null)",
        )


def check_mixed_buffer(job: JobSpec) -> None:
    """The job-level checks of ``train.mixed_buffer`` (and ``train.continuous``).

    Raises:
        ConfigError: ``train.continuous`` or ``train.mixed_buffer`` set without
            ``data.dataset``, with direct data delivery from data executors,
            ``live: arrival`` without a live source, or a capacity that cannot
            hold two steps of rows (``train.batch_size`` each).
    """
    if job.train.continuous and job.data.dataset is None:
        raise ConfigError(
            "train.continuous", "needs a data.dataset job (a history and live streams)"
        )
    spec = job.train.mixed_buffer
    if spec is None:
        return
    if job.data.dataset is None:
        raise ConfigError(
            "train.mixed_buffer", "needs a data.dataset job (history and stream streams)"
        )
    if job.runtime.data_executors > 0 and job.runtime.ray.data_delivery == "direct":
        raise ConfigError(
            "runtime.ray.data_delivery",
            "direct delivery sends trainers row ids, not rows, through rank 0, and "
            "train.mixed_buffer ranks rows by their content there; set it to rank0 "
            "or auto (rank0 for a mixed buffer)",
        )
    if spec.live == "arrival" and not live_origins(job):
        raise ConfigError(
            "train.mixed_buffer.live",
            "is arrival, but data.dataset has no live source (type: stream) to read "
            "as it arrives; use paced",
        )
    check_max_age(spec, job.train.batch_size)
    per_row = min_row_bytes(job)
    need = STEPS_HELD * job.train.batch_size * per_row
    if spec.capacity_bytes < need:
        raise ConfigError(
            "train.mixed_buffer.capacity_bytes",
            f"{spec.capacity_bytes} bytes cannot hold {STEPS_HELD} steps of "
            f"train.batch_size={job.train.batch_size} rows of {per_row} bytes "
            f"each (label, weight, {len(job.data.schema.dense)} dense, one id per sparse "
            f"feature); set it to at least {need}",
        )
