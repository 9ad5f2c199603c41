"""A training checkpoint as a ``ServingModel``: the job stored in its manifest,
its version name, its dense weights and its tables (a delta's chain replayed)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from estuary.config import JobSpec, job_from_dict
from estuary.embedding.delta import CHAIN_PREFIX, EVICTED_IDS, IDS, UNKNOWN_PREFIX, WEIGHTS
from estuary.serve.model import ServingModel
from estuary.serve.pipeline import FeaturePipeline
from estuary.train.checkpoint import Checkpoint
from estuary.train.checkpoint_chain import MANIFEST, CheckpointError

__all__ = [
    "job_in_manifest",
    "job_of",
    "model_from_checkpoint",
    "serving_key",
    "serving_rows",
    "version_of",
]

# What a lookup reads: row keys and weights, the ids a delta evicts, the unknown
# rows, and the chain keys a delta is checked against. Optimizer slots, eviction
# stamps, pending admissions and clocks only matter to training.
_SERVING_KEYS = (IDS, WEIGHTS, EVICTED_IDS, UNKNOWN_PREFIX + WEIGHTS)


def job_of(ckpt: Checkpoint) -> JobSpec:
    """The job a checkpoint was written by (stored in its manifest).

    Raises:
        CheckpointError: the manifest holds no job (written by code, not a run).
    """
    return job_in_manifest(ckpt.manifest, ckpt.path)


def job_in_manifest(manifest: Mapping[str, Any], folder: Path) -> JobSpec:
    """The job stored in checkpoint ``folder``'s ``manifest`` (``job_of``)."""
    data = manifest.get("metadata", {}).get("job")
    if data is None:
        raise CheckpointError(
            f"{folder / MANIFEST}: no job in metadata.job; serving needs the job's "
            "schema and model (checkpoints written by `estuary train` have it)"
        )
    return job_from_dict(data)


def version_of(job: JobSpec, ckpt: Checkpoint) -> str:
    """The model version a checkpoint serves as: ``<job name>@<checkpoint folder>``
    (e.g. ``ctr@step-000000120``); names increase with the step."""
    return f"{job.name}@{ckpt.path.name}"


def serving_key(key: str) -> bool:
    """Whether serving reads a table state's ``key`` (see ``serving_rows``)."""
    return key in _SERVING_KEYS or key.startswith(CHAIN_PREFIX)


def serving_rows(state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The part of a table state (full or delta) that serving reads: applying a
    delta of only these writes ~1/3 of the bytes with Adagrad (weights, not the
    optimizer slots) and skips the admission and clock state, so requests wait
    less for it."""
    return {k: v for k, v in state.items() if serving_key(k)}


def model_from_checkpoint(ckpt: Checkpoint, *, standby: bool = False) -> ServingModel:
    """A ``ServingModel`` holding ``ckpt``'s dense network (eager, built from the
    job's ``model.type``) and tables (``restore_tables``: the chain replayed);
    ``standby``: also a standby copy of the tables, for updates off the request
    path (``ServingModel.keep_standby``)."""
    job = job_of(ckpt)
    model = ServingModel(job, FeaturePipeline.from_job(job), version_of(job, ckpt))
    ckpt.restore_dense(model.dense_model, None)
    ckpt.restore_tables(model.tables)
    if standby:
        model.keep_standby(ckpt.restore_tables)
    return model
