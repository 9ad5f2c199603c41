"""Estuary: PyTorch-native training for large-scale recommendation models.

Embeddings live in hash-keyed CPU tables (raw 64-bit ids, no fixed vocabulary)
with row-wise optimizers; the dense network is plain torch. The public API::

    job = estuary.load_job("examples/criteo.yaml")      # or job_from_dict({...})
    trainer = estuary.Trainer(job, model=my_module)      # model optional
    result = trainer.fit()                               # result.auc, result.logloss
"""

from estuary.config import ConfigError, JobSpec, job_from_dict, load_job
from estuary.embedding import EmbeddingTable
from estuary.nn import DLRM, DCNv2, DeepFM, EmbeddingCollection, register_model
from estuary.train import FitResult, Trainer

__version__ = "0.1.0"

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
