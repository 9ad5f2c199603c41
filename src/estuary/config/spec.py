"""Typed job specification.

Every section of a job file maps to one frozen dataclass below (the embedding
table sections in ``estuary.config.tables``, re-exported here). The loader in
``estuary.config.loader`` builds them from YAML/dicts by reading the type hints,
so a field added here is automatically validated (type, unknown keys) and must be
documented in ``docs/job-spec.md``. Range checks live in each class's
``validate()``, which raises ``ConfigError`` with the dotted field path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from estuary.config.dataset import DatasetSpec
from estuary.config.errors import ConfigError
from estuary.config.features import FeatureSpec
from estuary.config.mixed_buffer import MixedBufferSpec
from estuary.config.roles import ROLES, RolePlan, RolesSpec, normalise_roles
from estuary.config.scaling import ScalingSpec
from estuary.config.tables import (
    AdmissionSpec,
    DiskSpec,
    EvictionSpec,
    InitializerName,
    InitializerSpec,
    OptimizerName,
    PoolingName,
    RowDtype,
    SparseOptimizerSpec,
    TableSpec,
    merge_table,
    optimizer_parameters,
)
from estuary.plugins import (
    DENSE_OPTIMIZERS,
    FORMATS,
    MODELS,
    RUNTIMES,
)

# The built-in names of plugin kinds. A job file may name any registered
# implementation (``estuary.plugins``): these fields are typed ``str`` and checked
# against the registry at load.
__all__ = [
    "AdmissionSpec",
    "DataSpec",
    "DenseOptimizerSpec",
    "DiskSpec",
    "EmbeddingSpec",
    "EvictionSpec",
    "FormatName",
    "InitializerName",
    "InitializerSpec",
    "JobSpec",
    "ModelSpec",
    "OptimizerName",
    "OutputSpec",
    "PoolingName",
    "RaySpec",
    "RoleResources",
    "RowDtype",
    "RuntimeSpec",
    "SchemaSpec",
    "SourceSpec",
    "SparseOptimizerSpec",
    "TableSpec",
    "TrainMode",
    "TrainSpec",
    "merge_table",
    "optimizer_parameters",
]

FormatName = Literal["criteo_tsv", "csv", "tsv", "parquet", "jsonl"]
TrainMode = Literal["sync", "hybrid", "async"]


@dataclass(frozen=True)
class EmbeddingSpec:
    """Embedding configuration for all sparse features.

    Args:
        default: table settings used by every sparse feature.
        tables: per-feature overrides, keyed by sparse feature name; each value is
            a partial table section merged over ``default``.
        shared: groups of features that read one shared table, e.g.
            ``{ids: [user_id, clicked_user_id]}``; the table is named by the key.
    """

    default: TableSpec = field(default_factory=TableSpec)
    tables: dict[str, dict[str, Any]] = field(default_factory=dict)
    shared: dict[str, list[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelSpec:
    """The network.

    Args:
        type: registered model name (``dlrm``, ``deepfm``, ``dcnv2``, ``logreg``,
            or one added with ``register_model``).
        params: keyword arguments for that model's constructor (see docs/job-spec.md).
        embedding: sparse tables.
    """

    type: str = "dlrm"
    params: dict[str, Any] = field(default_factory=dict)
    embedding: EmbeddingSpec = field(default_factory=EmbeddingSpec)

    def validate(self, path: str) -> None:
        MODELS.check(self.type, f"{path}.type")


@dataclass(frozen=True)
class SourceSpec:
    """One input file (or glob of files).

    Args:
        path: file path or glob; relative paths resolve against the job file.
        format: ``criteo_tsv`` (40 tab-separated columns, no header), ``csv``/``tsv``
            (with a header row), ``parquet`` (columns by name; "line" = row number)
            or ``jsonl`` (one JSON object per line, keys = columns), or another
            registered format (``register_format``). See docs/data.md.
        columns: column names for header-less formats; ``criteo_tsv`` defaults to
            ``label, I1..I13, C1..C26``.
        compression: ``auto`` (by file suffix), ``none``, ``gzip`` or ``zstd``.
    """

    path: str
    format: str = "criteo_tsv"
    columns: list[str] | None = None
    compression: Literal["auto", "none", "gzip", "zstd"] = "auto"

    def validate(self, path: str) -> None:
        FORMATS.check(self.format, f"{path}.format")


@dataclass(frozen=True)
class SchemaSpec:
    """Maps columns to roles.

    Args:
        label: name of the 0/1 label column.
        dense: numeric columns, in model order. Missing values become 0; values
            are transformed by ``dense_transform``.
        sparse: categorical columns, in model order; each becomes one id per row.
        dense_transform: ``log1p`` (``sign(x) * log(1 + |x|)``, for counts) or ``none``.
        transforms: per-column value transforms applied before hashing, e.g.
            ``{hour: hour_of_day}``. Registered names: ``hour_of_day``
            (``YYMMDDHH`` -> ``HH``), ``day_of_week``, ``identity``.
        features: derived sparse features (cross, bucketize, modulo, sequence,
            transform), appended after ``sparse`` in declaration order; see
            ``estuary.config.features`` and docs/data.md.
    """

    label: str = "label"
    dense: list[str] = field(default_factory=list)
    sparse: list[str] = field(default_factory=list)
    dense_transform: Literal["log1p", "none"] = "log1p"
    transforms: dict[str, str] = field(default_factory=dict)
    features: list[FeatureSpec] = field(default_factory=list)


@dataclass(frozen=True)
class DataSpec:
    """Where rows come from and how they are split.

    Args:
        sources: input files, read in order (required unless ``dataset`` is given).
        schema: column roles.
        eval_fraction: the last fraction of rows (file order, i.e. chronological)
            held out for evaluation; 0 disables evaluation.
        max_bad_row_ratio: the run fails once bad rows exceed this fraction of
            rows read; below it they are counted and skipped.
        report_bad_rows: how many bad rows are reported with file:line and reason.
        dataset: streams of time-partitioned sources read through the task graph
            (``data/graph``) instead of ``sources``; see docs/data.md.
    """

    sources: list[SourceSpec] = field(default_factory=list)
    schema: SchemaSpec = field(default_factory=SchemaSpec)
    eval_fraction: float = 0.1
    max_bad_row_ratio: float = 0.01
    report_bad_rows: int = 5
    dataset: DatasetSpec | None = None

    def validate(self, path: str) -> None:
        if self.dataset is not None:
            if self.sources:
                raise ConfigError(
                    f"{path}.sources", f"give {path}.sources or {path}.dataset, not both"
                )
            self.dataset.validate(f"{path}.dataset")
        elif not self.sources:
            raise ConfigError(f"{path}.sources", "required")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"{path}.eval_fraction", "must be in [0, 1)")
        if not 0.0 <= self.max_bad_row_ratio <= 1.0:
            raise ConfigError(f"{path}.max_bad_row_ratio", "must be in [0, 1]")
        if self.report_bad_rows < 0:
            raise ConfigError(f"{path}.report_bad_rows", "must be >= 0")
        if not self.schema.sparse and not self.schema.dense:
            raise ConfigError(f"{path}.schema", "needs at least one dense or sparse column")


@dataclass(frozen=True)
class DenseOptimizerSpec:
    """Optimizer for the dense (torch) parameters.

    Args:
        name: ``adam``, ``adamw``, ``adagrad``, ``sgd`` (torch.optim), or another
            name in ``estuary.plugins.DENSE_OPTIMIZERS``.
        lr: learning rate (> 0).
        weight_decay: L2 / decoupled weight decay.
    """

    name: str = "adam"
    lr: float = 1e-3
    weight_decay: float = 0.0

    def validate(self, path: str) -> None:
        DENSE_OPTIMIZERS.check(self.name, f"{path}.name")
        if self.lr <= 0:
            raise ConfigError(f"{path}.lr", "must be > 0")
        if self.weight_decay < 0:
            raise ConfigError(f"{path}.weight_decay", "must be >= 0")


@dataclass(frozen=True)
class TrainSpec:
    """The training loop.

    Args:
        batch_size: rows per step (> 0).
        eval_batch_size: rows per evaluation batch (> 0).
        epochs: passes over the training rows (> 0).
        seed: seeds torch, numpy and table initialisers.
        mode: ``sync`` (every sparse update lands before the next lookup),
            ``hybrid`` (updates applied in the background, bounded by
            ``staleness``) or ``async`` (unbounded).
        staleness: in ``hybrid`` mode, the lookup for batch t+k waits for batch t's
            update when k >= staleness.
        shuffle: shuffle training rows within each epoch (seeded).
        dense_optimizer: optimizer for the torch parameters.
        threads: torch intra-op threads; 0 = torch's default.
        precision: ``fp32``, or ``bf16`` to run the dense network's forward and
            backward under bfloat16 autocast (embeddings, the loss and the
            optimizer state stay float32).
        device: where the dense network runs: ``cpu``, ``cuda`` (an error where
            CUDA is absent) or ``auto`` (CUDA when present). Tables stay in host
            memory either way; several trainers use NCCL on CUDA, gloo on CPU.
        sparse_placement: where hybrid/async sparse work runs: ``auto`` (see
            docs/job-spec.md), ``inline`` or ``background``.
        progressive_eval: ``data.dataset`` runs: score every training batch before
            training on it (the step's own forward) and report AUC / logloss per
            event-time window and origin, and the event -> trained lag
            (summary.json ``progressive``, metrics ``estuary_progressive_*``).
        mixed_buffer: ``data.dataset`` runs: rows pass through a bounded buffer
            with row-level priority and importance weights before training
            (``estuary.config.mixed_buffer``; ``None``: straight to training).
        continuous: ``data.dataset`` runs: train the history, then keep reading
            the live streams until stopped (SIGTERM, Ctrl-C, ``request_stop``); the
            stop ends the run like the end of the data: a final checkpoint,
            evaluation and summary.json (with the progressive table), exit 0.
    """

    batch_size: int = 1024
    eval_batch_size: int = 8192
    epochs: int = 1
    seed: int = 0
    mode: TrainMode = "sync"
    staleness: int = 1
    shuffle: bool = False
    dense_optimizer: DenseOptimizerSpec = field(default_factory=DenseOptimizerSpec)
    threads: int = 0
    precision: Literal["fp32", "bf16"] = "fp32"
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    sparse_placement: Literal["auto", "inline", "background"] = "auto"
    progressive_eval: bool = False
    mixed_buffer: MixedBufferSpec | None = None
    continuous: bool = False

    def validate(self, path: str) -> None:
        if self.mode == "sync" and self.sparse_placement == "background":
            raise ConfigError(
                f"{path}.sparse_placement",
                "sync mode applies sparse updates inline; use hybrid or async for background",
            )
        for name in ("batch_size", "eval_batch_size", "epochs"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{path}.{name}", "must be > 0")
        if self.staleness < 0:
            raise ConfigError(f"{path}.staleness", "must be >= 0")
        if self.threads < 0:
            raise ConfigError(f"{path}.threads", "must be >= 0")
        self.dense_optimizer.validate(f"{path}.dense_optimizer")


@dataclass(frozen=True)
class RoleResources:
    """What one process of a role asks of the cluster (the Ray runtime places it
    where these are free).

    Args:
        cpus: logical CPUs (fractions allowed); a trainer also runs this many
            torch threads (unless ``train.threads``).
        gpus: GPUs (a CUDA dense model needs 1 per trainer).
        memory_mb: memory reserved for it; ``None`` = none reserved.
    """

    cpus: float = 1.0
    gpus: float = 0.0
    memory_mb: int | None = None

    def validate(self, path: str) -> None:
        if self.cpus <= 0:
            raise ConfigError(f"{path}.cpus", "must be > 0")
        if self.gpus < 0:
            raise ConfigError(f"{path}.gpus", "must be >= 0")
        if self.memory_mb is not None and self.memory_mb < 1:
            raise ConfigError(f"{path}.memory_mb", "must be >= 1")


@dataclass(frozen=True)
class RaySpec:
    """Settings of ``runtime.backend: ray``.

    Args:
        address: the cluster to join: ``null`` starts a local Ray instance (or
            uses the one this process already runs), ``auto`` the one ``ray
            start`` runs on this machine, ``HOST:PORT`` a head node, ``ray://
            HOST:10001`` a Ray Client server.
        num_cpus: CPUs of a local instance this run starts (``null``: this
            machine's count, or what the roles ask if that is more).
        placement_timeout_s: longest wait for the cluster to fit every role
            (all together, or none) before failing with what each asked.
        data_plane: how trainers reach the PS shards: ``socket`` (the parameter
            server's own protocol over TCP; Ray places and watches) or ``actor``
            (Ray actor calls, arrays through the object store).
        data_delivery: with data executors, how rows reach the trainers:
            ``direct`` (rank 0 routes whole blocks to ranks and hands out row
            ids; each trainer fetches its rows from the object store),
            ``rank0`` (rank 0 fetches every row, shuffles them in one buffer and
            sends each rank its part, as the local runtime does: the same
            batches as ``--nproc W``) or ``auto`` (``rank0`` when
            ``train.mixed_buffer`` needs the rows at rank 0, else ``direct``;
            see ``data_delivery``).
        trainer: resources of each trainer.
        ps: resources of each parameter-server shard.
        data_executor: resources of each data executor (``runtime.data_executors``).
        embedding_worker: resources of each embedding worker (``runtime.embedding_workers``).
        role_resources: every process also asks 1 of its role's custom resource
            (``estuary_trainer``, ``estuary_ps``, ...), so it lands on a node
            started for that role (the clusters ``estuary render`` writes).
    """

    address: str | None = None
    num_cpus: int | None = None
    placement_timeout_s: float = 60.0
    data_plane: Literal["socket", "actor"] = "socket"
    data_delivery: Literal["auto", "direct", "rank0"] = "auto"
    trainer: RoleResources = field(default_factory=RoleResources)
    ps: RoleResources = field(default_factory=RoleResources)
    data_executor: RoleResources = field(default_factory=RoleResources)
    embedding_worker: RoleResources = field(default_factory=RoleResources)
    role_resources: bool = False

    def validate(self, path: str) -> None:
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ConfigError(f"{path}.num_cpus", "must be >= 1")
        if self.placement_timeout_s <= 0:
            raise ConfigError(f"{path}.placement_timeout_s", "must be > 0")
        self.trainer.validate(f"{path}.trainer")
        self.ps.validate(f"{path}.ps")
        self.data_executor.validate(f"{path}.data_executor")
        self.embedding_worker.validate(f"{path}.embedding_worker")


@dataclass(frozen=True)
class RuntimeSpec:
    """Where the job runs.

    Args:
        backend: the runtime backend, a name in ``estuary.plugins.RUNTIMES``:
            ``local`` runs on this machine, no extra dependencies.
        trainers: trainer processes. 1 = one process with the
            tables in memory; W > 1 = W trainers (dense model replicated, gradients
            averaged) sharing tables on a parameter-server process;
            ``train.batch_size`` is then per trainer.
        ps_shards: parameter-server processes the tables are split across (ids
            routed by a stable hash). 1 with one trainer: tables in the trainer's
            memory; N > 1 (any trainer count): N server processes.
        data_executors: ``backend: ray`` with ``data.dataset``: E data executor
            actors read whole splits for the driver on rank 0 (which plans,
            shuffles, accounts and hands every rank its part); a lost executor
            is replaced and its split read again, nothing else restarts. ``0``:
            rank 0 reads (``data.dataset.executor``).
        embedding_workers: ``backend: ray``: one embedding worker per trainer
            deduplicates its ids, routes them to the PS shards, pools, and returns
            pooled (B, F, D) blocks, then scatters the pooled gradients back and
            pushes per-id sums (PERSIA's middle tier).
        max_restarts: how often a failed role (trainer, server) is restarted,
            the run continuing from the newest checkpoint, before the job fails;
            0 = fail at the first failure.
        ray: settings of ``backend: ray``.
        roles: every role's count (or ``min``/``max``), CPUs, memory and GPUs in
            one place, for every runtime and renderer (``estuary.config.roles``);
            resolved at load into the keys above, which a job may still set.
        scaling: the scaling manager (``estuary.config.scaling``); off by default.
    """

    backend: str = "local"
    trainers: int = 1
    ps_shards: int = 1
    data_executors: int = 0
    embedding_workers: bool = False
    max_restarts: int = 0
    ray: RaySpec = field(default_factory=RaySpec)
    roles: RolesSpec = field(default_factory=RolesSpec)
    scaling: ScalingSpec = field(default_factory=ScalingSpec)

    @classmethod
    def normalise(cls, data: Mapping[str, Any], path: str) -> dict[str, Any]:
        """The raw section with ``roles`` resolved into the older keys (run by the
        builder before it builds this section)."""
        return normalise_roles(data, path)

    def validate(self, path: str) -> None:
        RUNTIMES.check(self.backend, f"{path}.backend")
        if self.trainers < 1:
            raise ConfigError(f"{path}.trainers", "must be >= 1")
        if self.ps_shards < 1:
            raise ConfigError(f"{path}.ps_shards", "must be >= 1")
        if self.max_restarts < 0:
            raise ConfigError(f"{path}.max_restarts", "must be >= 0")
        if self.data_executors < 0:
            raise ConfigError(f"{path}.data_executors", "must be >= 0")
        if self.scaling.enabled and self.backend != "ray":
            raise ConfigError(
                f"{path}.scaling.enabled",
                f"needs runtime.backend: ray (got {self.backend!r}): the scaling manager "
                "resizes Ray data executors and PS shards",
            )
        # Ray-only roles; their errors also name the runtime.roles key that sets them.
        if self.embedding_workers and self.backend != "ray":
            raise ConfigError(
                f"{path}.embedding_workers",
                f"needs runtime.backend: ray (got {self.backend!r}; also set by "
                f"{path}.roles.embedding_worker.count)",
            )
        if self.data_executors and self.backend != "ray":
            raise ConfigError(
                f"{path}.data_executors",
                f"needs runtime.backend: ray (got {self.backend!r}; the local runtime "
                f"reads with data.dataset.executor; also set by {path}.roles.data_executor.count)",
            )
        self.ray.validate(f"{path}.ray")
        roles = self.resolved_roles()
        ps = roles["ps"]
        # A shard range the scaling manager could never use fails here, not at run time.
        if self.scaling.enabled and ps.max > ps.min and (missing := self.shard_range_needs(path)):
            raise ConfigError(
                f"{path}.roles.ps.max",
                f"{ps.max} above min {ps.min} with {path}.scaling.enabled, but the scaling "
                f"manager adds and retires PS shards only with {missing}; set it, or make "
                "max equal min",
            )
        for plan in roles.values():
            for bound in ("min", "max"):
                limit = getattr(plan, bound)
                if (plan.count < limit) if bound == "min" else (plan.count > limit):
                    home = ROLES[plan.role].count_key
                    raise ConfigError(
                        f"{path}.roles.{plan.role}.{bound}",
                        f"{plan.count} {plan.role} process(es) ({path}.{home}) is "
                        f"{'below' if bound == 'min' else 'above'} {bound} {limit}",
                    )

    def shard_range_needs(self, path: str = "runtime") -> str | None:
        """What the scaling manager lacks to add and retire PS shards, named by the
        key that sets it: a PS memory budget (either data plane works); ``None``
        when it has one."""
        if self.ray.ps.memory_mb is None:
            return f"a PS memory budget ({path}.roles.ps.memory_mb)"
        return None

    def resolved_roles(self) -> dict[str, RolePlan]:
        """Every role as it will run, by role name (``estuary.config.roles.ROLES``
        order): counts and resources from the keys the runtimes read, bounds from
        ``roles``. Embedding workers count (and scale) one per trainer when on."""
        counts = {
            "driver": 1,
            "ps": self.ps_shards,
            "trainer": self.trainers,
            "data_executor": self.data_executors,
            "embedding_worker": self.trainers if self.embedding_workers else 0,
        }
        out: dict[str, RolePlan] = {}
        for role, home in ROLES.items():
            spec = getattr(self.roles, role)
            # Embedding workers are one per trainer: they scale with the trainers.
            bounds = self.roles.trainer if role == "embedding_worker" and counts[role] else spec
            if home.resources_key is None:
                resources = RoleResources(
                    cpus=1.0 if spec.cpus is None else spec.cpus,
                    gpus=spec.gpus or 0.0,
                    memory_mb=spec.memory_mb,
                )
            else:
                resources = getattr(self.ray, home.resources_key)
            count = counts[role]
            out[role] = RolePlan(
                role=role,
                count=count,
                min=count if bounds.min is None else bounds.min,
                max=count if bounds.max is None else bounds.max,
                cpus=resources.cpus,
                gpus=resources.gpus,
                memory_mb=resources.memory_mb,
            )
        return out

    @property
    def uses_servers(self) -> bool:
        """Whether the tables live on parameter-server processes."""
        return self.trainers > 1 or self.ps_shards > 1


@dataclass(frozen=True)
class OutputSpec:
    """What the run writes.

    Args:
        dir: output folder for the checkpoint and ``summary.json``; relative paths
            resolve against the job file.
        checkpoint: write a checkpoint at the end of training.
        progress: show a progress bar.
        checkpoint_every_steps: also checkpoint every this many steps (model,
            tables and data position together: a ``data.dataset`` run's progress,
            a ``data.sources`` run's epoch and step in it); ``null`` = off.
        checkpoint_full_every: every this many checkpoints in a chain is a full
            snapshot; the ones between are deltas (table rows changed and ids
            evicted since the previous checkpoint; dense model and optimizer in
            full). ``1`` = every checkpoint is full.
        checkpoint_async: mid-run checkpoints (``checkpoint_every_steps``) stall
            training only while the state of one step is copied; the files are
            written in the background (tables held by parameter servers: by
            each server, its own part) while training goes on.
        metrics_port: serve Prometheus metrics at ``http://HOST:PORT/metrics``
            while training (rank 0 of a multi-trainer run); ``0`` picks a free
            port (logged); ``null`` = off.
        metrics_host: interface the metrics endpoint binds (``0.0.0.0`` = all).
        timeseries_every_s: append samples of the run (loss, rows/s, windowed
            AUC, stage times, staleness, table growth, data lag) to
            ``timeseries.jsonl`` in the output folder for ``estuary report``: every
            0.25 s at first, then every 1/40 of the time trained so far, at most
            every this many seconds; ``null`` = off.
    """

    dir: str = "runs/default"
    checkpoint: bool = True
    progress: bool = True
    checkpoint_every_steps: int | None = None
    checkpoint_full_every: int = 1
    checkpoint_async: bool = False
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    timeseries_every_s: float | None = 10.0

    def validate(self, path: str) -> None:
        if self.checkpoint_every_steps is not None and self.checkpoint_every_steps < 1:
            raise ConfigError(f"{path}.checkpoint_every_steps", "must be >= 1")
        if self.checkpoint_full_every < 1:
            raise ConfigError(f"{path}.checkpoint_full_every", "must be >= 1")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"{path}.metrics_port", "must be in [0, 65535] (0 = a free port)")
        if not self.metrics_host.strip():
            raise ConfigError(f"{path}.metrics_host", "must not be empty")
        if self.timeseries_every_s is not None and not self.timeseries_every_s > 0:
            raise ConfigError(f"{path}.timeseries_every_s", "must be > 0 (null = off)")


@dataclass(frozen=True)
class JobSpec:
    """A whole training job.

    Args:
        data: inputs and split.
        model: network and embedding tables.
        train: the training loop.
        runtime: where it runs.
        output: what it writes.
        name: a label for the run.
        base_dir: folder the job file's relative paths resolve against (set by the
            loader; not a YAML key).
    """

    data: DataSpec
    model: ModelSpec = field(default_factory=ModelSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    runtime: RuntimeSpec = field(default_factory=RuntimeSpec)
    output: OutputSpec = field(default_factory=OutputSpec)
    name: str = "estuary-job"
    base_dir: Path = field(default=Path("."), metadata={"yaml": False})

    def resolve(self, path: str | Path) -> Path:
        """A path from the job file, resolved against the job file's folder."""
        p = Path(path).expanduser()
        return (p if p.is_absolute() else (self.base_dir / p)).resolve()

    @cached_property
    def tables(self) -> dict[str, TableSpec]:
        """Every embedding table's settings, by table name, in feature order: one
        table per sparse feature (``data.schema.sparse``, then derived features),
        or one per ``model.embedding.shared`` group, named by the group.

        Each is ``model.embedding.default`` merged with the table's entry in
        ``model.embedding.tables``, resolved once: the loader resolves them when
        it builds the job (so a wrong override fails at load), and every user
        (trainer, parameter server, checkpoints) looks them up here.

        Raises:
            ConfigError: a table's override is wrong (path inside
                ``model.embedding.tables.<table>``).
        """
        embedding = self.model.embedding
        group_of = {m: group for group, members in embedding.shared.items() for m in members}
        schema = self.data.schema
        features = [*schema.sparse, *(feature.name for feature in schema.features)]
        out: dict[str, TableSpec] = {}
        for name in dict.fromkeys(group_of.get(f, f) for f in features):
            override = embedding.tables.get(name)
            out[name] = (
                embedding.default
                if override is None
                else merge_table(embedding.default, override, f"model.embedding.tables.{name}")
            )
        return out

    def table_spec(self, table: str) -> TableSpec:
        """The settings of one table (a sparse feature's, or a shared group's), as
        resolved at load (``tables``); ``model.embedding.default`` for any other name."""
        return self.tables.get(table, self.model.embedding.default)


def data_delivery(job: JobSpec) -> Literal["direct", "rank0"]:
    """How rows reach the trainers from data executors on Ray
    (``runtime.ray.data_delivery`` with ``auto`` resolved): the mixed buffer
    (``train.mixed_buffer``) ranks and samples rows by their content at rank 0,
    so it takes ``rank0``; every other job ``direct``, where rank 0 moves only
    row ids."""
    chosen = job.runtime.ray.data_delivery
    if chosen != "auto":
        return chosen
    return "rank0" if job.train.mixed_buffer is not None else "direct"
