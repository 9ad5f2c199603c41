"""Hash-keyed CPU embedding tables with row-wise sparse optimizers.

``EmbeddingTable`` (sharded) and ``EmbeddingShard`` implement ``EmbeddingStore``;
``HashIndex`` is the numba id -> slot map underneath. Optimizers and initializers
are found by name in registries (``register_optimizer``, ``register_initializer``).
"""

from estuary.embedding.admission import AdmissionFilter
from estuary.embedding.hash_index import HashIndex
from estuary.embedding.initializers import Initializer, make_initializer, register_initializer
from estuary.embedding.optimizers import SparseOptimizer, make_optimizer, register_optimizer
from estuary.embedding.shard import EmbeddingShard
from estuary.embedding.table import EmbeddingTable
from estuary.embedding.types import EmbeddingStore, TableStats

__all__ = [
    "AdmissionFilter",
    "EmbeddingShard",
    "EmbeddingStore",
    "EmbeddingTable",
    "HashIndex",
    "Initializer",
    "SparseOptimizer",
    "TableStats",
    "make_initializer",
    "make_optimizer",
    "register_initializer",
    "register_optimizer",
]
