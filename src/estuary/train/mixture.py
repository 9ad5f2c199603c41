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

from collections.abc import Callable, Iterable

import torch
from torch import nn

from estuary.data.types import Batch
from estuary.nn.mixture import MixtureModel
from estuary.nn.mixture_rules import RowKind, Rule
from estuary.train.engine import UpdatePlan

__all__ = ["find_mixture", "mixture_plan_for", "plan_of"]


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


def mixture_plan_for(
    model: nn.Module, tables: Iterable[str]
) -> Callable[[Batch], UpdatePlan] | None:
    """The batch -> plan function of a mixture ``model`` (``None`` for any other)."""
    mixture = find_mixture(model)
    if mixture is None:
        return None
    names = list(tables)
    rules = mixture.rules
    plans: dict[RowKind, UpdatePlan] = {
        "history": plan_of(rules.history, names),
        "stream": plan_of(rules.stream, names),
    }

    def plan_for(batch: Batch) -> UpdatePlan:
        kind = rules.kind(batch.origin)
        mixture.use_rule(rules.rule(kind), torch.from_numpy(batch.labels))
        return plans[kind]

    return plan_for
