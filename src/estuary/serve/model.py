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
dense swap (reading the file, building the new network) run outside the lock;
inside it only references change (``swap_dense``). A delta is applied inside
the lock (it writes the table rows in place: ~1 ms per 10k rows of dim 16).
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from estuary.config import JobSpec
from estuary.data.types import Batch
from estuary.serve.pipeline import FeaturePipeline, RequestError
from estuary.train.build import TableStore, build_engine, build_tables
from estuary.train.plan import TrainPlan

__all__ = ["ExportedDense", "Prediction", "ServingModel"]


class ExportedDense(nn.Module):
    """A ``torch.export`` program as the dense model: ``forward(dense (B, Dd),
    sparse (B, F, D)) -> logits (B,)``.

    An exported graph is fixed in the mode it was exported in (eval) and refuses
    ``train()``/``eval()``; this wrapper records the mode and leaves the graph be.
    """

    def __init__(self, program: torch.export.ExportedProgram) -> None:
        super().__init__()
        self.graph = program.module()

    def train(self, mode: bool = True) -> ExportedDense:
        self.training = mode  # the graph itself stays as exported
        return self

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return self.graph(dense, sparse)


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
            ``job.model.type`` (then restore its weights with ``swap_dense``).
    """

    def __init__(
        self,
        job: JobSpec,
        pipeline: FeaturePipeline,
        version: str,
        model: nn.Module | None = None,
    ) -> None:
        decoder = pipeline.decoder
        self.job = job
        self.pipeline = pipeline
        self.plan = TrainPlan.from_job(job, decoder.features)
        self.tables: dict[str, TableStore] = build_tables(self.plan, None)
        # An Engine of the training code, so predictions go the way eval's do;
        # its dense optimizer is built and never stepped (a few KB of state).
        self.engine = build_engine(
            job,
            self.plan,
            self.tables,
            external=False,
            num_dense=len(decoder.dense),
            jagged=decoder.sequences,
            model=model,
        )
        self.version = version
        self.updated_at = time.time()  # wall time of the newest update applied
        self.last_stall_s = 0.0  # how long the newest update held predictions back
        self._lock = threading.Lock()

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
        """A copy of the serving dense network holding ``state`` (built outside
        the lock; serve it with ``update``)."""
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
        none.

        Raises:
            ValueError: a delta does not apply on its table's state (another base
                version); the model is then unfit to serve until reloaded.
        """
        with self._lock:  # blocks predictions while the delta rows are written
            started = time.perf_counter()
            for checkpoint in deltas:
                for name, delta in checkpoint.items():
                    self.tables[name].apply_delta(delta)
            if model is not None:
                self.engine.model = model
            self.version = version
            self.updated_at = time.time()
            self.last_stall_s = time.perf_counter() - started

    def adopt(self, other: ServingModel) -> None:
        """Serve ``other``'s tables and network from the next batch on (a full
        checkpoint loaded off to the side: only references change in the lock)."""
        with self._lock:
            started = time.perf_counter()
            self.engine, self.tables = other.engine, other.tables
            self.version = other.version
            self.updated_at = time.time()
            self.last_stall_s = time.perf_counter() - started
