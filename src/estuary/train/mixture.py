"""Mixture training: each batch's ``UpdatePlan`` from the mixture's update rules.

``mixture_plan_for(model, tables)`` is the trainer's ``plan_for`` when the model
is a ``MixtureModel``: it reads the batch's origin (history or stream, by
``MixtureRules.kind``), tells the model the step's rule (a frozen tower's split
slice is read detached) and returns the plan::

    dense:  {"memory.": rule.memory, "adapt.": rule.adapt, "gate.": rule.gate}
            (a part at scale 0 is left out: frozen for the step)
    tables: {every table: rule.embeddings}  (left out at 0: an empty update)

Every rank of a multi-trainer step sees the same batch origin, so all give each
table the same scale, as the parameter server requires.
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

__all__ = ["HistoryIds", "find_mixture", "mixture_plan_for", "plan_of"]


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

    An exact set per feature, in memory (grows with the history's vocabulary;
    rebuilt from nothing on a restart: see docs/mixture.md)."""

    def __init__(self) -> None:
        self.seen: dict[str, set[int]] = {}

    def add(self, batch: Batch) -> None:
        for name, ids in batch.sparse.items():
            self.seen.setdefault(name, set()).update(ids.values.tolist())

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


def mixture_plan_for(
    model: nn.Module, tables: Iterable[str], features: Sequence[str] | None = None
) -> Callable[[Batch], UpdatePlan] | None:
    """The batch -> plan function of a mixture ``model`` (``None`` for any other).

    ``features``: the model's sparse features in its (B, F, D) order (default:
    the batch's ``sparse`` order), for ``memory_learns_new_ids``."""
    mixture = find_mixture(model)
    if mixture is None:
        return None
    names = list(tables)
    rules = mixture.rules
    plans: dict[RowKind, UpdatePlan] = {
        "history": plan_of(rules.history, names),
        "stream": plan_of(rules.stream, names),
    }
    history_ids = HistoryIds() if mixture.memory_learns_new_ids else None

    def plan_for(batch: Batch) -> UpdatePlan:
        kind = rules.kind(batch.origin)
        new = None
        if history_ids is not None:
            if kind == "history":
                history_ids.add(batch)
            else:
                new = history_ids.new(batch, list(features or batch.sparse))
        labels = torch.from_numpy(batch.labels) if kind == "stream" else None
        mixture.use_rule(rules.rule(kind), labels, new)
        return plans[kind]

    return plan_for
