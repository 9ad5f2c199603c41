"""Scoring rows as they arrive while the training step runs (``train.mixed_buffer``
in ``hybrid``/``async`` mode, where rank 0 reads ahead on the prefetch thread).

::

    prefetch thread: batch arrives -> ArrivalScorer(batch) -> buffer.offer(...)
                       copy <- live dense weights      (a private eval copy:
                                                        the live model's modes
                                                        and state stay the step's)
                       lookup(train=False)             (read-only, inserts nothing)
                       embedded(...) -> copy(...)      (no autograd, no step state)
    main thread:     the step, on the live model, at the same time

The copy takes the live weights before each batch. The optimizer may be writing
them at that moment, so a score can mix two consecutive steps' weights (each
value is one step's or the next's): the model "as the row arrived", to within
a step, as the embeddings are in hybrid mode (bounded by ``staleness``).
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from estuary.data.types import Batch
from estuary.train.engine import Engine

__all__ = ["ArrivalScorer"]


class ArrivalScorer:
    """Click probabilities float32 (B,) of arriving batches, from any thread
    (see the module docstring)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.model = copy.deepcopy(engine.model).eval()
        for param in self.model.parameters():
            param.requires_grad_(False)

    @torch.no_grad()
    def __call__(self, batch: Batch) -> np.ndarray:
        engine = self.engine
        self.model.load_state_dict(engine.model.state_dict())
        looked_up = engine.embeddings.lookup(batch.sparse, train=False)
        sparse, sequences = engine.embeddings.embedded(looked_up)
        logits = engine.forward(self.model, torch.from_numpy(batch.dense), sparse, sequences)
        return torch.sigmoid(logits).cpu().numpy()
