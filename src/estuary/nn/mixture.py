"""A mixture of two towers: a **memory** tower that keeps what the history
taught, and an **adapt** tower that follows the live stream (docs/mixture.md).

::

    sparse (B, F, D) --shared--> memory tower (D)  -> m (B,)
                     \\-shared--> adapt tower (D)   -> a (B,)
    or, ``embeddings: split`` (table dim D = Dm + Da):
    sparse[..., :Dm] -> memory tower,  sparse[..., Dm:] -> adapt tower

    combine: sum   logit = m + a
             gate  logit = m + g * a,  g = gate([dense, |e_1|, ..., |e_F|])  (B,)
    evidence_rows: N > 0   the adapt term times pi = sigmoid(L_m - L_full), the
             posterior of "memory + adapt" against "memory alone" from their log
             losses over the last ~N stream rows (decayed; labels of a step are
             added after its forward)

The gate is a per-row weight of the adapt tower, zero at the start (its last
layer starts at zero): until stream rows teach it, the mixture is its memory
tower alone, so history rows can train the memory tower exactly as a model of
its own (rules ``history: {adapt: 0, gate: 0}``). It reads each row's dense
features and the norm of each of its F embedding vectors (detached): a
never-seen id has a fresh row, so the norms tell the gate how new a row's ids
are. Each tower is any registered model (``model.type`` names) built with its
own ``params``.

``score_as("history")`` makes evaluation (``model.eval()``) answer with the
memory tower alone: scoring replayed history rows as history (a row's kind is its
origin; a serving path that knows it may do the same). ``score_as(None)``, the
default, scores every row with the whole mixture.

Which rows train which part is ``update`` (``MixtureRules``); the training loop
calls ``use_rule`` before each step. With split tables, a tower frozen for a
step (scale 0) reads its slice detached, so its slice of the rows gets no
gradient: stream rows never move the memory tower's vectors, except, with
``memory_learns_new_ids``, those of ids no history row had (``new_ids`` of
``use_rule``), which learn through the frozen memory tower.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import nn

from estuary.errors import ConfigError
from estuary.nn.mixture_rules import MixtureRules, RowKind, Rule
from estuary.nn.models import _build_registered

__all__ = ["MixtureModel", "mixture"]

Combine = Literal["sum", "gate"]
AdaptReads = Literal["own", "all"]


def _tower(spec: Any, path: str, num_dense: int, num_sparse: int, embedding_dim: int) -> nn.Module:
    """The registered model ``spec = {type, params}`` (errors name ``path``)."""
    if not isinstance(spec, Mapping) or "type" not in spec:
        raise ConfigError(path, "expected {type: <registered model>, params: {...}}")
    unknown = set(spec) - {"type", "params"}
    if unknown:
        raise ConfigError(f"{path}.{sorted(unknown)[0]}", "unknown field; known: type, params")
    name = spec["type"]
    if name == "mixture":
        raise ConfigError(f"{path}.type", "a tower cannot itself be a mixture")
    try:
        return _build_registered(
            name, dict(spec.get("params") or {}), num_dense, num_sparse, embedding_dim
        )
    except ConfigError as exc:  # model.params.X -> <path>.params.X
        field = exc.path.removeprefix("model.params")
        if exc.path.startswith("model.params"):
            raise ConfigError(f"{path}.params{field}", exc.reason) from exc
        if exc.path == "model.type":
            raise ConfigError(f"{path}.type", exc.reason) from exc
        raise ConfigError(f"{path} ({exc.path})", exc.reason) from exc


class MixtureModel(nn.Module):
    """Memory tower + adapt tower (+ gate); ``forward(dense, sparse) -> logits``.

    Args:
        memory, adapt: the towers.
        combine: ``sum`` or ``gate``.
        memory_dim: ``None``: both towers read all D columns (shared tables);
            else the memory tower reads columns ``[:memory_dim]`` and the adapt
            tower ``[memory_dim:]`` (split tables).
        gate: with ``combine: gate``, ``(B, Dd + F) -> (B, 1)``.
        rules: which rows update what.
        adapt_reads: with split tables, ``own`` (its columns) or ``all`` (the
            memory columns, detached, then its own: it learns from the memory's
            trained vectors without moving them).
    """

    def __init__(
        self,
        memory: nn.Module,
        adapt: nn.Module,
        *,
        combine: Combine,
        memory_dim: int | None,
        gate: nn.Module | None,
        rules: MixtureRules,
        adapt_reads: AdaptReads = "own",
        evidence_rows: int = 0,
        memory_learns_new_ids: bool = False,
    ) -> None:
        super().__init__()
        self.memory_learns_new_ids = memory_learns_new_ids
        self._new: torch.Tensor | None = None  # (B, F) bool of the next step
        self.adapt_reads = adapt_reads
        self.evidence_rows = evidence_rows
        # Decayed sums of the log loss of the two experts (memory alone; memory +
        # gated adapt) over the last ~evidence_rows stream training rows.
        self.evidence: torch.Tensor
        self.register_buffer("evidence", torch.zeros(2, dtype=torch.float64))
        self._labels: torch.Tensor | None = None
        self.memory, self.adapt, self.gate = memory, adapt, gate
        self.combine, self.memory_dim, self.rules = combine, memory_dim, rules
        self.rule: Rule = rules.history  # the rule of the step in progress
        # (B,) of the last forward, for inspection: the gate's weight of the adapt
        # tower (None with combine: sum).
        self.last_gate: torch.Tensor | None = None
        self.scoring: RowKind | None = None

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        # A checkpoint from before ``evidence`` existed: start with no evidence.
        state_dict.setdefault(prefix + "evidence", torch.zeros_like(self.evidence))
        super()._load_from_state_dict(state_dict, prefix, *args)

    def score_as(self, kind: RowKind | None) -> None:
        """``"history"``: evaluation answers with the memory tower alone;
        ``None``: with the whole mixture (training always uses the whole)."""
        self.scoring = kind

    def use_rule(
        self,
        rule: Rule,
        labels: torch.Tensor | None = None,
        new_ids: torch.Tensor | None = None,
    ) -> None:
        """The rule of the next training step (frozen towers' slices detached),
        the labels of a *stream* step's rows (with ``evidence_rows``, the step
        adds its rows' losses to the evidence *after* its forward: the step's
        own logits never see its labels; ``None`` for history) and ``new_ids``
        (B, F): True where a row's ids of a feature were never in a history row
        (with ``memory_learns_new_ids`` and split tables, those memory columns
        are not detached on a frozen memory step: they learn through the frozen
        memory tower)."""
        self.rule = rule
        self._labels = labels
        self._new = new_ids

    def adapt_weight(self) -> float:
        """The posterior weight of the expert with the adapt tower (1 without
        ``evidence_rows``): ``sigmoid(L_memory - L_mixture)``, the decayed sums
        of each expert's log loss over the last ~``evidence_rows`` stream rows."""
        if self.evidence_rows <= 0:
            return 1.0
        return float(torch.sigmoid(self.evidence[0] - self.evidence[1]))

    def _observe(self, m: torch.Tensor, full: torch.Tensor) -> None:
        labels = self._labels
        self._labels = None
        if labels is None or self.evidence_rows <= 0:
            return
        y = labels.to(torch.float64).reshape(-1)
        with torch.no_grad():
            logits = torch.stack([m.detach(), full.detach()]).to(torch.float64)
            loss = nn.functional.binary_cross_entropy_with_logits(
                logits, y.expand_as(logits), reduction="none"
            ).sum(dim=1)
            decay = (1.0 - 1.0 / self.evidence_rows) ** len(y)
            self.evidence.mul_(decay).add_(loss)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        if self.memory_dim is None:
            mem_in = adapt_in = sparse
        else:
            mem_in, adapt_in = sparse[..., : self.memory_dim], sparse[..., self.memory_dim :]
            new, self._new = self._new, None
            if self.training and self.rule.memory == 0:
                if self.memory_learns_new_ids and new is not None:
                    mem_in = torch.where(new.unsqueeze(-1), mem_in, mem_in.detach())
                else:
                    mem_in = mem_in.detach()
            if self.training and self.rule.adapt == 0:
                adapt_in = adapt_in.detach()
            if self.adapt_reads == "all":  # the memory columns as read-only features
                adapt_in = torch.cat([mem_in.detach(), adapt_in], dim=-1)
        m = self.memory(dense, mem_in)  # (B,)
        if not self.training and self.scoring == "history":
            return m
        a = self.adapt(dense, adapt_in)  # (B,)
        if self.gate is None:
            self.last_gate = None
            ga = a
        else:
            norms = sparse.detach().norm(dim=2)  # (B, F): small for fresh ids
            g = self.gate(torch.cat([dense, norms], dim=1)).squeeze(1)  # (B,)
            self.last_gate = g.detach()
            ga = g * a
        if self.evidence_rows <= 0:
            return m + ga
        pi = self.adapt_weight()  # from the rows before this step's
        if self.training:
            self._observe(m, m + ga)
        return m + pi * ga


def mixture(
    num_dense: int,
    num_sparse: int,
    embedding_dim: int,
    memory: Mapping[str, Any] | None = None,
    adapt: Mapping[str, Any] | None = None,
    combine: str = "sum",
    embeddings: str = "shared",
    memory_dim: int | None = None,
    gate_hidden: int = 0,
    update: Mapping[str, Any] | None = None,
    adapt_reads: str = "own",
    evidence_rows: int = 0,
    memory_learns_new_ids: bool = False,
) -> MixtureModel:
    """``model.type: mixture`` (see the module docstring and docs/mixture.md).

    Args:
        memory, adapt: ``{type: <registered model>, params: {...}}`` of each tower.
        combine: ``sum`` (of logits) or ``gate`` (a learned per-row weight of
            the adapt tower, zero at the start).
        embeddings: ``shared`` (both towers read whole rows) or ``split`` (one
            table row holds both towers' vectors; ``memory_dim`` columns are the
            memory tower's).
        memory_dim: the memory tower's columns with ``embeddings: split``.
        adapt_reads: with split tables, ``own`` (the adapt tower reads its
            columns) or ``all`` (the memory columns, detached, and its own).
        gate_hidden: hidden units of the gate (0: a linear gate).
        update: the update rules (``MixtureRules``).
        evidence_rows: > 0: the adapt tower's term is weighted by the posterior
            of the expert with it against the memory tower alone, from their
            log losses over the last ~``evidence_rows`` stream rows (0: off).
        memory_learns_new_ids: with split tables, stream rows train the memory
            columns of ids no history row had (through the frozen memory tower);
            the columns of history ids stay frozen.
    """
    path = "model.params"
    if memory is None or adapt is None:
        raise ConfigError(f"{path}.{'memory' if memory is None else 'adapt'}", "required")
    if combine not in ("sum", "gate"):
        raise ConfigError(f"{path}.combine", f"expected sum or gate, got {combine!r}")
    if embeddings not in ("shared", "split"):
        raise ConfigError(f"{path}.embeddings", f"expected shared or split, got {embeddings!r}")
    if embeddings == "split":
        if memory_dim is None or not 0 < memory_dim < embedding_dim:
            raise ConfigError(
                f"{path}.memory_dim",
                f"embeddings: split needs 0 < memory_dim < the table dim {embedding_dim}, "
                f"got {memory_dim}",
            )
        mem_dim, adapt_dim = memory_dim, embedding_dim - memory_dim
        if adapt_reads not in ("own", "all"):
            raise ConfigError(f"{path}.adapt_reads", f"expected own or all, got {adapt_reads!r}")
        if adapt_reads == "all":
            adapt_dim = embedding_dim
    else:
        if adapt_reads != "own":
            raise ConfigError(f"{path}.adapt_reads", "only with embeddings: split")
        if memory_dim is not None:
            raise ConfigError(f"{path}.memory_dim", "only with embeddings: split")
        mem_dim = adapt_dim = embedding_dim
    if gate_hidden < 0:
        raise ConfigError(f"{path}.gate_hidden", f"expected >= 0, got {gate_hidden}")
    if isinstance(evidence_rows, bool) or not isinstance(evidence_rows, int) or evidence_rows < 0:
        raise ConfigError(f"{path}.evidence_rows", f"expected an int >= 0, got {evidence_rows!r}")
    if not isinstance(memory_learns_new_ids, bool):
        raise ConfigError(f"{path}.memory_learns_new_ids", "expected true or false")
    if memory_learns_new_ids and embeddings != "split":
        raise ConfigError(f"{path}.memory_learns_new_ids", "only with embeddings: split")
    rules = MixtureRules.parse(update, f"{path}.update")
    # The memory tower is built first: it draws its initial weights as the same
    # model built alone would (same seed), so it can be compared with one.
    memory_tower = _tower(memory, f"{path}.memory", num_dense, num_sparse, mem_dim)
    adapt_tower = _tower(adapt, f"{path}.adapt", num_dense, num_sparse, adapt_dim)
    gate: nn.Module | None = None
    if combine == "gate":
        width = num_dense + num_sparse
        gate = (
            nn.Sequential(nn.Linear(width, gate_hidden), nn.ReLU(), nn.Linear(gate_hidden, 1))
            if gate_hidden
            else nn.Linear(width, 1)
        )
        last = gate[-1] if isinstance(gate, nn.Sequential) else gate
        assert isinstance(last, nn.Linear)
        nn.init.zeros_(last.weight)  # g = 0: the memory tower alone until trained
        nn.init.zeros_(last.bias)
    return MixtureModel(
        memory_tower,
        adapt_tower,
        combine=combine,  # type: ignore[arg-type]
        memory_dim=memory_dim if embeddings == "split" else None,
        gate=gate,
        rules=rules,
        adapt_reads=adapt_reads,  # type: ignore[arg-type]
        evidence_rows=evidence_rows,
        memory_learns_new_ids=memory_learns_new_ids,
    )
