"""Embedding table settings: initializer, sparse optimizer, admission, eviction,
and ``TableSpec`` (one table's settings, resolved once at load by ``merge_table``
from ``model.embedding.default`` and the table's override).

Part of the typed job spec (``estuary.config.spec`` re-exports every name).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from estuary.config.build import (
    REST,
    build_dataclass,
    deep_merge,
    describe_value,
    foreign_key,
    plain,
)
from estuary.config.errors import ConfigError
from estuary.plugins import INITIALIZERS, OPTIMIZERS

__all__ = [
    "AdmissionSpec",
    "DiskSpec",
    "EvictionSpec",
    "InitializerName",
    "InitializerSpec",
    "OptimizerName",
    "PoolingName",
    "RowDtype",
    "SparseOptimizerSpec",
    "TableSpec",
    "merge_table",
    "optimizer_parameters",
]

# The built-in names of plugin kinds. A job file may name any registered
# implementation (``estuary.plugins``): these fields are typed ``str`` and checked
# against the registry at load.
InitializerName = Literal["uniform", "normal", "truncated_normal", "zeros"]
OptimizerName = Literal[
    "sgd", "adagrad", "adam", "ftrl", "rowwise_adagrad", "rowwise_adagrad_elem", "rowwise_adam"
]
PoolingName = Literal["sum", "mean", "none"]
# How a table stores its weights (optimizer state is always float32).
RowDtype = Literal["fp32", "fp16", "bf16"]


@dataclass(frozen=True)
class InitializerSpec:
    """How new embedding rows are filled.

    Args:
        name: ``uniform`` (in ``[-scale, scale]``), ``normal`` / ``truncated_normal``
            (mean 0, std ``scale``; truncated at 2 std), ``zeros``, or another
            registered initializer (``register_initializer``).
        scale: bound (uniform) or standard deviation (normal). ``None`` means
            ``1 / sqrt(dim)``.
    """

    name: str = "uniform"
    scale: float | None = None

    def validate(self, path: str) -> None:
        INITIALIZERS.check(self.name, f"{path}.name")
        if self.scale is not None and self.scale < 0:
            raise ConfigError(f"{path}.scale", "must be >= 0")


@dataclass(frozen=True)
class SparseOptimizerSpec:
    """Row-wise optimizer applied inside the embedding table.

    The section is flat in the job file; each optimizer declares which
    parameters it reads (``SparseOptimizer.params_type`` in the embedding layer),
    and setting another one (``beta1`` for ``adagrad``) is an error at load. A
    plugin optimizer may declare parameters of its own (Lion's ``beta``): the
    section's keys that are not fields here are kept in ``extra`` and checked,
    typed, against the named optimizer's declaration (which imports it).

    Args:
        name: ``sgd``, ``adagrad``, ``adam``, ``ftrl``, ``rowwise_adagrad``,
            ``rowwise_adagrad_elem``, ``rowwise_adam``, or another registered optimizer
            (``register_optimizer``).
        lr: learning rate (> 0).
        eps: numerical floor in the denominator (adagrad, adam and their row-wise forms).
        initial_accumulator: starting value of the squared-gradient sum (adagrad,
            rowwise_adagrad, rowwise_adagrad_elem, ftrl).
        beta1: adam (and rowwise_adam) first-moment decay.
        beta2: adam (and rowwise_adam) second-moment decay.
        l1: ftrl L1 strength.
        l2: ftrl L2 strength.
        lr_power: ftrl learning-rate power (usually -0.5).
        weight_decay: decoupled L2 decay applied to touched rows, per step.
        clip: if set, row values are clipped to ``[-clip, clip]`` after each update.
        extra: the parameters a plugin optimizer declares beyond these, by name
            (flat keys of the section in the job file).
    """

    name: str = "adagrad"
    lr: float = 0.05
    eps: float = 1e-8
    initial_accumulator: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    l1: float = 0.0
    l2: float = 0.0
    lr_power: float = -0.5
    weight_decay: float = 0.0
    clip: float | None = None
    extra: dict[str, Any] = field(
        default_factory=dict, metadata={REST: (), "yaml": False}, hash=False
    )

    def validate(self, path: str) -> None:
        OPTIMIZERS.check(self.name, f"{path}.name")
        changed = [
            f.name
            for f in dataclasses.fields(self)
            if f.name not in (*_EVERY_OPTIMIZER_READS, "extra")
            and getattr(self, f.name) != f.default
        ]
        changed.extend(self.extra)
        # Only a section that sets an optimizer-specific parameter needs the
        # optimizer's own list (which imports its numba implementation).
        own = optimizer_parameters(self.name) if changed else ()
        for name in changed:
            if name not in own:
                # Only a key the section does not know at all may be a typo.
                near = [*_SECTION_KEYS, *own] if name in self.extra else []
                owner = f"optimizer {self.name!r}"
                raise foreign_key(path, name, own, "parameter", owner, near=near)
        if self.extra:  # typed by the optimizer's declaration, with its own checks
            OPTIMIZERS.get(self.name).params_type.from_spec(self, path)
        if self.lr <= 0:
            raise ConfigError(f"{path}.lr", "must be > 0")
        if self.eps <= 0:
            raise ConfigError(f"{path}.eps", "must be > 0")
        if self.initial_accumulator < 0:
            raise ConfigError(f"{path}.initial_accumulator", "must be >= 0")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"{path}.{name}", "must be in [0, 1)")
        for name in ("l1", "l2", "weight_decay"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{path}.{name}", "must be >= 0")
        if self.clip is not None and self.clip <= 0:
            raise ConfigError(f"{path}.clip", "must be > 0")


@dataclass(frozen=True)
class AdmissionSpec:
    """When an id earns its own row.

    Args:
        min_count: an id gets a row once it has been seen this many times in
            training batches (1 = admit at first sight). Until then it reads the
            table's shared ``unknown`` row and its gradient trains that row.
        probability: admit a new id with this probability per sighting (1.0 = always).
        max_pending_ids: per-shard bound on ids counted while not yet admitted.
            ``exact``: 16 B each (24-34 B with the table's slack); when full,
            every count is halved (rare ids drop out). ``sketch``: the largest
            sketch layer is sized for this many ids (two layers of about
            ``sketch_hashes / ln 2`` counters per id at most).
        counter: how sightings are counted: ``sketch`` (approximate, a few bits
            per id: a two-generation count-min sketch; a never-seen id is falsely
            admitted with a small probability, about 2% at the default
            ``sketch_hashes``) or ``exact`` (an id -> count table, 16 B+ per id;
            see ``estuary.embedding.admission_sketch``).
        sketch_hashes: counters per id in the sketch (1-7): more lowers false
            admissions (about ``0.5 ** sketch_hashes`` per layer) and costs
            proportionally more bits per id.
    """

    min_count: int = 1
    probability: float = 1.0
    max_pending_ids: int = 1 << 20
    counter: Literal["sketch", "exact"] = "sketch"
    sketch_hashes: int = 6

    def validate(self, path: str) -> None:
        if self.min_count < 1:
            raise ConfigError(f"{path}.min_count", "must be >= 1")
        if not 0.0 < self.probability <= 1.0:
            raise ConfigError(f"{path}.probability", "must be in (0, 1]")
        if self.max_pending_ids < 1:
            raise ConfigError(f"{path}.max_pending_ids", "must be >= 1")
        if not 1 <= self.sketch_hashes <= 7:
            raise ConfigError(f"{path}.sketch_hashes", "must be in [1, 7]")
        if self.counter == "sketch" and self.min_count > 256:
            raise ConfigError(
                f"{path}.min_count", "the sketch counts to 256: use counter: exact above that"
            )


@dataclass(frozen=True)
class EvictionSpec:
    """Bounds on a table's memory.

    Args:
        capacity_rows: maximum rows held; ``None`` = unbounded. A table of S
            shards gives each shard ``ceil(capacity_rows / S)``.
        policy: which rows go first when full: ``lru`` (least recently touched)
            or ``lfu`` (least often touched, counts halved as they age).
        ttl_steps: rows untouched for this many training steps are swept (a step
            is one ``apply_gradients`` call).
        ttl_s: rows untouched for this many seconds are swept.
        sweep_every_steps: TTL sweeps run automatically every this many steps
            (one pass over the rows); rows may outlive their TTL by up to this
            many steps. ``sweep()`` applies the TTL at once.
    """

    capacity_rows: int | None = None
    policy: Literal["lru", "lfu"] = "lru"
    ttl_steps: int | None = None
    ttl_s: float | None = None
    sweep_every_steps: int = 100

    def validate(self, path: str) -> None:
        if self.capacity_rows is not None and self.capacity_rows < 1:
            raise ConfigError(f"{path}.capacity_rows", "must be >= 1")
        if self.ttl_steps is not None and self.ttl_steps < 1:
            raise ConfigError(f"{path}.ttl_steps", "must be >= 1")
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise ConfigError(f"{path}.ttl_s", "must be > 0")
        if self.sweep_every_steps < 1:
            raise ConfigError(f"{path}.sweep_every_steps", "must be >= 1")


@dataclass(frozen=True)
class DiskSpec:
    """A memory budget with a disk tier (``estuary.embedding.disk_tier``).

    Args:
        memory_bytes: bytes of rows (with their index entry and metadata) the
            table keeps in memory, split evenly over its shards; rows evicted
            for room (least recently used) move to memory-mapped files and come
            back on their next training access. ``None`` = all rows in memory.
        path: folder for the files (each shard makes its own temporary folder in
            it, removed when the table goes); ``None`` = the system's temporary
            folder.
    """

    memory_bytes: int | None = None
    path: str | None = None

    def validate(self, path: str) -> None:
        if self.memory_bytes is not None and self.memory_bytes < 4096:
            raise ConfigError(f"{path}.memory_bytes", "must be >= 4096 (or null: no disk tier)")


@dataclass(frozen=True)
class TableSpec:
    """One embedding table. ``model.embedding.default`` gives every field's default;
    ``model.embedding.tables.<feature>`` overrides fields for one feature.

    Args:
        dim: embedding width D (> 0).
        initializer: how new rows are filled.
        optimizer: row-wise sparse optimizer.
        pooling: how a multi-id bag becomes one vector: ``sum``, ``mean`` or
            ``none`` (unpooled sequence output).
        admission: when an id gets its own row.
        eviction: capacity and TTL bounds.
        shards: number of hash shards the table is split into.
        initial_capacity_rows: rows pre-allocated; the table grows beyond it.
        dtype: how the weights are stored: ``fp32``, or ``fp16`` / ``bf16`` (half
            the bytes; updates computed in float32 and stochastically rounded on
            write, lookups return float32). Optimizer state stays float32.
        disk: a memory budget with a disk tier for the rows beyond it.
    """

    dim: int = 16
    initializer: InitializerSpec = field(default_factory=InitializerSpec)
    optimizer: SparseOptimizerSpec = field(default_factory=SparseOptimizerSpec)
    pooling: PoolingName = "sum"
    admission: AdmissionSpec = field(default_factory=AdmissionSpec)
    eviction: EvictionSpec = field(default_factory=EvictionSpec)
    shards: int = 1
    initial_capacity_rows: int = 64
    dtype: RowDtype = "fp32"
    disk: DiskSpec = field(default_factory=DiskSpec)

    def validate(self, path: str) -> None:
        if self.dim < 1:
            raise ConfigError(f"{path}.dim", "must be > 0")
        if self.shards < 1:
            raise ConfigError(f"{path}.shards", "must be >= 1")
        if self.initial_capacity_rows < 1:
            raise ConfigError(f"{path}.initial_capacity_rows", "must be >= 1")
        self.initializer.validate(f"{path}.initializer")
        self.optimizer.validate(f"{path}.optimizer")
        self.admission.validate(f"{path}.admission")
        self.eviction.validate(f"{path}.eviction")
        self.disk.validate(f"{path}.disk")
        ev = self.eviction
        if self.disk.memory_bytes is not None and (
            ev.capacity_rows is not None or ev.ttl_steps is not None or ev.ttl_s is not None
        ):
            raise ConfigError(
                f"{path}.disk.memory_bytes",
                "a disk tier keeps every row: it cannot be combined with eviction "
                "(capacity_rows, ttl_steps, ttl_s)",
            )


def merge_table(default: TableSpec, override: Mapping[str, Any], path: str) -> TableSpec:
    """One table's settings: a partial table dict merged over ``default``.

    Nested sections merge field by field, so ``{"optimizer": {"lr": 0.1}}`` keeps
    the default optimizer's name and other settings.

    Args:
        default: ``model.embedding.default``.
        override: the table's entry in ``model.embedding.tables`` (may be empty).
        path: dotted path of the entry, e.g. ``model.embedding.tables.C1``.

    Raises:
        ConfigError: naming the field path inside ``path``.
    """
    if not isinstance(override, Mapping):
        raise ConfigError(path, f"expected mapping, got {describe_value(override)}")
    merged = deep_merge(plain(default), override)
    optimizer = override.get("optimizer")
    if isinstance(optimizer, Mapping) and isinstance(merged.get("optimizer"), dict):
        _keep_own_parameters(merged["optimizer"], optimizer, default.optimizer.name)
    return build_dataclass(TableSpec, merged, path)


_EVERY_OPTIMIZER_READS = ("name", "lr", "weight_decay", "clip")  # SGDParams, the base of all
_SECTION_KEYS = tuple(f.name for f in dataclasses.fields(SparseOptimizerSpec) if f.name != "extra")


def optimizer_parameters(name: str) -> tuple[str, ...]:
    """The ``optimizer`` parameters the registered sparse optimizer ``name`` reads
    (imports its implementation)."""
    own: tuple[str, ...] = OPTIMIZERS.get(name).parameters()
    return own


def _keep_own_parameters(
    merged: dict[str, Any], override: Mapping[str, Any], default_name: str
) -> None:
    """A table that switches optimizer keeps only the default section's parameters
    the new one reads (``lr`` carries over; adagrad's ``initial_accumulator`` does
    not reach an ``sgd`` table); the others return to their defaults. Parameters
    the override sets itself are kept and checked."""
    name = override.get("name", default_name)
    if name == default_name or not isinstance(name, str) or name not in OPTIMIZERS:
        return
    own = optimizer_parameters(name)
    fresh = plain(SparseOptimizerSpec())
    for key in list(merged):
        if key != "name" and key not in own and key not in override:
            if key in fresh:
                merged[key] = fresh[key]
            else:  # a plugin optimizer's own parameter, unknown to the new one
                del merged[key]
