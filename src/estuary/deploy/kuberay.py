"""``estuary render k8s``: a KubeRay ``RayJob`` and a ConfigMap with the job file.

Two documents, applied in order by ``kubectl apply -f``:

1. ``ConfigMap <name>-job`` with ``job.yaml`` (``deploy.roles.job_document``),
   mounted read-only at ``/etc/estuary`` in the head pod, where the driver runs;
2. ``RayJob <name>`` (``ray.io/v1``): the head group (the driver's CPUs, memory and
   GPUs; ``num-cpus: 0``, so no role process lands there) and one worker group per
   role (``deploy.roles.worker_roles``): ``replicas`` = count, ``minReplicas`` /
   ``maxReplicas`` from ``runtime.roles.<role>.min/max``, each pod one process's
   requests = limits (``cpu``, ``memory``, ``nvidia.com/gpu``) and the role's Ray
   custom resource. The entrypoint is ``deploy.roles.driver_command``.
"""

from __future__ import annotations

from typing import Any

from estuary.config import JobSpec
from estuary.config.roles import RolePlan
from estuary.deploy.roles import (
    app_name,
    cpu_quantity,
    driver_command,
    job_document,
    memory_quantity,
    ray_node_resources,
    worker_roles,
)
from estuary.deploy.types import RenderOptions

__all__ = ["JOB_DIR", "RENDERER", "KubeRayRenderer"]

JOB_DIR = "/etc/estuary"
DEFAULT_IMAGE = "estuary:latest"


def _container_resources(plan: RolePlan) -> dict[str, Any]:
    """Requests = limits: Ray's view of the node and the pod's match exactly."""
    amounts: dict[str, Any] = {"cpu": cpu_quantity(plan.cpus)}
    if plan.memory_mb is not None:
        amounts["memory"] = memory_quantity(plan.memory_mb)
    if plan.gpus:
        amounts["nvidia.com/gpu"] = ray_node_resources(plan)["num-gpus"]
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _ray_start_params(plan: RolePlan) -> dict[str, str]:
    """``rayStartParams`` (strings). KubeRay adds ``--key=value`` to ``ray start`` in a
    shell, so the JSON of ``resources`` is double-quoted once more, as in KubeRay's
    samples: ``"{\\"estuary_ps\\":1}"``."""
    out = {key: str(value) for key, value in ray_node_resources(plan).items()}
    escaped = out["resources"].replace('"', '\\"')
    out["resources"] = f'"{escaped}"'
    return out


def _pod(image: str, plan: RolePlan, container: str, head: bool, config_map: str) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [
            {
                "name": container,
                "image": image,
                "resources": _container_resources(plan),
            }
        ]
    }
    if head:
        spec["containers"][0]["volumeMounts"] = [
            {"name": "job", "mountPath": JOB_DIR, "readOnly": True}
        ]
        spec["volumes"] = [{"name": "job", "configMap": {"name": config_map}}]
    return {"metadata": {"labels": {"estuary.dev/role": plan.role}}, "spec": spec}


class KubeRayRenderer:
    """Renders a job as a ConfigMap and a KubeRay ``RayJob`` (module docstring)."""

    options = frozenset({"name", "image", "namespace", "entrypoint"})
    job_dir = f"{JOB_DIR} (read-only)"

    def render(self, job: JobSpec, options: RenderOptions) -> list[dict[str, Any]]:
        name = app_name(job, options)
        image = options.image or DEFAULT_IMAGE
        config_map = f"{name}-job"
        meta: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/name": "estuary"}}
        if options.namespace is not None:
            meta["namespace"] = options.namespace
        roles = job.runtime.resolved_roles()
        head_params = {"num-cpus": "0", "dashboard-host": "0.0.0.0"}
        head = {
            "rayStartParams": head_params,
            "template": _pod(image, roles["driver"], "ray-head", True, config_map),
        }
        groups = [
            {
                "groupName": plan.role.replace("_", "-"),
                "replicas": plan.count,
                "minReplicas": plan.min,
                "maxReplicas": plan.max,
                "rayStartParams": _ray_start_params(plan),
                "template": _pod(image, plan, "ray-worker", False, config_map),
            }
            for plan in worker_roles(job)
        ]
        ray_job = {
            "apiVersion": "ray.io/v1",
            "kind": "RayJob",
            "metadata": meta,
            "spec": {
                "entrypoint": driver_command(f"{JOB_DIR}/job.yaml", options),
                "shutdownAfterJobFinishes": True,
                "rayClusterSpec": {"headGroupSpec": head, "workerGroupSpecs": groups},
            },
        }
        config = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {**meta, "name": config_map},
            "data": {"job.yaml": job_document(job)},
        }
        return [config, ray_job]


RENDERER = KubeRayRenderer()
