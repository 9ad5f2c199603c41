"""Scoring rows as they arrive while the training step runs (``train.mixed_buffer``
in ``hybrid``/``async`` mode, where rank 0 reads ahead on the prefetch thread).

::

    prefetch thread: batch arrives -> ArrivalScorer(batch) -> buffer.offer(...)
                       eval twin -> live dense weights (a private module in
                                                        eval mode bound to the live
                                                        tensors, no copy: the live
                                                        model's modes stay the step's)
                       lookup(train=False)             (read-only, inserts nothing)
                       embedded(...) -> twin(...)      (no autograd, no step state)
    main thread:     the step, on the live model, at the same time

The twin is bound to the live tensors (``load_state_dict(..., assign=True)``:
the same tensors, nothing copied, so a score costs no copy of the dense model)
and bound again whenever the live model's tensors are no longer the ones bound
(a restore that replaces them); an optimizer step writes them in place. The
optimizer may be writing them while a batch is scored, so a score can mix two
consecutive steps' weights (each value is one step's or the next's): the model
"as the row arrived", to within a step, as the embeddings are in hybrid mode
(bounded by ``staleness``).
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
        self._bound: list[torch.Tensor] = []

    @torch.no_grad()
    def __call__(self, batch: Batch) -> np.ndarray:
        engine = self.engine
        live = [*engine.model.parameters(), *engine.model.buffers()]
        stale = len(live) != len(self._bound) or any(
            a is not b for a, b in zip(live, self._bound, strict=True)
        )
        if stale:
            self.model.load_state_dict(engine.model.state_dict(), assign=True)
            self._bound = live
        looked_up = engine.embeddings.lookup(batch.sparse, train=False)
        sparse, sequences = engine.embeddings.embedded(looked_up)
        logits = engine.forward(self.model, torch.from_numpy(batch.dense), sparse, sequences)
        return torch.sigmoid(logits).cpu().numpy()
