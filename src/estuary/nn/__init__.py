"""Torch modules: the embedding bridge to the tables and reference models."""

from estuary.nn.embedding_collection import EmbeddingCollection, SparseGradients
from estuary.nn.models import DCNv2, DeepFM, DLRM, LogisticRegression, build_model, register_model

__all__ = [
    "DLRM",
    "DCNv2",
    "DeepFM",
    "EmbeddingCollection",
    "LogisticRegression",
    "SparseGradients",
    "build_model",
    "register_model",
]
