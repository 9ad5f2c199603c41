"""Torch modules: the embedding bridge to the tables and reference models."""

from estuary.nn.embedding_collection import EmbeddingCollection, SparseGradients
from estuary.nn.models import DLRM, DCNv2, DeepFM, LogisticRegression, build_model, register_model

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
