"""Attention pooling of unpooled sequence features, and the wrapper that lets the
reference models (which take one (B, F, D) block) use them.

A feature whose table has ``pooling: none`` reaches the model as a padded
``SequenceEmbedding`` (values (B, L, D), mask (B, L)); its slot in the (B, F, D)
block holds zeros. ``SequencePooling`` wraps a ``forward(dense, sparse)`` model:
each sequence is reduced to one (B, D) vector by its pooler, written into the
feature's slot, and the model runs as usual::

    sparse (B, F, D) ----------------------------+--> sparse' (B, F, D) --> model
    sequences[s] (B, L, D), mask (B, L) --pooler-+    (slot of s = pooled s)

Poolers are found by name in ``SEQUENCE_POOLINGS`` (``model.params.sequence_pooling``
in a job file): ``attention`` (learned-query multi-head attention, the default)
and ``target_attention`` (DIN: the query is another feature's embedding, e.g.
the candidate item). A pooler maps an empty bag (all-False mask) to zeros.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from estuary.config.errors import ConfigError
from estuary.nn.types import SequenceEmbedding, Sequences
from estuary.plugins import SEQUENCE_POOLINGS


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of ``scores`` (..., L) where ``mask`` (..., L) is
    True; masked positions get weight 0, and a row with no True gets all zeros
    (not NaN)."""
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1) * mask


class AttentionPooling(nn.Module):
    """Multi-head attention pooling with learned queries (one per head): each
    head's weights are a masked softmax of ``<W_k x_l, q_h> / sqrt(D / H)``, its
    output the weighted sum of ``W_v x_l``; the heads are concatenated and
    projected back to D. The queries start at zero, i.e. as mean pooling.

    Args:
        embedding_dim: D.
        heads: H; must divide D.
    """

    def __init__(self, embedding_dim: int, heads: int = 1) -> None:
        super().__init__()
        if heads < 1 or embedding_dim % heads:
            raise ValueError(f"heads must divide the embedding dim {embedding_dim}, got {heads}")
        self.heads = heads
        self.query = nn.Parameter(torch.zeros(heads, embedding_dim // heads))  # (H, D/H)
        self.key = nn.Linear(embedding_dim, embedding_dim)
        self.value = nn.Linear(embedding_dim, embedding_dim)
        self.out = nn.Linear(embedding_dim, embedding_dim, bias=False)  # empty bag -> 0

    def forward(self, sparse: torch.Tensor, sequence: SequenceEmbedding) -> torch.Tensor:
        """(B, F, D) block (unused), sequence (B, L, D) -> (B, D)."""
        x, mask = sequence.values, sequence.mask
        b, length, dim = x.shape
        k = self.key(x).view(b, length, self.heads, -1)  # (B, L, H, D/H)
        v = self.value(x).view(b, length, self.heads, -1)  # (B, L, H, D/H)
        scores = torch.einsum("blhd,hd->bhl", k, self.query) / math.sqrt(dim // self.heads)
        weights = masked_softmax(scores, mask.unsqueeze(1))  # (B, H, L)
        pooled = torch.einsum("bhl,blhd->bhd", weights, v)  # (B, H, D/H)
        return self.out(pooled.reshape(b, dim))


class TargetAttention(nn.Module):
    """DIN's activation unit (Zhou et al., 2018): the weight of sequence item
    ``k_l`` given the query ``q`` (another feature's pooled embedding, typically
    the candidate item) is ``MLP([k_l, q, k_l - q, k_l * q])``; the output is
    ``sum_l w_l k_l`` over the real items. As in DIN the weights are not
    normalised unless ``softmax`` is set (masked softmax over the sequence).

    Args:
        embedding_dim: D.
        query_index: the query feature's position f in the (B, F, D) block.
        hidden: hidden sizes of the weight MLP (ReLU; a final 1-unit layer is added).
        softmax: normalise the weights with a masked softmax.
    """

    def __init__(
        self,
        embedding_dim: int,
        query_index: int,
        hidden: Sequence[int] = (32,),
        softmax: bool = False,
    ) -> None:
        super().__init__()
        self.query_index = query_index
        self.softmax = softmax
        layers: list[nn.Module] = []
        fan_in = 4 * embedding_dim
        for width in hidden:
            layers += [nn.Linear(fan_in, width), nn.ReLU()]
            fan_in = width
        layers.append(nn.Linear(fan_in, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, sparse: torch.Tensor, sequence: SequenceEmbedding) -> torch.Tensor:
        """(B, F, D) block (reads the query's slot), sequence (B, L, D) -> (B, D)."""
        keys, mask = sequence.values, sequence.mask
        query = sparse[:, self.query_index].unsqueeze(1).expand_as(keys)  # (B, L, D)
        unit_in = torch.cat([keys, query, keys - query, keys * query], dim=-1)  # (B, L, 4D)
        scores = self.mlp(unit_in).squeeze(-1)  # (B, L)
        weights = masked_softmax(scores, mask) if self.softmax else scores * mask
        return torch.einsum("bl,bld->bd", weights, keys)


PoolerFactory = Callable[..., nn.Module]
"""``factory(embedding_dim=, features=, **params)`` -> a module mapping
(sparse (B, F, D), SequenceEmbedding) to (B, D); ``features`` lists the F
features in model order (to resolve feature names in ``params``)."""


def _attention(*, embedding_dim: int, features: Sequence[str], heads: int = 1) -> nn.Module:
    return AttentionPooling(embedding_dim, heads)


def _target_attention(
    *,
    embedding_dim: int,
    features: Sequence[str],
    query: str,
    hidden: Sequence[int] = (32,),
    softmax: bool = False,
) -> nn.Module:
    if query not in features:
        raise ValueError(f"query {query!r} is not a sparse feature")
    return TargetAttention(embedding_dim, list(features).index(query), hidden, softmax)


# ``SEQUENCE_POOLINGS`` (attention, target_attention) is ``estuary.plugins.SEQUENCE_POOLINGS``.


def register_sequence_pooling(name: str, factory: PoolerFactory) -> None:
    """Make ``factory`` available as ``type: name`` in ``model.params.sequence_pooling``
    (in ``estuary.plugins.SEQUENCE_POOLINGS``)."""
    SEQUENCE_POOLINGS.register(name, factory)


class SequencePooling(nn.Module):
    """Runs a ``forward(dense, sparse)`` model on a batch with unpooled features:
    each is pooled to (B, D) and replaces its (zero) slot in ``sparse``.

    Args:
        model: the wrapped model, ``forward(dense (B, Dd), sparse (B, F, D)) -> (B,)``.
        features: the F sparse features in model order.
        poolers: unpooled feature -> module(sparse (B, F, D), SequenceEmbedding) -> (B, D).

    ``forward(dense, sparse, sequences)`` returns the model's logits (B,).
    """

    def __init__(
        self, model: nn.Module, features: Sequence[str], poolers: Mapping[str, nn.Module]
    ) -> None:
        super().__init__()
        self.model = model
        self.names = list(poolers)
        for name in self.names:
            if name not in features:
                raise ValueError(f"sequence feature {name!r} is not among the features")
        self.poolers = nn.ModuleList(poolers[name] for name in self.names)
        slots = torch.tensor([list(features).index(n) for n in self.names], dtype=torch.long)
        self.slots: torch.Tensor
        self.register_buffer("slots", slots, persistent=False)

    def forward(
        self, dense: torch.Tensor, sparse: torch.Tensor, sequences: Sequences
    ) -> torch.Tensor:
        pooled = [
            pooler(sparse, sequences[name])
            for name, pooler in zip(self.names, self.poolers, strict=True)
        ]
        vectors = torch.stack(pooled, dim=1)  # (B, S, D)
        return self.model(dense, sparse.index_copy(1, self.slots, vectors))  # not in place


def build_sequence_pooling(
    model: nn.Module,
    *,
    features: Sequence[str],
    sequence_features: Sequence[str],
    embedding_dim: int,
    config: Mapping[str, Any] | None = None,
    path: str = "model.params.sequence_pooling",
) -> SequencePooling:
    """Wrap ``model`` with one pooler per sequence feature.

    Args:
        config: sequence feature -> ``{type: <registered name>, **params}``;
            features not listed get ``{type: attention}``.
        path: the config's dotted path, for errors.
    """
    config = dict(config or {})
    for name in config:
        if name not in sequence_features:
            raise ConfigError(
                f"{path}.{name}",
                f"not a feature with pooling: none (those are {list(sequence_features)})",
            )
    poolers: dict[str, nn.Module] = {}
    for name in sequence_features:
        entry = config.get(name, {})
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{path}.{name}", "expected a mapping like {type: attention}")
        params = dict(entry)
        kind = params.pop("type", "attention")
        factory: PoolerFactory = SEQUENCE_POOLINGS.get(kind, f"{path}.{name}.type")
        accepted = [
            p
            for p in inspect.signature(factory).parameters
            if p not in ("embedding_dim", "features")
        ]
        for key in params:
            if key not in accepted:
                raise ConfigError(
                    f"{path}.{name}.{key}", f"unknown parameter for {kind}; known: {accepted}"
                )
        try:
            poolers[name] = factory(embedding_dim=embedding_dim, features=features, **params)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{path}.{name}", f"{kind}: {exc}") from exc
        pooler = poolers[name]
        if (
            isinstance(pooler, TargetAttention)
            and features[pooler.query_index] in sequence_features
        ):
            raise ConfigError(f"{path}.{name}.query", "must be a pooled feature, not a sequence")
    return SequencePooling(model, features, poolers)
