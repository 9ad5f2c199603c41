"""``render``: one registered target's manifest as YAML text."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import yaml

from estuary.config import ConfigError, JobSpec
from estuary.deploy.roles import relative_paths
from estuary.deploy.types import Renderer, RenderOptions, RenderWarning
from estuary.plugins import RENDERERS

__all__ = ["render", "render_documents"]


class _Dumper(yaml.SafeDumper):
    """Writes multi-line strings (the job file, scripts) as ``|`` blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render_documents(target: str, job: JobSpec, options: RenderOptions) -> list[dict[str, Any]]:
    """The manifest of ``target`` (a name in ``estuary.plugins.RENDERERS``) as
    documents.

    Warns:
        RenderWarning: for each relative path in the job (data, ``output.dir``):
            the cluster resolves it against ``renderer.job_dir``.

    Raises:
        ConfigError: an unknown target, or an option the target does not read.
    """
    renderer: Renderer = RENDERERS.get(target)
    given = [f.name for f in dataclasses.fields(options) if getattr(options, f.name) is not None]
    for name in given:
        if name not in renderer.options:
            flags = ", ".join(f"--{o.replace('_', '-')}" for o in sorted(renderer.options))
            raise ConfigError(
                f"--{name.replace('_', '-')}",
                f"not an option of render target {target!r} (its options: {flags})",
            )
    for where, path in relative_paths(job).items():
        warnings.warn(
            f"{where}: relative path {path!r} resolves against {renderer.job_dir} on the "
            "cluster; give a path every node can reach",
            RenderWarning,
            stacklevel=2,
        )
    return renderer.render(job, options)


def render(target: str, job: JobSpec, options: RenderOptions) -> str:
    """The manifest of ``target`` as YAML text (several documents, ``---`` between)."""
    documents = render_documents(target, job, options)
    return yaml.dump_all(documents, Dumper=_Dumper, sort_keys=False, width=2**16)
