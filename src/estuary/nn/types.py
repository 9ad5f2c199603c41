"""What models receive besides the pooled (B, F, D) block.

A feature whose table has ``pooling: none`` reaches the model unpooled, as a
right-padded block and a mask. For one batch of 3 rows with bags
``[a b c] [] [d]`` (L = 3, the longest bag)::

    values (B, L, D)        mask (B, L)
    [ a  b  c ]             [ T T T ]
    [ 0  0  0 ]             [ F F F ]     an empty bag: all False
    [ d  0  0 ]             [ T F F ]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequenceEmbedding:
    """One unpooled feature's embeddings for a batch.

    Args:
        values: float32 (B, L, D) the rows of each bag's ids in bag order, zeros
            past the bag's end. L is the longest bag in the batch (at least 1). In
            training it is a leaf that requires grad (do not modify it in place);
            the gradient at masked positions is ignored.
        mask: bool (B, L) True where ``values`` holds an id.
    """

    values: torch.Tensor
    mask: torch.Tensor


Sequences = Mapping[str, SequenceEmbedding]
"""Feature name -> its unpooled embeddings, for the features with ``pooling: none``
(in model order)."""
