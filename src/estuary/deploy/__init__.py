"""Turning a job file into a cluster manager's manifest (``estuary render``).

``render(target, job, options)`` returns the YAML text of one registered target
(``estuary.plugins.RENDERERS``): ``k8s`` writes a KubeRay ``RayJob`` with a
ConfigMap holding the job file (``deploy.kuberay``), ``yarn`` a Skein
application spec (``deploy.yarn``). Both start one Ray node per role process,
sized by ``runtime.roles`` (``deploy.roles``), and run the driver with
``runtime.backend=ray``; docs/deploy.md walks through them.
"""

from __future__ import annotations

from estuary.deploy.render import render
from estuary.deploy.types import Renderer, RenderOptions, RenderWarning

__all__ = ["RenderOptions", "RenderWarning", "Renderer", "render"]
