"""What a render target is: options in, manifest documents out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from estuary.config import JobSpec

__all__ = ["RenderOptions", "RenderWarning", "Renderer"]


@dataclass(frozen=True)
class RenderOptions:
    """Choices of one ``estuary render`` call; each target reads the ones it
    lists in ``Renderer.options``.

    Args:
        name: the application's name (Kubernetes objects, Skein application);
            ``None``: the job's ``name``, made DNS-safe.
        image: container image of every pod (k8s); it needs estuary with the
            ``ray`` extra and a Ray of the cluster's version.
        namespace: Kubernetes namespace of the objects (k8s); ``None``: the
            one ``kubectl`` uses.
        entrypoint: the driver's command instead of the default
            ``estuary train <job> --set runtime.backend=ray ...``.
        env_archive: a packed Python environment (``venv-pack``/``conda-pack``
            ``.tar.gz``) every YARN container unpacks and activates (yarn);
            ``None``: ``estuary`` and ``ray`` are on the nodes' PATH.
        queue: the YARN queue (yarn).
    """

    name: str | None = None
    image: str | None = None
    namespace: str | None = None
    entrypoint: str | None = None
    env_archive: str | None = None
    queue: str | None = None


class RenderWarning(UserWarning):
    """The manifest was written, but the job may not run as it stands on the
    cluster (e.g. a relative path the nodes resolve elsewhere)."""


class Renderer(Protocol):
    """One render target (an object registered in ``estuary.plugins.RENDERERS``).

    ``options`` names the ``RenderOptions`` fields it reads; ``estuary.deploy.render``
    refuses the others, so a flag meant for another target is an error, not ignored.
    ``job_dir`` says where the cluster reads the job file from, which relative
    paths in it resolve against.
    """

    options: frozenset[str]
    job_dir: str

    def render(self, job: JobSpec, options: RenderOptions) -> list[dict[str, Any]]:
        """The manifest as YAML documents, in the order they are applied."""
        ...
