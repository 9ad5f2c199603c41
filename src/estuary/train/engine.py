"""One training step, and nothing else: no data, epochs, checkpoints or stops.

::

    Engine.lookup(batch)                 dedup, gather, pool -> LookedUpBatch (numpy)
    Engine.step(batch, looked_up, updater, plan)
      embed -> model(dense (B, Dd), sparse (B, F, D)[, sequences]) -> logits (B,)
      -> BCE loss (mean over B, or per-row ``batch.weights``) -> backward
      -> dense optimizer step  (the plan's parameter groups, each at its lr scale)
      -> SparseUpdater.submit   (the plan's tables, each at its lr scale; sync: applied
                                 now, else queued)
    Engine.predict(batch)                probabilities (B,), no id inserted

An ``UpdatePlan`` says what one batch updates. The default (``UpdatePlan()``,
or ``None``) updates everything at the configured learning rates: exactly the
step the trainer always took. Mixture training (history rows updating one tower,
stream rows another) picks a plan per batch, e.g. from ``Batch.origin``.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from estuary.config.spec import TrainSpec
from estuary.data.types import Batch
from estuary.embedding import EmbeddingStore
from estuary.nn.embedding_collection import EmbeddingCollection, LookedUpBatch, SparseGradients
from estuary.nn.types import SequenceEmbedding, Sequences
from estuary.train.pipeline import Prefetcher, StageTimes
from estuary.train.placement import Placement
from estuary.train.sparse_updates import SparseUpdater

__all__ = ["Engine", "RowLoss", "UpdatePlan", "resolve_device"]


def resolve_device(name: str) -> torch.device:
    """``train.device`` -> a torch device: ``auto`` takes CUDA when present."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "train.device: 'cuda' requested but torch sees no CUDA device "
            f"(torch {torch.__version__}, built with CUDA: {torch.version.cuda or 'no'})"
        )
    return torch.device(name)


@dataclass(frozen=True)
class UpdatePlan:
    """What one step updates.

    Args:
        dense: parameter-name prefix (``model.named_parameters()``, e.g.
            ``memory_tower.``; ``""`` matches all) -> learning-rate scale. A
            parameter takes the scale of its longest matching prefix; one that
            matches none is frozen for the step (its optimizer state untouched).
            ``None``: every parameter at scale 1.
        tables: table name -> learning-rate scale of the step's sparse update: the
            table's optimizer (any of them: sgd, adagrad, adam, ftrl, a registered
            one) takes the step it would take configured with ``lr * scale``,
            weight decay included. A table not named gets an empty update (its
            rows and optimizer state are untouched, its step clock still
            advances). ``None``: every table at 1. With several trainers every
            rank must give a table the same scale in a step (pick the plan per
            global batch); the parameter server refuses a step whose scales differ.
    """

    dense: Mapping[str, float] | None = None
    tables: Mapping[str, float] | None = None

    def __post_init__(self) -> None:
        for field_name, scales in (("dense", self.dense), ("tables", self.tables)):
            for name, scale in (scales or {}).items():
                if not (math.isfinite(scale) and scale >= 0):
                    raise ValueError(
                        f"UpdatePlan.{field_name}[{name!r}]: a learning-rate scale must be "
                        f"finite and >= 0, got {scale!r}"
                    )

    def dense_scale(self, name: str) -> float | None:
        """The lr scale of parameter ``name`` (``None``: frozen this step)."""
        if self.dense is None:
            return 1.0
        matches = [p for p in self.dense if name.startswith(p)]
        return self.dense[max(matches, key=len)] if matches else None


class RowLoss(nn.Module):
    """Binary cross-entropy on logits, mean over the B rows, each row weighted by
    ``weight`` (B,) when given (``nn.BCEWithLogitsLoss`` without one)."""

    def forward(
        self, logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor | None = None
    ) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(logits, labels, weight=weight)


class StepLoss(Protocol):
    def __call__(
        self, logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor | None = None
    ) -> torch.Tensor: ...


class Engine:
    """Runs steps of one model over its embedding tables.

    Args:
        model: ``forward(dense (B, Dd), sparse (B, F, D)[, sequences]) -> logits (B,)``.
        embeddings: the collection over the job's tables.
        stores: table name -> the store sparse updates go to.
        optimizer: the dense optimizer over ``model``'s parameters.
        train: the job's ``train`` section (mode, staleness, placement, precision).
        device: where the dense network runs (tables stay in host memory).
        train_model: what steps call (a DDP wrapper of ``model``); default ``model``.
    """

    def __init__(
        self,
        model: nn.Module,
        embeddings: EmbeddingCollection,
        stores: Mapping[str, EmbeddingStore],
        optimizer: torch.optim.Optimizer,
        train: TrainSpec,
        device: torch.device,
        train_model: nn.Module | None = None,
    ) -> None:
        self.model = model
        self.embeddings = embeddings
        self.stores = dict(stores)
        self.optimizer = optimizer
        self.train = train
        self.device = device
        self.train_model = train_model if train_model is not None else model
        self.loss_fn: StepLoss = RowLoss()
        self.bf16 = train.precision == "bf16"
        self.times = StageTimes()
        # The last training step's logits (B,) and labels (B,), detached: what a
        # windowed training AUC reads (references only, no copy per step).
        self.last_logits: torch.Tensor | None = None
        self.last_labels: torch.Tensor | None = None

    def sparse_updater(self) -> SparseUpdater:
        """The ``SparseUpdater`` for ``train.mode`` / ``staleness`` / ``sparse_placement``."""
        train = self.train
        placement = None if train.sparse_placement == "auto" else Placement(train.sparse_placement)
        return SparseUpdater(self.stores, train.mode, train.staleness, placement=placement)

    def lookup(self, batch: Batch) -> LookedUpBatch:
        """Training lookup of ``batch``'s ids (inserts new ones); any thread."""
        return self.embeddings.lookup(batch.sparse, train=True)

    def looked_up(
        self, batches: Iterator[Batch], updater: SparseUpdater
    ) -> Iterator[tuple[Batch, LookedUpBatch]]:
        """Yield batches with their lookups: inline in sync mode, else one batch
        ahead on the prefetch thread, after the staleness barrier."""
        if self.train.mode == "sync":
            for batch in batches:
                t0 = time.perf_counter()
                looked_up = self.lookup(batch)
                self.times.lookup_s += time.perf_counter() - t0
                yield batch, looked_up
            return
        prefetch = Prefetcher(
            batches,
            self.lookup,
            updater.before_lookup,
            first_step=updater.submitted + 1,
            times=self.times,
            placement=updater.placement,
        )
        for _, batch, looked_up in prefetch:
            yield batch, looked_up

    def step(
        self,
        batch: Batch,
        looked_up: LookedUpBatch,
        updater: SparseUpdater,
        plan: UpdatePlan | None = None,
        *,
        loss_scale: float | None = None,
    ) -> float:
        """One training step; returns the loss.

        Args:
            plan: what the step updates (default: everything, at scale 1).
            loss_scale: ``None``: the loss is the (weighted) mean over the B rows;
                else the sum over them times this (a rank's share of a step split
                over ranks: ``W / rows of the whole step``).
        """
        t0 = time.perf_counter()
        self.model.train()
        self.embeddings.train()
        sparse, sequences = self.embeddings.embed(looked_up)  # (B, F, D), {f: (B, L, D)}
        dense = torch.from_numpy(batch.dense)  # (B, Dd)
        labels = torch.from_numpy(batch.labels).to(self.device)  # (B,)
        logits = self.forward(self.train_model, dense, sparse, sequences)
        weight = None
        if batch.weights is not None:
            weight = torch.from_numpy(batch.weights).to(self.device)
        if loss_scale is None:
            loss = self.loss_fn(logits, labels, weight)
        else:
            rows = F.binary_cross_entropy_with_logits(
                logits, labels, weight=weight, reduction="sum"
            )
            loss = rows * loss_scale
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        t1 = time.perf_counter()
        if plan is None or plan.dense is None:
            self.optimizer.step()
        else:
            self._planned_dense_step(plan)
        t2 = time.perf_counter()
        grads = self.embeddings.gradients()
        if plan is not None and plan.tables is not None:
            grads = [_planned(g, plan.tables.get(g.table)) for g in grads]
        updater.submit(grads)
        t3 = time.perf_counter()
        self.times.forward_backward_s += t1 - t0
        self.times.dense_step_s += t2 - t1
        self.times.sparse_submit_s += t3 - t2
        self.times.steps += 1
        self.last_logits, self.last_labels = logits.detach(), labels
        return float(loss.detach())  # a CPU-GPU sync point on CUDA

    def _planned_dense_step(self, plan: UpdatePlan) -> None:
        """One optimizer step per lr scale of the plan: parameters of other scales
        have their gradient set aside meanwhile (torch optimizers skip a parameter
        without one, state included), frozen ones lose theirs."""
        by_scale: dict[float, list[nn.Parameter]] = {}
        for name, param in self.model.named_parameters():
            if param.grad is None:
                continue
            scale = plan.dense_scale(name)
            if scale is None:
                param.grad = None  # frozen this step
            else:
                by_scale.setdefault(scale, []).append(param)
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        held = {p: p.grad for params in by_scale.values() for p in params}
        try:
            for scale, params in by_scale.items():
                chosen = set(params)
                for p, grad in held.items():
                    p.grad = grad if p in chosen else None
                for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
                    group["lr"] = lr * scale
                self.optimizer.step()
        finally:
            for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
                group["lr"] = lr
            for p, grad in held.items():
                p.grad = grad

    def forward(
        self, model: nn.Module, dense: torch.Tensor, sparse: torch.Tensor, sequences: Sequences
    ) -> torch.Tensor:
        """Logits float32 (B,) on ``self.device``, under bf16 autocast when asked.
        ``sequences`` (the ``pooling: none`` features) is passed only when not empty."""
        dense = dense.to(self.device, non_blocking=True)
        sparse = sparse.to(self.device, non_blocking=True)
        inputs: list[Any] = [dense, sparse]
        if sequences:
            moved = {
                name: SequenceEmbedding(
                    s.values.to(self.device, non_blocking=True),
                    s.mask.to(self.device, non_blocking=True),
                )
                for name, s in sequences.items()
            }
            inputs.append(moved)
        autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if self.bf16
            else contextlib.nullcontext()
        )
        with autocast:
            logits = model(*inputs)
        return logits.float()

    @torch.no_grad()
    def predict(self, batch: Batch) -> np.ndarray:
        """Click probabilities float32 (B,); lookups never insert ids."""
        self.model.eval()
        self.embeddings.eval()
        looked_up = self.embeddings.lookup(batch.sparse, train=False)
        sparse, sequences = self.embeddings.embed(looked_up)
        logits = self.forward(self.model, torch.from_numpy(batch.dense), sparse, sequences)
        return torch.sigmoid(logits).cpu().numpy()


def _planned(grads: SparseGradients, scale: float | None) -> SparseGradients:
    """One table's update under a plan: empty when the plan leaves the table out."""
    if scale is None:
        return SparseGradients(grads.table, grads.ids[:0], grads.grads[:0])
    if scale == 1.0:
        return grads
    return SparseGradients(grads.table, grads.ids, grads.grads, lr_scale=float(scale))
