"""``ServingModel``: one job's embedding tables and dense network, answering
predictions while updates land.

It is built with the training code itself (``build_tables``, ``build_engine``)
and predicts with ``Engine.predict``, the function ``estuary eval`` predicts
with: lookups that never insert ids (an unknown id reads its shard's unknown
row), pooling by the ``EmbeddingCollection``, the dense forward, a sigmoid. So
a row's probability online equals eval's for the same checkpoint.

Consistency under updates: every prediction and every update holds one lock
(``_lock``), so a batch sees a whole update or none of it, never half a delta
or a table of one version with a dense net of another. The costly parts of a
dense swap (reading the file, building the new network) run outside the lock.
A delta is written into the tables in place: inside the lock, or, with a
standby copy of the tables (``keep_standby``, what a server following a run
uses), into the copy not serving, then the two swap by reference inside the
lock and the other copy catches up outside it. Measured on the bench model
(26 tables, deltas of ~18k rows) on a busy 2-core machine: 15-23 ms of
predictions held back per delta in place, microseconds with a standby.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from estuary.config import JobSpec
from estuary.data.types import Batch
from estuary.nn.types import SequenceEmbedding, Sequences
from estuary.serve.frozen_table import FrozenTable
from estuary.serve.live_table import LiveTable
from estuary.serve.pipeline import FeaturePipeline, RequestError
from estuary.serve.slot_table import SlotTable
from estuary.train.build import TableStore, build_engine, build_tables
from estuary.train.engine import Engine
from estuary.train.plan import TrainPlan

__all__ = ["ExportedDense", "FlatSequences", "Prediction", "ServingModel"]


class ExportedDense(nn.Module):
    """A ``torch.export`` program as the dense model: ``forward(dense (B, Dd),
    sparse (B, F, D)[, sequences]) -> logits (B,)``.

    The program takes the unpooled (``pooling: none``) features flat, after
    ``dense`` and ``sparse``: per feature of ``sequence_features``, in order,
    its values (B, L, D) and mask (B, L) (``SequenceEmbedding``; L may differ
    per feature and per batch). This wrapper flattens ``sequences`` for it.

    An exported graph is fixed in the mode it was exported in (eval) and refuses
    ``train()``/``eval()``; this wrapper records the mode and leaves the graph be.
    """

    def __init__(
        self, program: torch.export.ExportedProgram, sequence_features: Sequence[str] = ()
    ) -> None:
        super().__init__()
        self.graph = program.module()
        self.sequence_features = list(sequence_features)

    def train(self, mode: bool = True) -> ExportedDense:
        self.training = mode  # the graph itself stays as exported
        return self

    def forward(
        self, dense: torch.Tensor, sparse: torch.Tensor, sequences: Sequences | None = None
    ) -> torch.Tensor:
        given = [(sequences or {})[name] for name in self.sequence_features]
        flat = [x for s in given for x in (s.values, s.mask)]
        return self.graph(dense, sparse, *flat)


class FlatSequences(nn.Module):
    """``model`` with its ``sequences`` argument taken flat (what ``torch.export``
    traces; see ``ExportedDense``): ``forward(dense, sparse, *values_and_masks)``."""

    def __init__(self, model: nn.Module, sequence_features: Sequence[str]) -> None:
        super().__init__()
        self.model = model
        self.sequence_features = list(sequence_features)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor, *flat: torch.Tensor) -> Any:
        if not self.sequence_features:
            return self.model(dense, sparse)
        sequences = {
            name: SequenceEmbedding(flat[2 * i], flat[2 * i + 1])
            for i, name in enumerate(self.sequence_features)
        }
        return self.model(dense, sparse, sequences)


@dataclass(frozen=True)
class Prediction:
    """Probabilities of B rows and the version that made them.

    Args:
        probabilities: float32 (B,).
        version: the model version (dense + tables) every row was predicted with.
    """

    probabilities: np.ndarray
    version: str


class ServingModel:
    """Tables + dense network of one job, for predictions.

    Args:
        job: the job the model was trained by (tables, model type, precision).
        pipeline: the job's feature pipeline (feature order, Dd, sequences).
        version: the initial model version's name.
        model: the dense network (e.g. ``ExportedDense``); ``None`` builds
            ``job.model.type`` (then load its weights, e.g. ``Checkpoint.restore_dense``).
        tables: the tables, already holding their rows (e.g. an export's
            ``FrozenTable``s); ``None`` builds the job's ``EmbeddingTable``s, empty
            (then ``load_tables``).
    """

    def __init__(
        self,
        job: JobSpec,
        pipeline: FeaturePipeline,
        version: str,
        model: nn.Module | None = None,
        tables: Mapping[str, TableStore] | None = None,
    ) -> None:
        self.job = job
        self.pipeline = pipeline
        self.plan = TrainPlan.from_job(job, pipeline.decoder.features)
        self.engine, self.tables = self._side(model, tables)
        # With ``keep_standby``: a second set of tables, kept one update behind
        # or level, that updates are written into while the first serves.
        self._standby: tuple[Engine, dict[str, TableStore]] | None = None
        # A dense network no engine serves, refilled by ``new_dense`` (see there).
        self._spare_dense: nn.Module | None = None
        self.version = version
        self.updated_at = time.time()  # wall time of the newest update applied
        self.last_stall_s = 0.0  # how long the newest update held predictions back
        self._lock = threading.Lock()

    def _side(
        self, model: nn.Module | None, given: Mapping[str, TableStore] | None = None
    ) -> tuple[Engine, dict[str, TableStore]]:
        """New tables (or ``given``) and an Engine of the training code over them (so
        predictions go the way eval's do; its dense optimizer is built, never stepped)."""
        if given is not None and sorted(given) != sorted(self.plan.tables):
            raise ValueError(f"tables {sorted(given)}, the job has {sorted(self.plan.tables)}")
        tables = dict(given) if given is not None else build_tables(self.plan, None)
        decoder = self.pipeline.decoder
        engine = build_engine(
            self.job,
            self.plan,
            tables,
            external=False,
            num_dense=len(decoder.dense),
            jagged=decoder.sequences,
            model=model,
        )
        return engine, tables

    def keep_standby(self, restore: Callable[[Mapping[str, TableStore]], None]) -> None:
        """Keep a second copy of the tables (``restore`` fills it with the state the
        serving ones hold, e.g. ``Checkpoint.restore_tables``) so that ``update``
        writes deltas off the request path: into the standby copy, a swap of
        references in the lock, then into the other. Costs a second copy of
        every table in memory and each delta applied twice (off the lock)."""
        engine, tables = self._side(self.engine.model)
        restore(tables)
        self._standby = (engine, tables)

    @property
    def table_bytes(self) -> int:
        """Bytes the serving tables hold (``TableStats.bytes``; a standby copy not
        counted)."""
        return sum(table.stats().bytes for table in self.tables.values())

    @property
    def dense_model(self) -> nn.Module:
        """The dense network now serving."""
        return self.engine.model

    def predict(self, batch: Batch) -> Prediction:
        """Probabilities of ``batch``'s B rows, all from one version.

        Blocking: waits for an update in progress (see module docstring)."""
        with self._lock:
            return Prediction(self.engine.predict(batch), self.version)

    def predict_requests(
        self, requests: Sequence[list[dict[str, Any]]]
    ) -> list[Prediction | RequestError]:
        """Each request's probabilities (its rows checked by ``FeaturePipeline.check``)
        from one decode and one forward pass over all of them, or the
        ``RequestError`` of a request with a bad value. All from one version."""
        batch, outcomes = self.pipeline.parse_many(requests)
        result = self.predict(batch)
        return [
            Prediction(result.probabilities[o], result.version) if isinstance(o, slice) else o
            for o in outcomes
        ]

    def load_tables(self, states: Mapping[str, dict[str, np.ndarray]]) -> None:
        """Replace every table's rows by ``states`` (table -> state dict); for a
        model not yet serving (no lock needed, but taken)."""
        with self._lock:
            for name, table in self.tables.items():
                table.load_state_dict(states[name])

    def new_dense(self, state: Mapping[str, torch.Tensor]) -> nn.Module:
        """A dense network like the serving one holding ``state`` (filled outside
        the lock; serve it with ``update``). The network an ``update`` replaced is
        kept and refilled by the next call (weights copied in place), so a swap
        builds no module: a deep copy of the network holds the GIL for several ms,
        time the event loop waits. Each call's network is for one ``update``."""
        model = self._spare_dense
        self._spare_dense = None
        if model is None:
            model = copy.deepcopy(self.engine.model)
        model.load_state_dict(state)
        return model

    def update(
        self,
        version: str,
        *,
        deltas: Sequence[Mapping[str, dict[str, np.ndarray]]] = (),
        model: nn.Module | None = None,
    ) -> None:
        """From the next batch on, serve ``version``: the tables with ``deltas``
        applied in order (each: table -> ``delta_state_dict``, one checkpoint's)
        and ``model`` as the dense network (when given). Batches see all of it or
        none. With a standby copy (``keep_standby``) predictions wait only for a
        swap of references; without, for the rows to be written.

        Raises:
            ValueError: a delta does not apply on its table's state (another base
                version); the model is then unfit to serve until reloaded.
        """
        replaced = self.engine.model if model is not None else None
        if self._standby is None:
            with self._lock:  # blocks predictions while the delta rows are written
                started = time.perf_counter()
                _apply(self.engine, self.tables, deltas, model)
                self._serve(self.engine, self.tables, version, started)
            self._spare_dense = replaced if replaced is not model else None
            return
        engine, tables = self._standby
        _apply(engine, tables, deltas, model, yield_gil=True)  # off the request path
        with self._lock:
            started = time.perf_counter()
            self._standby = (self.engine, self.tables)
            self._serve(engine, tables, version, started)
        # The copy served until now catches up.
        _apply(*self._standby, deltas, model, yield_gil=True)
        # No engine holds the replaced network now: the next new_dense refills it.
        self._spare_dense = replaced if replaced is not model else None

    def serve_tables(
        self,
        version: str,
        tables: Mapping[str, FrozenTable | SlotTable],
        model: nn.Module | None = None,
    ) -> None:
        """From the next batch on, serve ``version``: every table replaced whole by
        ``tables`` (for a model built over ``LiveTable``s) and ``model`` as the
        dense network (when given, from ``new_dense``). Predictions wait only for
        references to change.

        Raises:
            ValueError: ``tables`` are not this model's tables, or they are not
                ``LiveTable``s.
        """
        if sorted(tables) != sorted(self.tables):
            raise ValueError(f"tables {sorted(tables)}, the model has {sorted(self.tables)}")
        live = {name: self.tables[name] for name in tables}
        if not all(isinstance(t, LiveTable) for t in live.values()):
            raise ValueError("serve_tables: the model's tables are not LiveTables")
        replaced = self.engine.model if model is not None else None
        with self._lock:
            started = time.perf_counter()
            # The tables replaced are freed after the lock (unmapping a version's
            # file takes milliseconds), not inside it.
            old = [live[name].current for name in tables]  # type: ignore[attr-defined]
            for name, table in tables.items():
                live[name].current = table  # type: ignore[attr-defined]
            if model is not None:
                self.engine.model = model
            self._serve(self.engine, self.tables, version, started)
        del old
        self._spare_dense = replaced if replaced is not model else None

    def _serve(
        self, engine: Engine, tables: dict[str, TableStore], version: str, started: float
    ) -> None:
        """Serve ``engine`` over ``tables`` as ``version`` (the lock held)."""
        self.engine, self.tables = engine, tables
        self.version = version
        self.updated_at = time.time()
        self.last_stall_s = time.perf_counter() - started

    def adopt(self, other: ServingModel) -> None:
        """Serve ``other``'s tables and network from the next batch on (a full
        checkpoint loaded off to the side: only references change in the lock),
        and keep its standby copy, if it has one."""
        with self._lock:
            started = time.perf_counter()
            self._standby = other._standby
            self._serve(other.engine, other.tables, other.version, started)
        self._spare_dense = None


def _apply(
    engine: Engine,
    tables: Mapping[str, TableStore],
    deltas: Sequence[Mapping[str, dict[str, np.ndarray]]],
    model: nn.Module | None,
    *,
    yield_gil: bool = False,
) -> None:
    """Apply ``deltas`` (in order) to ``tables`` and set ``engine``'s dense network.

    ``yield_gil`` (off the lock): after each table, hand the GIL to a waiting
    thread (``time.sleep(0)``), so the event loop and the prediction thread run
    between tables instead of waiting up to the interpreter's switch interval
    (5 ms) behind a delta's numpy work."""
    for checkpoint in deltas:
        for name, delta in checkpoint.items():
            tables[name].apply_delta(delta)
            if yield_gil:
                time.sleep(0)
    if model is not None:
        engine.model = model
