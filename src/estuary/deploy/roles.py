"""What every target renders alike: the Ray node of each role process, the job
document, and the driver's command.

Layout (both targets): one Ray head that runs no role (``num-cpus 0``) and hosts
the driver; one Ray worker node per process of each role, sized like that
process (``runtime.roles.<role>``, resolved by ``RuntimeSpec.resolved_roles``)
and carrying 1 of the role's custom resource (``estuary_<role>``). The job
document sets ``runtime.ray.role_resources: true``, so every process asks for
its role's resource and lands on a node of its own group.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from estuary.config import JobSpec, to_dict
from estuary.config.roles import RolePlan, role_resource
from estuary.deploy.types import RenderOptions

__all__ = [
    "app_name",
    "cpu_quantity",
    "driver_command",
    "job_document",
    "memory_quantity",
    "ray_node_resources",
    "relative_paths",
    "worker_roles",
]


def worker_roles(job: JobSpec) -> list[RolePlan]:
    """The roles that get Ray worker nodes, in ``ROLES`` order: every role but the
    driver that can have a process. Data executors only serve ``data.dataset``
    jobs (the Ray runtime places none otherwise, ``runtime.ray.cluster.role_asks``)."""
    out = []
    for plan in job.runtime.resolved_roles().values():
        if plan.role == "driver" or plan.max == 0:
            continue
        if plan.role == "data_executor" and job.data.dataset is None:
            continue
        out.append(plan)
    return out


def ray_node_resources(plan: RolePlan) -> dict[str, Any]:
    """``ray start`` resources of one node of ``plan``'s role (one process per node):
    ``num-cpus`` (whole CPUs, rounded up: Ray counts nodes' CPUs in integers),
    ``num-gpus``, ``memory`` (bytes) when asked, and the role's marker resource."""
    out: dict[str, Any] = {"num-cpus": math.ceil(plan.cpus)}
    if plan.gpus:
        out["num-gpus"] = math.ceil(plan.gpus)
    if plan.memory_mb is not None:
        out["memory"] = plan.memory_mb * 2**20
    out["resources"] = json.dumps({role_resource(plan.role): 1}, separators=(",", ":"))
    return out


def cpu_quantity(cpus: float) -> str:
    """A Kubernetes CPU quantity: ``2``, ``500m``."""
    return str(int(cpus)) if float(cpus).is_integer() else f"{round(cpus * 1000)}m"


def memory_quantity(memory_mb: int) -> str:
    """A Kubernetes memory quantity in MiB: ``4096Mi``."""
    return f"{memory_mb}Mi"


def app_name(job: JobSpec, options: RenderOptions) -> str:
    """The application's name: ``options.name`` or the job's, lower-case letters,
    digits and ``-`` (a DNS label, as Kubernetes object names must be)."""
    raw = options.name if options.name is not None else job.name
    name = re.sub(r"[^a-z0-9-]+", "-", raw.lower()).strip("-")[:40].rstrip("-")
    return name or "estuary-job"


def job_document(job: JobSpec) -> str:
    """The job as the rendered cluster reads it: the loaded spec with ``--set``
    overrides applied, ``runtime.roles`` resolved and every default written out
    (``to_dict``), set to run there: ``runtime.backend: ray``,
    ``runtime.ray.address: auto`` (the cluster the driver runs in: Ray reads
    ``RAY_ADDRESS``, else finds the node's own ``ray start``) and
    ``runtime.ray.role_resources: true`` (each role on its own nodes). Paths are
    kept as written, so they must name files the cluster's nodes can read."""
    ray = replace(job.runtime.ray, address="auto", role_resources=True)
    on_cluster = replace(job, runtime=replace(job.runtime, backend="ray", ray=ray))
    return yaml.safe_dump(to_dict(on_cluster), sort_keys=False)


def relative_paths(job: JobSpec) -> dict[str, str]:
    """The job's relative paths by field path (``output.dir``: ``runs/default``): on
    a cluster they resolve against wherever the job file lands there. The path
    fields are the ones ``to_dict(resolve_paths=True)`` resolves."""
    found: dict[str, str] = {}

    def walk(written: Any, resolved: Any, where: str) -> None:
        if isinstance(written, dict):
            for key, value in written.items():
                walk(value, resolved[key], f"{where}.{key}" if where else key)
        elif isinstance(written, list):
            for i, (value, other) in enumerate(zip(written, resolved, strict=True)):
                walk(value, other, f"{where}[{i}]")
        elif written != resolved and not Path(written).is_absolute():
            found[where] = written

    walk(to_dict(job), to_dict(job, resolve_paths=True), "")
    return found


def driver_command(job_path: str, options: RenderOptions) -> str:
    """The driver's shell command: ``options.entrypoint``, or ``estuary train`` of
    the job document on the Ray backend."""
    if options.entrypoint is not None:
        return options.entrypoint
    return shlex.join(["estuary", "train", job_path, "--set", "runtime.backend=ray"])
