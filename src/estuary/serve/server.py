"""``estuary serve``: open what to serve, run the application on uvicorn.

``open_served`` loads an export folder (``load_export``) or, to follow a run,
the run's newest checkpoint plus a ``Follower`` of the run; ``run_server``
serves the ASGI application until interrupted (Ctrl-C / SIGTERM stop uvicorn,
then the follower).
"""

from __future__ import annotations

import gc
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from estuary.serve.checkpoints import model_from_checkpoint
from estuary.serve.export import load_export
from estuary.serve.follow import Follower, UpdateKind
from estuary.serve.metrics import ServeMetrics
from estuary.serve.model import ServingModel
from estuary.serve.preparer import Preparer
from estuary.serve.process_follow import ProcessFollower, model_from_prepared
from estuary.train.checkpoint import load_checkpoint
from estuary.train.checkpoint_chain import resolve_checkpoint

__all__ = ["ServeOptions", "Served", "freeze_heap", "open_served", "require", "run_server"]


def require(module: str) -> ModuleType:
    """Import an optional dependency of serving, or fail with the install hint."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"serving needs {module!r}: pip install 'estuary[serve]' ({exc})"
        ) from exc


@dataclass(frozen=True)
class ServeOptions:
    """How to serve.

    Args:
        host: the address to listen on.
        port: the TCP port (0: a free one).
        max_body_bytes: larger request bodies get 413.
        max_batch_rows: the most rows in one forward pass.
        max_wait_s: how long a batch waits for more requests.
        poll_s: ``--follow``: seconds between looks at the run's newest checkpoint.
        dense_every_s: ``--follow``: the least seconds between dense swaps
            (``0``: with every checkpoint; deltas apply at every checkpoint).
        threads: torch intra-op threads for the forward pass. 1 by default: a
            micro-batch's matmuls are small, and waking a second thread cost
            ~1 ms per layer on a busy 2-core machine (the forward of 8 rows took
            12 ms with 2 threads, 0.9 ms with 1).
        prepare: ``--follow``: ``"process"`` prepares each update in a child
            process and the server swaps it in whole (``ProcessFollower``);
            ``"thread"`` reads and applies it on a thread of the server (``Follower``).
        prepare_timeout_s: ``"process"``: a child that sends nothing this long
            while a checkpoint is pending is killed and replaced.
    """

    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = 8 << 20
    max_batch_rows: int = 1024
    max_wait_s: float = 0.001
    poll_s: float = 0.1
    dense_every_s: float = 0.0
    threads: int = 1
    prepare: str = "process"
    prepare_timeout_s: float = 60.0


@dataclass
class Served:
    """A model ready to serve, and its follower when it follows a run."""

    model: ServingModel
    metrics: ServeMetrics
    follower: Follower | ProcessFollower | None = None


def open_served(
    export_dir: Path | None,
    follow: Path | None,
    options: ServeOptions = ServeOptions(),
    *,
    process_follower: Callable[..., ProcessFollower] = ProcessFollower,
) -> Served:
    """An export folder's model, or a run's newest checkpoint with a follower
    (not started) that counts its updates in the metrics; ``process_follower``
    makes the follower of ``prepare="process"`` (a Ray Serve replica's shares
    its node's preparer: ``estuary.serve.node_follow.SharedFollower``)."""
    if follow is None:
        if export_dir is None:
            raise ValueError("serve: give an export folder or --follow RUN_DIR")
        model = load_export(export_dir)
        return Served(model, ServeMetrics(model))
    if options.prepare not in ("process", "thread"):
        raise ValueError(f"serve: prepare must be 'process' or 'thread', not {options.prepare!r}")
    follower: Follower | ProcessFollower
    if options.prepare == "process":
        prepared = Preparer(follow).load(resolve_checkpoint(follow))
        model = model_from_prepared(prepared)
        served_path = prepared.checkpoint
    else:
        ckpt = load_checkpoint(follow)
        model = model_from_checkpoint(ckpt, standby=True)  # deltas written off the request path
        served_path = ckpt.path
    metrics = ServeMetrics(model)

    def updated(kind: UpdateKind, age_s: float) -> None:
        metrics.updates.labels(kind.value).inc()
        metrics.freshness.observe(age_s)
        metrics.stall.observe(model.last_stall_s)
        metrics.update_cpu.observe(follower.last_cpu_s)
        if isinstance(follower, ProcessFollower):
            metrics.prepare_cpu.observe(follower.last_prepare_cpu_s)

    common: dict[str, Any] = {
        "poll_s": options.poll_s,
        "dense_every_s": options.dense_every_s,
        "on_update": updated,
        "on_failure": lambda exc: metrics.update_failures.inc(),
    }
    if options.prepare == "process":
        follower = process_follower(
            follow,
            model,
            served_path,
            progress_timeout_s=options.prepare_timeout_s,
            on_restart=lambda reason: metrics.prepare_restarts.labels(reason).inc(),
            **common,
        )
        metrics.follow_behind(lambda: follower.behind_s)  # type: ignore[union-attr]
    else:
        follower = Follower(follow, model, served_path, **common)
    return Served(model, metrics, follower)


def freeze_heap() -> int:
    """Collect garbage once, then move every object alive into the collector's
    permanent generation (``gc.freeze``); returns how many objects it holds.

    Why: a serving process holds ~300-400k objects tracked by the cyclic garbage
    collector (torch, numba, the web stack, the model), nearly all made at
    startup and alive for good. A full (generation 2) collection walks every one
    of them while holding the GIL: 215-250 ms measured at a load average of 6 on
    2 cores, during which no request is decoded, predicted or answered. Updates
    make such collections come: each version's header, views and tables live
    about a second, long enough to be promoted, and once the promoted objects
    reach a quarter of the old ones a full collection runs (one in each of 5
    ``bench/serve.py`` runs, 252-346 ms, 4 of them in a load under updates).
    Frozen objects are never walked again (a full collection then takes well
    under 1 ms); they are still freed by reference counting when dropped, only
    cycles among them are not.
    Call once, with the model built, before serving (docs/serving.md)."""
    gc.collect()  # Blocking: one full collection, before any request is served
    gc.freeze()
    return gc.get_freeze_count()


def run_server(served: Served, options: ServeOptions) -> None:
    """Serve until interrupted (blocking: uvicorn's loop runs in this thread)."""
    uvicorn = require("uvicorn")
    require("starlette")
    torch.set_num_threads(options.threads)
    from estuary.serve.app import create_app

    app = create_app(
        served.model,
        metrics=served.metrics,
        max_body_bytes=options.max_body_bytes,
        max_batch_rows=options.max_batch_rows,
        max_wait_s=options.max_wait_s,
    )
    freeze_heap()  # full collections walk only what serving allocates from here on
    if served.follower is not None:
        served.follower.start()
    try:
        uvicorn.run(app, host=options.host, port=options.port, log_level="warning")
    finally:
        if served.follower is not None:
            served.follower.stop()
