"""``estuary render yarn``: a Skein application spec running the job on Ray on YARN.

One Skein service per role (skein.readthedocs.io, "Specification"):

- ``driver`` (1 instance, ``runtime.roles.driver`` resources): writes the job
  file (embedded in its script) to ``job.yaml``, starts the Ray head
  (``num-cpus 0``: no role process lands on it), publishes the head's address in
  the application's key-value store (``skein kv put current --key ray-address``),
  runs the driver command (``deploy.roles.driver_command``), then stops Ray and
  shuts the application down with the run's status;
- one service per role process group (``deploy.roles.worker_roles``):
  ``instances`` = count, one process's ``vcores`` (CPUs rounded up), ``memory``
  and ``gpus`` per container; its script waits for the address
  (``skein kv get current --key ray-address --wait``) and runs
  ``ray start --address ... --block`` with the role's custom resource.

YARN needs a memory size for every container: a role without ``memory_mb`` gets
``DEFAULT_MEMORY_MB``.
"""

from __future__ import annotations

import math
import shlex
from typing import Any

from estuary.config import JobSpec
from estuary.config.roles import RolePlan
from estuary.deploy.roles import (
    app_name,
    driver_command,
    job_document,
    ray_node_resources,
    worker_roles,
)
from estuary.deploy.types import RenderOptions

__all__ = ["ADDRESS_KEY", "DEFAULT_MEMORY_MB", "RENDERER", "SkeinRenderer"]

ADDRESS_KEY = "ray-address"
DEFAULT_MEMORY_MB = 2048
HEAD_PORT = 6379
ENV_DIR = "environment"


def _resources(plan: RolePlan) -> dict[str, Any]:
    out: dict[str, Any] = {
        "vcores": math.ceil(plan.cpus),
        "memory": f"{plan.memory_mb or DEFAULT_MEMORY_MB} MiB",
    }
    if plan.gpus:
        out["gpus"] = math.ceil(plan.gpus)
    return out


def _prelude(options: RenderOptions) -> list[str]:
    lines = ["set -eu"]
    if options.env_archive is not None:  # skein unpacks the archive into ENV_DIR
        lines.append(f"source {ENV_DIR}/bin/activate")
    return lines


def _driver_script(job: JobSpec, options: RenderOptions) -> str:
    document = job_document(job)
    return "\n".join(
        [
            *_prelude(options),
            "cat > job.yaml <<'ESTUARY_JOB'",
            document.rstrip("\n"),
            "ESTUARY_JOB",
            f"ray start --head --port={HEAD_PORT} --num-cpus=0 --dashboard-host=0.0.0.0",
            f'export RAY_ADDRESS="$(hostname -f):{HEAD_PORT}"',
            f'skein kv put current --key {ADDRESS_KEY} --value "$RAY_ADDRESS"',
            "status=0",
            f"{driver_command('job.yaml', options)} || status=$?",
            "ray stop",
            'if [ "$status" -eq 0 ]; then final=SUCCEEDED; else final=FAILED; fi',
            'skein application shutdown current --status "$final"',
            'exit "$status"',
            "",
        ]
    )


def _worker_script(plan: RolePlan, options: RenderOptions) -> str:
    resources = ray_node_resources(plan)
    flags = " ".join(shlex.quote(f"--{key}={value}") for key, value in resources.items())
    return "\n".join(
        [
            *_prelude(options),
            f'address="$(skein kv get current --key {ADDRESS_KEY} --wait)"',
            f'ray start --address="$address" {flags} --block',
            "",
        ]
    )


class SkeinRenderer:
    """Renders a job as a Skein application spec (module docstring)."""

    options = frozenset({"name", "entrypoint", "env_archive", "queue"})
    job_dir = "the driver container's working folder"

    def render(self, job: JobSpec, options: RenderOptions) -> list[dict[str, Any]]:
        files = {ENV_DIR: options.env_archive} if options.env_archive is not None else {}
        driver = job.runtime.resolved_roles()["driver"]
        services: dict[str, Any] = {
            "driver": {
                "instances": 1,
                "resources": _resources(driver),
                "files": dict(files),
                "script": _driver_script(job, options),
            }
        }
        for plan in worker_roles(job):
            services[plan.role.replace("_", "-")] = {
                "instances": plan.count,
                "resources": _resources(plan),
                "files": dict(files),
                "depends": ["driver"],
                "script": _worker_script(plan, options),
            }
        spec = {
            "name": app_name(job, options),
            "queue": options.queue or "default",
            "services": services,
        }
        return [spec]


RENDERER = SkeinRenderer()
