"""A training checkpoint as a ``ServingModel``: the job stored in its manifest,
its version name, its dense weights and its tables (a delta's chain replayed)."""

from __future__ import annotations

from estuary.config import JobSpec, job_from_dict
from estuary.serve.model import ServingModel
from estuary.serve.pipeline import FeaturePipeline
from estuary.train.checkpoint import Checkpoint
from estuary.train.checkpoint_chain import MANIFEST, CheckpointError

__all__ = ["job_of", "model_from_checkpoint", "version_of"]


def job_of(ckpt: Checkpoint) -> JobSpec:
    """The job a checkpoint was written by (stored in its manifest).

    Raises:
        CheckpointError: the manifest holds no job (written by code, not a run).
    """
    data = ckpt.manifest.get("metadata", {}).get("job")
    if data is None:
        raise CheckpointError(
            f"{ckpt.path / MANIFEST}: no job in metadata.job; serving needs the job's "
            "schema and model (checkpoints written by `estuary train` have it)"
        )
    return job_from_dict(data)


def version_of(job: JobSpec, ckpt: Checkpoint) -> str:
    """The model version a checkpoint serves as: ``<job name>@<checkpoint folder>``
    (e.g. ``ctr@step-000000120``); names increase with the step."""
    return f"{job.name}@{ckpt.path.name}"


def model_from_checkpoint(ckpt: Checkpoint) -> ServingModel:
    """A ``ServingModel`` holding ``ckpt``'s dense network (eager, built from the
    job's ``model.type``) and tables (``restore_tables``: the chain replayed)."""
    job = job_of(ckpt)
    model = ServingModel(job, FeaturePipeline.from_job(job), version_of(job, ckpt))
    ckpt.restore_dense(model.dense_model, None)
    ckpt.restore_tables(model.tables)
    return model
