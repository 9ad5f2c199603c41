"""Estuary: PyTorch-native training for large-scale recommendation models.

Embeddings live in hash-keyed CPU tables (raw 64-bit ids, no fixed vocabulary)
with row-wise optimizers; the dense network is plain torch. The public API::

    job = estuary.load_job("examples/criteo.yaml")      # or job_from_dict({...})
    trainer = estuary.Trainer(job, model=my_module)      # model optional
    result = trainer.fit()                               # result.auc, result.logloss

Names are imported on first use, so processes that need only part of the package
(a parameter-server process, ``estuary synth``) never import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "ConfigError": "estuary.config",
    "JobSpec": "estuary.config",
    "job_from_dict": "estuary.config",
    "load_job": "estuary.config",
    "EmbeddingTable": "estuary.embedding",
    "DLRM": "estuary.nn",
    "DCNv2": "estuary.nn",
    "DeepFM": "estuary.nn",
    "EmbeddingCollection": "estuary.nn",
    "register_model": "estuary.nn",
    "FitResult": "estuary.train",
    "Trainer": "estuary.train",
}

__all__ = [
    "DLRM",
    "ConfigError",
    "DCNv2",
    "DeepFM",
    "EmbeddingCollection",
    "EmbeddingTable",
    "FitResult",
    "JobSpec",
    "Trainer",
    "__version__",
    "job_from_dict",
    "load_job",
    "register_model",
]

if TYPE_CHECKING:
    from estuary.config import ConfigError, JobSpec, job_from_dict, load_job
    from estuary.embedding import EmbeddingTable
    from estuary.nn import DLRM, DCNv2, DeepFM, EmbeddingCollection, register_model
    from estuary.train import FitResult, Trainer


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'estuary' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
