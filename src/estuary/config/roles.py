"""``runtime.roles``: one resource spec per role (count or min/max, CPUs, memory, GPUs).

The roles section is an input: at load, ``normalise_roles`` resolves each role's
count and resources into the keys the runtimes read (``runtime.trainers``,
``runtime.ray.trainer``, ...), so after loading there is one value of each and
the runtimes never see two. What has no older key stays in ``runtime.roles``:
``min``/``max`` (for a scaling manager and the renderers' min/max replicas) and the
driver's resources. ``RuntimeSpec.resolved_roles()`` reads both into one
``RolePlan`` per role, the view the renderers (``estuary.deploy``) use.

A job that sets a role's value both here and under its older key fails to load
unless the two agree; the error names both paths.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from estuary.config.build import build_dataclass, plain
from estuary.config.errors import ConfigError

__all__ = ["ROLES", "RolePlan", "RoleSpec", "RolesSpec", "normalise_roles", "role_resource"]


@dataclass(frozen=True)
class RoleSpec:
    """One role's processes and what each asks of the cluster.

    Args:
        count: processes of the role; defaults to ``min`` when only ``min``/``max``
            are given (``runtime.trainers`` etc. when neither is).
        min: fewest processes a scaling manager may shrink the role to.
        max: most processes a scaling manager may grow the role to.
        cpus: logical CPUs of each process (fractions allowed).
        gpus: GPUs of each process.
        memory_mb: memory of each process in MiB.
    """

    count: int | None = None
    min: int | None = None
    max: int | None = None
    cpus: float | None = None
    gpus: float | None = None
    memory_mb: int | None = None

    def validate(self, path: str) -> None:
        for name in ("count", "min", "max"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"{path}.{name}", "must be >= 0")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ConfigError(f"{path}.min", f"{self.min} is above max {self.max}")
        if self.count is not None:
            if self.min is not None and self.count < self.min:
                raise ConfigError(f"{path}.count", f"{self.count} is below min {self.min}")
            if self.max is not None and self.count > self.max:
                raise ConfigError(f"{path}.count", f"{self.count} is above max {self.max}")
        if self.cpus is not None and self.cpus <= 0:
            raise ConfigError(f"{path}.cpus", "must be > 0")
        if self.gpus is not None and self.gpus < 0:
            raise ConfigError(f"{path}.gpus", "must be >= 0")
        if self.memory_mb is not None and self.memory_mb < 1:
            raise ConfigError(f"{path}.memory_mb", "must be >= 1")


@dataclass(frozen=True)
class RolesSpec:
    """Every role of a job (``runtime.roles``).

    Args:
        driver: the process that runs ``estuary train`` (on Ray, the job's
            entrypoint): resources only, its count is 1.
        trainer: trainers (``runtime.trainers``, ``runtime.ray.trainer``).
        ps: parameter-server shards (``runtime.ps_shards``, ``runtime.ray.ps``).
        data_executor: data executors (``runtime.data_executors``,
            ``runtime.ray.data_executor``).
        embedding_worker: embedding workers: count 0 (off) or the trainer count
            (one per trainer; ``runtime.embedding_workers``), ``runtime.ray.embedding_worker``.
    """

    driver: RoleSpec = field(default_factory=RoleSpec)
    trainer: RoleSpec = field(default_factory=RoleSpec)
    ps: RoleSpec = field(default_factory=RoleSpec)
    data_executor: RoleSpec = field(default_factory=RoleSpec)
    embedding_worker: RoleSpec = field(default_factory=RoleSpec)


@dataclass(frozen=True)
class _Home:
    """Where a role's count and resources live in the keys the runtimes read."""

    count_key: str | None  # under runtime; None: the role has no count key
    resources_key: str | None  # under runtime.ray
    least: int = 0  # the fewest processes the runtimes accept


# Role -> its older keys. The order is the renderers' group order, and trainers
# resolve before embedding workers (whose count must equal theirs).
ROLES: dict[str, _Home] = {
    "driver": _Home(None, None),
    "ps": _Home("ps_shards", "ps", least=1),
    "trainer": _Home("trainers", "trainer", least=1),
    "data_executor": _Home("data_executors", "data_executor"),
    "embedding_worker": _Home("embedding_workers", "embedding_worker"),
}
_RESOURCES = ("cpus", "gpus", "memory_mb")


def role_resource(role: str) -> str:
    """The Ray custom resource that marks a node for ``role`` (``estuary_trainer``):
    rendered clusters give each role's nodes it, and with
    ``runtime.ray.role_resources`` each process of the role asks 1 of it."""
    return f"estuary_{role}"


@dataclass(frozen=True)
class RolePlan:
    """One role as it will run: the resolved count, bounds and per-process resources.

    Args:
        role: the role's name (a key of ``ROLES``).
        count: processes at start.
        min: fewest processes (``count`` when the job sets no ``min``).
        max: most processes (``count`` when the job sets no ``max``).
        cpus: logical CPUs of each process.
        gpus: GPUs of each process.
        memory_mb: memory of each process in MiB; ``None`` = none reserved.
    """

    role: str
    count: int
    min: int
    max: int
    cpus: float
    gpus: float
    memory_mb: int | None


def _conflict(path: str, role: str, key: str, ours: Any, older: str, theirs: Any) -> ConfigError:
    return ConfigError(
        f"{path}.roles.{role}.{key}",
        f"{ours!r} disagrees with {older}: {theirs!r} (set one of them, or both alike)",
    )


def _section(data: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = data.get(key)
    return dict(value) if isinstance(value, Mapping) else {}


def normalise_roles(data: Mapping[str, Any], path: str) -> dict[str, Any]:
    """The raw ``runtime`` section with ``roles`` resolved into the older keys.

    Args:
        data: the ``runtime`` section as read from YAML.
        path: its dotted path (``runtime``).

    Returns:
        A copy whose ``trainers``/``ps_shards``/... and ``ray.<role>`` keys hold the
        roles' counts and resources, and whose ``roles`` keeps only ``min``/``max``
        and the driver's resources.

    Raises:
        ConfigError: a wrong roles value, or one that disagrees with its older key
            (naming both paths).
    """
    raw = data.get("roles")
    if not isinstance(raw, Mapping):
        return dict(data)  # absent (all defaults), or the builder's type error
    roles = build_dataclass(RolesSpec, raw, f"{path}.roles")
    out = dict(data)
    ray = _section(out, "ray")
    kept: dict[str, RoleSpec] = {}
    for role, home in ROLES.items():
        spec: RoleSpec = getattr(roles, role)
        where = f"{path}.roles.{role}"
        if home.count_key is None:  # the driver: one process, resources stay here
            if spec.count not in (None, 1) or spec.min is not None or spec.max is not None:
                raise ConfigError(where, "there is one driver: give it no count, min or max")
            kept[role] = spec
            continue
        count = spec.count
        if count is None and out.get(home.count_key) is None:
            count = spec.min  # only min/max given: start at min
        for key in ("count", "min"):
            least = getattr(spec, key)
            if least is not None and least < home.least:
                raise ConfigError(f"{where}.{key}", f"must be >= {home.least}")
        if count is not None:
            value: Any = count
            if role == "embedding_worker":
                value = _embedding_workers(spec, out, path)
            older = out.get(home.count_key)
            if older is not None and older != value:
                raise _conflict(path, role, "count", count, f"{path}.{home.count_key}", older)
            out[home.count_key] = value
        assert home.resources_key is not None
        resources = _section(ray, home.resources_key)
        for key in _RESOURCES:
            value = getattr(spec, key)
            if value is None:
                continue
            older = resources.get(key)
            if older is not None and older != value:
                older_path = f"{path}.ray.{home.resources_key}.{key}"
                raise _conflict(path, role, key, value, older_path, older)
            resources[key] = value
        if resources:
            ray[home.resources_key] = resources
        kept[role] = RoleSpec(min=spec.min, max=spec.max)
    if ray:
        out["ray"] = ray
    out["roles"] = plain(replace(roles, **kept))
    return out


def _embedding_workers(spec: RoleSpec, runtime: Mapping[str, Any], path: str) -> bool:
    """``runtime.embedding_workers`` from ``roles.embedding_worker``: one per trainer.
    ``runtime`` already holds the trainer count (``ROLES`` resolves trainers first)."""
    where = f"{path}.roles.embedding_worker"
    if spec.min is not None or spec.max is not None:
        raise ConfigError(
            where, f"follows the trainer count (one per trainer): set {path}.roles.trainer.min/max"
        )
    trainers = runtime.get("trainers", 1)
    if spec.count and isinstance(trainers, int) and spec.count != trainers:
        raise ConfigError(
            f"{where}.count",
            f"must be 0 (off) or the trainer count, {trainers} (one embedding worker per trainer)",
        )
    return bool(spec.count)
