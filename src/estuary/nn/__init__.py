"""Torch modules: the embedding bridge to the tables and reference models."""

from estuary.nn.embedding_collection import EmbeddingCollection, SparseGradients
from estuary.nn.models import (
    DLRM,
    DCNv2,
    DeepFM,
    LogisticRegression,
    accepts_sequences,
    build_model,
    register_model,
)
from estuary.nn.sequence_pooling import (
    AttentionPooling,
    SequencePooling,
    TargetAttention,
    register_sequence_pooling,
)
from estuary.nn.types import SequenceEmbedding, Sequences

__all__ = [
    "DLRM",
    "AttentionPooling",
    "DCNv2",
    "DeepFM",
    "EmbeddingCollection",
    "LogisticRegression",
    "SequenceEmbedding",
    "SequencePooling",
    "Sequences",
    "SparseGradients",
    "TargetAttention",
    "accepts_sequences",
    "build_model",
    "register_model",
    "register_sequence_pooling",
]
