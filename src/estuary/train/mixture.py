"""Mixture training: each batch's ``UpdatePlan`` from the mixture's update rules.

``mixture_plan_for(model, tables)`` is the trainer's ``plan_for`` when the model
is a ``MixtureModel``: it reads the batch's origin (history or stream, by
``MixtureRules.kind``), tells the model the step's rule (a frozen tower's split
slice is read detached) and returns the plan::

    dense:  {"memory.": rule.memory, "adapt.": rule.adapt, "gate.": rule.gate}
            (a part at scale 0 is left out: frozen for the step)
    tables: {every table: rule.embeddings}  (left out at 0: an empty update)

Every rank of a multi-trainer step sees the same batch origin, so all give each
table the same scale, as the parameter server requires. With
``memory_learns_new_ids`` and several trainers, each history step's ids are
gathered from every rank (``MixturePlans.gather``), so every rank knows the same
history ids: a stream row's "new" columns do not depend on which rank trains it,
and the set rank 0 checkpoints is the whole history's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch
from torch import nn

from estuary.data.types import Batch
from estuary.nn.mixture import MixtureModel
from estuary.nn.mixture_rules import RowKind, Rule
from estuary.train.engine import UpdatePlan

__all__ = [
    "HistoryIds",
    "IdsGather",
    "MixturePlans",
    "find_mixture",
    "mixture_plan_for",
    "plan_of",
]

# This rank's int64 array -> every rank's, in rank order (a collective).
IdsGather = Callable[[np.ndarray], list[np.ndarray]]


def find_mixture(model: nn.Module) -> MixtureModel | None:
    """The ``MixtureModel`` that is ``model`` or its ``.module`` (a DDP wrapper)."""
    for candidate in (model, getattr(model, "module", None)):
        if isinstance(candidate, MixtureModel):
            return candidate
    return None


def plan_of(rule: Rule, tables: Iterable[str]) -> UpdatePlan:
    """The ``UpdatePlan`` of one rule over ``tables``."""
    dense = {
        f"{part}.": scale
        for part, scale in (("memory", rule.memory), ("adapt", rule.adapt), ("gate", rule.gate))
        if scale > 0
    }
    sparse = {name: rule.embeddings for name in tables} if rule.embeddings > 0 else {}
    return UpdatePlan(dense=dense, tables=sparse)


class HistoryIds:
    """The ids history rows had, per feature, to mark a stream row's new ones.

    An exact set per feature, in memory (grows with the history's vocabulary);
    saved with each checkpoint (``extra/history_ids.safetensors``: feature ->
    sorted int64 ids) and restored with it, so a resumed run knows them."""

    def __init__(self) -> None:
        self.seen: dict[str, set[int]] = {}

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        return {
            name: torch.from_numpy(np.sort(np.fromiter(ids, np.int64, len(ids))))
            for name, ids in self.seen.items()
        }

    def restore_state(self, tensors: dict[str, torch.Tensor] | None) -> None:
        self.seen = {name: set(t.numpy().tolist()) for name, t in (tensors or {}).items()}

    def add(self, batch: Batch) -> None:
        for name, ids in batch.sparse.items():
            self.seen.setdefault(name, set()).update(ids.values.tolist())

    def add_gathered(self, batch: Batch, features: Sequence[str], gather: IdsGather) -> None:
        """Add the ids of ``batch`` on every rank (``gather``, a collective every
        rank calls at the same step): each rank packs its distinct ids per
        feature as ``[count per feature..., ids...]``."""
        mine = [
            np.unique(batch.sparse[f].values) if f in batch.sparse else np.zeros(0, np.int64)
            for f in features
        ]
        packed = np.concatenate([np.array([u.size for u in mine], np.int64), *mine])
        for part in gather(packed.astype(np.int64, copy=False)):
            counts, ids = part[: len(features)], part[len(features) :]
            bounds = np.concatenate([[0], np.cumsum(counts)])
            for j, name in enumerate(features):
                if counts[j]:
                    values = ids[bounds[j] : bounds[j + 1]].tolist()
                    self.seen.setdefault(name, set()).update(values)

    def new(self, batch: Batch, features: Sequence[str]) -> torch.Tensor:
        """(B, F) bool: True where none of the row's ids of that feature was
        ever in a history row (an empty bag: False)."""
        out = np.zeros((batch.num_rows, len(features)), np.bool_)
        for j, name in enumerate(features):
            ids = batch.sparse.get(name)
            if ids is None or ids.values.size == 0:
                continue
            seen = self.seen.get(name, set())
            fresh = np.fromiter((v not in seen for v in ids.values.tolist()), np.bool_)
            lengths = np.diff(ids.offsets)
            rows = np.repeat(np.arange(batch.num_rows), lengths)
            stale = np.zeros(batch.num_rows, np.bool_)
            np.logical_or.at(stale, rows, ~fresh)
            out[:, j] = (lengths > 0) & ~stale
        return torch.from_numpy(out)


class MixturePlans:
    """The batch -> plan function of a mixture (``mixture_plan_for``); sets the
    model's rule for the step. ``history_ids``: the ids history rows had (with
    ``memory_learns_new_ids``, else ``None``), for the checkpoint; ``gather``:
    with several trainers, how history ids reach every rank (set by the
    distributed trainer; ``None``: this rank's batches only)."""

    def __init__(
        self, mixture: MixtureModel, tables: Iterable[str], features: Sequence[str] | None
    ) -> None:
        names = list(tables)
        self.mixture, self.rules, self.features = mixture, mixture.rules, features
        self.plans: dict[RowKind, UpdatePlan] = {
            "history": plan_of(self.rules.history, names),
            "stream": plan_of(self.rules.stream, names),
        }
        self.history_ids = HistoryIds() if mixture.memory_learns_new_ids else None
        self.gather: IdsGather | None = None

    def __call__(self, batch: Batch) -> UpdatePlan:
        kind = self.rules.kind(batch.origin)
        new = None
        if self.history_ids is not None:
            if kind == "history" and self.gather is not None:
                features = list(self.features or sorted(batch.sparse))
                self.history_ids.add_gathered(batch, features, self.gather)
            elif kind == "history":
                self.history_ids.add(batch)
            else:
                new = self.history_ids.new(batch, list(self.features or batch.sparse))
        labels = torch.from_numpy(batch.labels) if kind == "stream" else None
        self.mixture.use_rule(self.rules.rule(kind), labels, new)
        return self.plans[kind]


def mixture_plan_for(
    model: nn.Module, tables: Iterable[str], features: Sequence[str] | None = None
) -> MixturePlans | None:
    """The batch -> plan function of a mixture ``model`` (``None`` for any other).

    ``features``: the model's sparse features in its (B, F, D) order (default:
    the batch's ``sparse`` order), for ``memory_learns_new_ids``."""
    mixture = find_mixture(model)
    if mixture is None:
        return None
    return MixturePlans(mixture, tables, features)
