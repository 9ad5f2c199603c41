"""Build a job's training parts from its ``TrainPlan``: tables, the embedding
collection, the model on its device, the dense optimizer, and the ``Engine``
that steps them."""

from __future__ import annotations

import random
from collections.abc import Callable, Container, Mapping
from typing import Protocol

import numpy as np
import torch
from torch import nn

from estuary import plugins
from estuary.config import JobSpec
from estuary.embedding import EmbeddingStore, EmbeddingTable
from estuary.nn.embedding_collection import EmbeddingCollection
from estuary.nn.models import accepts_sequences, build_model
from estuary.registry import Registry
from estuary.train.engine import Engine, resolve_device
from estuary.train.plan import TrainPlan
from estuary.train.sparse_updates import LockedStore

__all__ = [
    "DENSE_OPTIMIZERS",
    "TableStore",
    "build_collection",
    "build_engine",
    "build_tables",
    "seed_everything",
]

DENSE_OPTIMIZERS: Registry[Callable[..., torch.optim.Optimizer]] = plugins.DENSE_OPTIMIZERS
"""``train.dense_optimizer.name`` -> torch optimizer class (adam, adamw, adagrad, sgd)."""


class TableStore(EmbeddingStore, Protocol):
    """A table the trainer can also checkpoint (``EmbeddingTable``, ``RemoteTable``)."""

    def state_dict(self) -> dict[str, np.ndarray]: ...

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None: ...

    def delta_state_dict(self) -> dict[str, np.ndarray]: ...

    def apply_delta(self, delta: dict[str, np.ndarray]) -> None: ...


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def build_tables(
    plan: TrainPlan, external: Mapping[str, TableStore] | None
) -> dict[str, TableStore]:
    """One table per entry of the plan: in-process ``EmbeddingTable``s, or the
    ``external`` ones (e.g. a parameter server's), checked against the plan."""
    tables: dict[str, TableStore] = {}
    for name, spec in plan.tables.items():
        if external is not None:
            if name not in external or external[name].dim != spec.dim:
                raise ValueError(f"tables: need table {name!r} with dim {spec.dim}")
            tables[name] = external[name]
        else:
            tables[name] = EmbeddingTable(spec, seed=plan.seeds[name], name=name)
    return tables


def build_collection(
    plan: TrainPlan, stores: Mapping[str, EmbeddingStore], jagged: Container[str]
) -> EmbeddingCollection:
    """The plan's embedding collection over ``stores`` (table -> store).

    ``pooling: none`` leaves sequence features unpooled (the model gets them
    padded); a one-id feature (not in ``jagged``, the features whose rows may
    hold several ids) is already unpooled and stays in (B, F, D)."""
    features = list(plan.features)
    pooling = {f: plan.tables[plan.feature_tables[f]].pooling for f in features}
    pooling = {f: "sum" if p == "none" and f not in jagged else p for f, p in pooling.items()}
    return EmbeddingCollection(features, dict(stores), plan.feature_tables, pooling)


def build_engine(
    job: JobSpec,
    plan: TrainPlan,
    tables: Mapping[str, TableStore],
    *,
    external: bool,
    num_dense: int,
    jagged: Container[str],
    model: nn.Module | None,
) -> Engine:
    """The job's engine over ``tables``.

    Args:
        external: the tables lock themselves (a parameter server's): a
            ``LockedStore`` would hold its lock through the server's staleness
            wait and so block the push that ends the wait.
        num_dense: Dd.
        jagged: features whose rows may hold several ids.
        model: a user's model, or ``None`` to build ``job.model.type``.
    """
    stores: dict[str, EmbeddingStore] = (
        dict(tables) if external else {name: LockedStore(t) for name, t in tables.items()}
    )
    features = list(plan.features)
    embeddings = build_collection(plan, stores, jagged)
    sequence_features = embeddings.sequence_features
    if model is not None and sequence_features and not accepts_sequences(model):
        raise TypeError(
            f"features {sequence_features} have pooling: none, so the model is called as "
            f"forward(dense, sparse, sequences); accept the third argument or wrap the "
            f"model in estuary.nn.SequencePooling"
        )
    model = model or build_model(
        job.model.type,
        job.model.params,
        num_dense=num_dense,
        num_sparse=len(features),
        embedding_dim=embeddings.dim,
        features=features,
        sequence_features=sequence_features,
    )
    # The dense network runs on `device`; tables stay in host memory, looked-up
    # rows go to the device and their gradients come back through autograd.
    device = resolve_device(job.train.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    model.to(device)
    opt = job.train.dense_optimizer
    optimizer = DENSE_OPTIMIZERS.get(opt.name, "train.dense_optimizer.name")(
        model.parameters(), lr=opt.lr, weight_decay=opt.weight_decay
    )
    return Engine(model, embeddings, stores, optimizer, job.train, device)
