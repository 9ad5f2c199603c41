"""Typed job specification: YAML/dict -> validated frozen dataclasses.

Typical use::

    from estuary.config import load_job

    job = load_job("examples/criteo/job.yaml", overrides=["train.epochs=3"])
    job.resolve(job.data.sources[0].path)  # relative to the job file's folder
    job.table_spec("C1")                   # default merged with its override, at load

Every mistake raises ``ConfigError`` whose message starts with the field path
(``train.batch_size: expected int, got str 'abc'``). See ``docs/job-spec.md``.
"""

from estuary.config.dataset import (
    BatchSourceSpec,
    DatasetSpec,
    ExecutorSpec,
    JoinSpec,
    ShuffleSpec,
    StreamSpec,
    TimerSpec,
)
from estuary.config.errors import ConfigError
from estuary.config.loader import job_from_dict, load_job, to_dict
from estuary.config.spec import (
    AdmissionSpec,
    DataSpec,
    DenseOptimizerSpec,
    DiskSpec,
    EmbeddingSpec,
    EvictionSpec,
    InitializerSpec,
    JobSpec,
    ModelSpec,
    OutputSpec,
    RuntimeSpec,
    SchemaSpec,
    SourceSpec,
    SparseOptimizerSpec,
    TableSpec,
    TrainSpec,
)

__all__ = [
    "AdmissionSpec",
    "BatchSourceSpec",
    "ConfigError",
    "DataSpec",
    "DatasetSpec",
    "DenseOptimizerSpec",
    "DiskSpec",
    "EmbeddingSpec",
    "EvictionSpec",
    "ExecutorSpec",
    "InitializerSpec",
    "JobSpec",
    "JoinSpec",
    "ModelSpec",
    "OutputSpec",
    "RuntimeSpec",
    "SchemaSpec",
    "ShuffleSpec",
    "SourceSpec",
    "SparseOptimizerSpec",
    "StreamSpec",
    "TableSpec",
    "TimerSpec",
    "TrainSpec",
    "job_from_dict",
    "load_job",
    "to_dict",
]
