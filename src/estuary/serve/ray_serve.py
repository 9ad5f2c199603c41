"""``estuary serve --ray --replicas N``: the same application as a Ray Serve
deployment of N replicas behind Ray Serve's HTTP proxy.

Each replica opens what to serve itself (``open_served``: the export folder, or
the run's newest checkpoint), so the folder must be readable from every node
(on one machine it is). Following a run with ``--prepare process`` (the
default), the replicas of a node share one preparer, a Ray actor, and its two
slot files (``SharedFollower``, ``estuary.serve.node_preparer``): one prepared
copy of the model per node, not per replica. Requests are spread over the
replicas by Ray Serve; each replica batches its own requests. Needs
``pip install 'estuary[ray-serve]'`` (``ray[serve]``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from estuary.serve.node_follow import SharedFollower
from estuary.serve.server import Served, ServeOptions, freeze_heap, open_served, require

__all__ = ["EstuaryReplica", "build_application", "run_on_ray"]


class EstuaryReplica:
    """One replica: the model (and follower), and the ASGI application over it.

    Args:
        export_dir: an export folder, or ``None`` with ``follow``.
        follow: a run folder to follow, or ``None``.
        options: how to serve (host and port are Ray Serve's, not these).
    """

    def __init__(self, export_dir: Path | None, follow: Path | None, options: ServeOptions) -> None:
        self.options = options
        torch.set_num_threads(options.threads)
        # Following: the replicas of a node share one preparer and its slot files
        # (``SharedFollower``; docs/serving.md, "Scale out on Ray").
        self.served: Served = open_served(
            export_dir, follow, options, process_follower=SharedFollower
        )
        freeze_heap()  # full collections walk only what serving allocates from here on
        if self.served.follower is not None:
            self.served.follower.start()

    def __serve_build_asgi_app__(self) -> Any:  # Ray Serve's hook, called after __init__
        from estuary.serve.app import create_app

        o = self.options
        return create_app(
            self.served.model,
            metrics=self.served.metrics,
            max_body_bytes=o.max_body_bytes,
            max_batch_rows=o.max_batch_rows,
            max_wait_s=o.max_wait_s,
        )

    def __del__(self) -> None:
        follower = getattr(getattr(self, "served", None), "follower", None)
        if follower is not None:
            follower.stop()


def build_application(
    export_dir: Path | None, follow: Path | None, options: ServeOptions, replicas: int
) -> Any:
    """The Ray Serve application (``serve.run`` it)."""
    serve = require("ray.serve")
    ingress = serve.ingress()(EstuaryReplica)
    deployment = serve.deployment(name="estuary", num_replicas=replicas)(ingress)
    return deployment.bind(export_dir, follow, options)


def run_on_ray(
    export_dir: Path | None,
    follow: Path | None,
    options: ServeOptions,
    replicas: int,
    *,
    blocking: bool = True,
) -> None:
    """Start Ray Serve's proxy on ``options.host:port`` and deploy N replicas;
    ``blocking``: serve until interrupted. Connects to the running Ray instance
    (``RAY_ADDRESS``) or starts a local one."""
    ray = require("ray")
    serve = require("ray.serve")
    if not ray.is_initialized():
        ray.init(logging_level="WARNING")
    serve.start(http_options={"host": options.host, "port": options.port})
    app = build_application(export_dir, follow, options, replicas)
    serve.run(app, name="estuary", route_prefix="/", blocking=blocking)
