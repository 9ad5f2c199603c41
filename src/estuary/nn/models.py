"""Reference ranking models and their registry.

Every model takes the same inputs and returns logits::

    dense   float32 (B, Dd)     transformed dense features
    sparse  float32 (B, F, D)   one pooled embedding per sparse feature
    ->      float32 (B,)        logits (apply sigmoid for a probability)

A user's own ``torch.nn.Module`` with this ``forward(dense, sparse)`` plugs in the
same way (see ``examples/custom_model.py``). Models are found by name in
``MODELS``; ``build_model`` checks the constructor arguments from the job file.

When some features have ``pooling: none``, the trainer calls
``forward(dense, sparse, sequences)`` instead, with ``sequences`` feature ->
``SequenceEmbedding`` (values (B, L, D), mask (B, L)) and zeros in those
features' ``sparse`` slots. ``build_model`` then wraps the registered model in
``SequencePooling`` (``estuary.nn.sequence_pooling``), which fills the slots
with attention-pooled vectors, configured by ``params["sequence_pooling"]``.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from estuary.config.errors import ConfigError
from estuary.nn.sequence_pooling import build_sequence_pooling
from estuary.plugins import MODELS


def make_mlp(
    sizes: Sequence[int], *, final_activation: bool, dropout: float = 0.0
) -> nn.Sequential:
    """Linear layers ``sizes[0] -> sizes[1] -> ...`` with ReLU between them."""
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(fan_in, fan_out))
        last = i == len(sizes) - 2
        if not last or final_activation:
            layers.append(nn.ReLU())
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """DLRM (Naumov et al., 2019): bottom MLP on dense features, pairwise dot
    products between all F + 1 vectors, top MLP on [bottom output, dots].

    Args:
        num_dense: Dd, dense feature count.
        num_sparse: F, sparse feature count.
        embedding_dim: D; the bottom MLP's last layer must produce D.
        bottom_mlp: hidden sizes of the bottom MLP, last one == D.
        top_mlp: hidden sizes of the top MLP (a final 1-unit layer is appended).
    """

    def __init__(
        self,
        num_dense: int,
        num_sparse: int,
        embedding_dim: int,
        bottom_mlp: Sequence[int] = (64, 16),
        top_mlp: Sequence[int] = (256, 128),
    ) -> None:
        super().__init__()
        if not bottom_mlp or bottom_mlp[-1] != embedding_dim:
            raise ConfigError(
                "model.params.bottom_mlp",
                f"last size must equal the embedding dim {embedding_dim}, got {list(bottom_mlp)}",
            )
        self.num_dense = num_dense
        self.bottom = (
            make_mlp([num_dense, *bottom_mlp], final_activation=True) if num_dense else None
        )
        vectors = num_sparse + (1 if num_dense else 0)
        rows, cols = torch.triu_indices(vectors, vectors, offset=1)
        self.pair_rows: torch.Tensor
        self.pair_cols: torch.Tensor
        self.register_buffer("pair_rows", rows, persistent=False)
        self.register_buffer("pair_cols", cols, persistent=False)
        top_in = (embedding_dim if num_dense else 0) + rows.numel()
        self.top = make_mlp([top_in, *top_mlp, 1], final_activation=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        if self.bottom is not None:
            x = self.bottom(dense)  # (B, D)
            vectors = torch.cat([x.unsqueeze(1), sparse], dim=1)  # (B, F+1, D)
        else:
            vectors = sparse
        dots = torch.bmm(vectors, vectors.transpose(1, 2))  # (B, V, V)
        pairs = dots[:, self.pair_rows, self.pair_cols]  # (B, V*(V-1)/2)
        top_in = torch.cat([x, pairs], dim=1) if self.bottom is not None else pairs
        return self.top(top_in).squeeze(1)


class DeepFM(nn.Module):
    """DeepFM (Guo et al., 2017): first-order terms + FM pairwise interactions
    between sparse fields + an MLP over all embeddings and dense features, summed
    into one logit. Dense features enter the first-order (linear) term and the
    MLP, as in the reference implementations (deepctr), not the FM term.

    The last component of each sparse feature's embedding row is that id's
    first-order weight; the other ``D - 1`` components are its FM/deep vector. This
    is exactly a separate 1-dim table (row-wise optimizers act per element), with
    one lookup instead of two. So set the table dim to ``k + 1`` for k-dim factors.

    Args:
        num_dense: Dd.
        num_sparse: F.
        embedding_dim: D (>= 2).
        mlp: hidden sizes of the deep part.
        dropout: dropout between deep layers.
    """

    def __init__(
        self,
        num_dense: int,
        num_sparse: int,
        embedding_dim: int,
        mlp: Sequence[int] = (256, 128),
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if embedding_dim < 2:
            raise ConfigError("model.embedding.default.dim", "deepfm needs dim >= 2 (k + 1)")
        self.k = embedding_dim - 1
        self.dense_linear = nn.Linear(num_dense, 1) if num_dense else None
        deep_in = num_sparse * self.k + num_dense
        self.deep = make_mlp([deep_in, *mlp, 1], final_activation=False, dropout=dropout)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        factors = sparse[:, :, : self.k]  # (B, F, k)
        first = sparse[:, :, self.k].sum(dim=1)  # (B,)
        if self.dense_linear is not None:
            first = first + self.dense_linear(dense).squeeze(1)
        square_of_sum = factors.sum(dim=1).pow(2)  # (B, k)
        sum_of_square = factors.pow(2).sum(dim=1)  # (B, k)
        second = 0.5 * (square_of_sum - sum_of_square).sum(dim=1)  # (B,)
        deep_in = torch.cat([factors.flatten(1), dense], dim=1)  # (B, F*k + Dd)
        return first + second + self.deep(deep_in).squeeze(1)


class CrossLayer(nn.Module):
    """One DCNv2 cross layer: ``x_{l+1} = x0 * (W x_l + b) + x_l``, with W full
    rank or factored ``U V^T`` when ``low_rank`` is set."""

    def __init__(self, width: int, low_rank: int | None) -> None:
        super().__init__()
        if low_rank is None:
            self.proj: nn.Module = nn.Linear(width, width)
        else:
            self.proj = nn.Sequential(
                nn.Linear(width, low_rank, bias=False), nn.Linear(low_rank, width)
            )

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x0 * self.proj(x) + x


class DCNv2(nn.Module):
    """DCN-V2 (Wang et al., 2021), stacked form: cross network then MLP.

    Args:
        num_dense: Dd.
        num_sparse: F.
        embedding_dim: D.
        cross_layers: number of cross layers.
        mlp: hidden sizes of the deep part after the cross network.
        low_rank: rank of the factored cross weights (``None`` = full rank).
        dropout: dropout between deep layers.
    """

    def __init__(
        self,
        num_dense: int,
        num_sparse: int,
        embedding_dim: int,
        cross_layers: int = 2,
        mlp: Sequence[int] = (256, 128),
        low_rank: int | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        width = num_dense + num_sparse * embedding_dim
        self.cross = nn.ModuleList(CrossLayer(width, low_rank) for _ in range(cross_layers))
        self.deep = make_mlp([width, *mlp, 1], final_activation=False, dropout=dropout)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        x0 = torch.cat([dense, sparse.flatten(1)], dim=1)  # (B, Dd + F*D)
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        return self.deep(x).squeeze(1)


class LogisticRegression(nn.Module):
    """Logistic regression: each sparse feature's 1-dim embedding is its weight,
    plus a linear term over dense features. Use with table dim 1."""

    def __init__(self, num_dense: int, num_sparse: int, embedding_dim: int) -> None:
        super().__init__()
        if embedding_dim != 1:
            raise ConfigError("model.embedding.default.dim", "logreg needs dim 1")
        self.linear = nn.Linear(num_dense, 1) if num_dense else None
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        logits = sparse.sum(dim=(1, 2)) + self.bias
        if self.linear is not None:
            logits = logits + self.linear(dense).squeeze(1)
        return logits


ModelFactory = Callable[..., nn.Module]

# ``MODELS`` (dlrm, deepfm, dcnv2, logreg) is ``estuary.plugins.MODELS``.


def register_model(name: str, factory: ModelFactory) -> None:
    """Make ``factory(num_dense=, num_sparse=, embedding_dim=, **params)`` available
    as ``model.type: name`` in job files (in ``estuary.plugins.MODELS``)."""
    MODELS.register(name, factory)


def build_model(
    name: str,
    params: dict[str, Any],
    *,
    num_dense: int,
    num_sparse: int,
    embedding_dim: int,
    features: Sequence[str] = (),
    sequence_features: Sequence[str] = (),
) -> nn.Module:
    """Construct a registered model; unknown names and parameters name the field.

    Args:
        features: the F sparse features in model order (needed with sequences).
        sequence_features: the features with ``pooling: none``; when given, the
            model is wrapped in ``SequencePooling`` (``forward(dense, sparse,
            sequences)``), configured by ``params["sequence_pooling"]``.
    """
    params = dict(params)
    sequence_pooling = params.pop("sequence_pooling", None)
    if sequence_pooling is not None and not sequence_features:
        raise ConfigError(
            "model.params.sequence_pooling", "no sparse feature has a table with pooling: none"
        )
    if sequence_pooling is not None and not isinstance(sequence_pooling, dict):
        raise ConfigError(
            "model.params.sequence_pooling", "expected a mapping: feature -> {type: ...}"
        )
    model = _build_registered(name, params, num_dense, num_sparse, embedding_dim)
    if not sequence_features:
        return model
    return build_sequence_pooling(
        model,
        features=features,
        sequence_features=sequence_features,
        embedding_dim=embedding_dim,
        config=sequence_pooling,
    )


def accepts_sequences(model: nn.Module) -> bool:
    """Whether ``model.forward`` takes a third positional argument (``sequences``)."""
    params = list(inspect.signature(model.forward).parameters.values())
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return True
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in positional for p in params) >= 3


def _build_registered(
    name: str, params: dict[str, Any], num_dense: int, num_sparse: int, embedding_dim: int
) -> nn.Module:
    factory: ModelFactory = MODELS.get(name, "model.type")
    accepted = inspect.signature(factory).parameters
    for key in params:
        if key not in accepted or key in ("num_dense", "num_sparse", "embedding_dim"):
            allowed = [p for p in accepted if p not in ("num_dense", "num_sparse", "embedding_dim")]
            raise ConfigError(
                f"model.params.{key}", f"unknown parameter for {name}; known: {allowed}"
            )
    try:
        return factory(
            num_dense=num_dense, num_sparse=num_sparse, embedding_dim=embedding_dim, **params
        )
    except TypeError as exc:
        raise ConfigError("model.params", f"{name}: {exc}") from exc
