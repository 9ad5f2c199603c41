"""Reference trainers for ``bench/quality.py``: the same models outside Estuary.

Every reference sees exactly Estuary's inputs. ``prepare`` takes the rows Estuary
itself read (``estuary.data.TabularDataset``: same parsing, hashing, dense
transform, chronological split) and maps each feature's hashed ids to a
vocabulary index: ids seen at least ``min_count`` times in the training rows get
their own index, every other id (rare, or first seen in eval) shares index 0,
the out-of-vocabulary row. That is the fixed-vocabulary counterpart of
Estuary's ``admission: {min_count: 2}`` (which admits an id online, at its
second sighting, so its first one trains the shared row; the references know
the whole training split's counts in advance).

References (each a function ``(data, settings, seed) -> Metrics``):

  pytorch   ``nn.Embedding(V + 1, D, sparse=True)`` per feature (held as one
            offset-indexed table) + Estuary's own network class
            (``estuary.nn.models``), ``torch.optim.Adagrad`` on the tables with
            Estuary's lr/eps, Estuary's dense optimizer on the network
  torchrec  fbgemm's fused table-batched embedding (TorchRec's training kernel,
            ``SplitTableBatchedEmbeddingBagsCodegen``, exact Adagrad fused into
            backward) + the same network and dense optimizer
  deepctr   ``deepctr_torch.models.DeepFM`` with its own recipe (``DEEPCTR``):
            dense ``nn.Embedding`` tables, one Adam over all parameters, summed
            BCE loss, L2 on embeddings, ``init_std`` 1e-4; factor dim k and MLP
            taken from the Estuary job; only its lr is tuned

``Settings`` holds what a reference copies from the Estuary job: batch size,
epochs, batch order, embedding dim and initializer, sparse and dense optimizer.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

EVAL_BATCH = 8192


@dataclass(frozen=True)
class Metrics:
    """Eval-split metrics of one run."""

    auc: float
    logloss: float
    note: str = ""


@dataclass(frozen=True)
class Prepared:
    """A dataset as vocabulary indices (R rows, F features, Dd dense columns).

    Args:
        ids: int64 (R, F) vocabulary index per feature, 0 = out of vocabulary.
        vocab: int (F,) rows each feature's table needs (in-vocabulary ids + 1).
        dense: float32 (R, Dd) Estuary-transformed dense features.
        labels: float32 (R,).
        n_train: rows ``[0, n_train)`` train, the rest evaluate.
    """

    ids: np.ndarray
    vocab: list[int]
    dense: np.ndarray
    labels: np.ndarray
    n_train: int


@dataclass(frozen=True)
class Settings:
    """What a reference copies from an Estuary job (``settings_from_job``)."""

    model_type: str
    model_params: dict[str, Any]
    dim: int
    init_name: str
    init_scale: float
    sparse_lr: float
    sparse_eps: float
    dense_optimizer: str
    dense_lr: float
    dense_weight_decay: float
    batch_size: int
    epochs: int
    shuffle: bool
    extra: dict[str, Any] = field(default_factory=dict)


def settings_from_job(job: Any) -> Settings:
    """Read a reference's hyperparameters from an Estuary ``JobSpec``."""
    table = job.model.embedding.default
    if table.optimizer.name != "adagrad":
        raise ValueError("the references implement Estuary's adagrad only")
    scale = table.initializer.scale
    return Settings(
        model_type=job.model.type,
        model_params=dict(job.model.params),
        dim=table.dim,
        init_name=table.initializer.name,
        init_scale=scale if scale is not None else table.dim**-0.5,
        sparse_lr=table.optimizer.lr,
        sparse_eps=table.optimizer.eps,
        dense_optimizer=job.train.dense_optimizer.name,
        dense_lr=job.train.dense_optimizer.lr,
        dense_weight_decay=job.train.dense_optimizer.weight_decay,
        batch_size=job.train.batch_size,
        epochs=job.train.epochs,
        shuffle=job.train.shuffle,
    )


def prepare(dataset: Any, min_count: int) -> Prepared:
    """Vocabulary indices for a loaded ``estuary.data.TabularDataset``."""
    if dataset.jagged:
        raise ValueError("the references take single-valued features only")
    train, _ = dataset.split()
    raw = np.asarray(dataset.ids)  # (R, F) hashed ids
    ids = np.zeros(raw.shape, dtype=np.int64)
    vocab = []
    for f in range(raw.shape[1]):
        values, counts = np.unique(raw[: train.stop, f], return_counts=True)
        kept = values[counts >= min_count]  # sorted
        pos = np.minimum(np.searchsorted(kept, raw[:, f]), max(kept.size - 1, 0))
        hit = kept.size > 0
        known = (kept[pos] == raw[:, f]) if hit else np.zeros(raw.shape[0], dtype=bool)
        ids[:, f] = np.where(known, pos + 1, 0)
        vocab.append(int(kept.size) + 1)
    return Prepared(
        ids=ids,
        vocab=vocab,
        dense=np.asarray(dataset.dense, dtype=np.float32),
        labels=np.asarray(dataset.labels, dtype=np.float32),
        n_train=train.stop,
    )


def train_order(data: Prepared, s: Settings, seed: int, epoch: int) -> np.ndarray:
    """Training row order of one epoch, exactly as Estuary's ``DataPart.batches``."""
    rows = np.arange(data.n_train, dtype=np.int64)
    if s.shuffle:
        rows = rows[np.random.default_rng([seed, epoch]).permutation(rows.shape[0])]
    return rows


def metrics(labels: np.ndarray, probabilities: np.ndarray) -> Metrics:
    from estuary.metrics.evaluation import evaluate_predictions

    result = evaluate_predictions(labels, probabilities)
    return Metrics(auc=result.auc, logloss=result.logloss)


# -- Estuary's network on torch-held tables (pytorch, torchrec) -----------------------


def fit_network(
    data: Prepared,
    s: Settings,
    seed: int,
    make_embed: Callable[[], tuple[Callable[[Any], Any], list[Any]]],
) -> Metrics:
    """Train Estuary's network (``s.model_type``) on embeddings from ``make_embed()``
    = (ids (B, F) -> (B, F, D), the tables' optimizers) and evaluate."""
    import torch
    from torch import nn

    from estuary.nn.models import build_model
    from estuary.train.trainer import DENSE_OPTIMIZERS

    torch.manual_seed(seed)
    model = build_model(
        s.model_type,
        s.model_params,
        num_dense=data.dense.shape[1],
        num_sparse=data.ids.shape[1],
        embedding_dim=s.dim,
    )
    embed, optimizers = make_embed()
    optimizers = [
        DENSE_OPTIMIZERS[s.dense_optimizer](
            model.parameters(), lr=s.dense_lr, weight_decay=s.dense_weight_decay
        ),
        *optimizers,
    ]
    loss_fn = nn.BCEWithLogitsLoss()
    ids, dense, labels = (torch.from_numpy(a) for a in (data.ids, data.dense, data.labels))
    for epoch in range(s.epochs):
        model.train()
        for rows in batches(train_order(data, s, seed, epoch), s.batch_size):
            r = torch.from_numpy(rows)
            loss = loss_fn(model(dense[r], embed(ids[r])), labels[r])
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            loss.backward()  # torchrec: the fused kernel updates its tables here
            for opt in optimizers:
                opt.step()
    model.eval()
    probs = []
    with torch.no_grad():
        for start in range(data.n_train, len(data.labels), EVAL_BATCH):
            r = torch.arange(start, min(start + EVAL_BATCH, len(data.labels)))
            probs.append(torch.sigmoid(model(dense[r], embed(ids[r]))).numpy())
    return metrics(data.labels[data.n_train :], np.concatenate(probs))


def batches(order: np.ndarray, batch_size: int) -> Iterator[np.ndarray]:
    for start in range(0, order.shape[0], batch_size):
        yield order[start : start + batch_size]


def init_(weight: Any, s: Settings) -> None:
    """Estuary's initializer on a torch tensor (in place)."""
    import torch

    with torch.no_grad():
        if s.init_name == "uniform":
            weight.uniform_(-s.init_scale, s.init_scale)
        elif s.init_name == "normal":
            weight.normal_(0.0, s.init_scale)
        elif s.init_name == "truncated_normal":
            torch.nn.init.trunc_normal_(
                weight, 0.0, s.init_scale, -2 * s.init_scale, 2 * s.init_scale
            )
        else:
            weight.zero_()


def train_pytorch(data: Prepared, s: Settings, seed: int) -> Metrics:
    """Plain PyTorch: the F tables as one ``nn.Embedding(sum V, D, sparse=True)``
    with per-feature row offsets (as pytorch-fm's ``FeaturesEmbedding``; Adagrad is
    element-wise, so this is exactly F separate tables, in one optimizer call)."""
    import torch
    from torch import nn

    def make() -> tuple[Callable[[Any], Any], list[Any]]:
        table = nn.Embedding(sum(data.vocab), s.dim, sparse=True)
        init_(table.weight, s)
        offsets = torch.tensor(np.cumsum([0, *data.vocab[:-1]]))  # (F,)
        opt = torch.optim.Adagrad(table.parameters(), lr=s.sparse_lr, eps=s.sparse_eps)

        def embed(ids: Any) -> Any:  # (B, F) -> (B, F, D)
            return table(ids + offsets)

        return embed, [opt]

    return fit_network(data, s, seed, make)


def train_torchrec(data: Prepared, s: Settings, seed: int) -> Metrics:
    """TorchRec's fused embedding kernel (fbgemm TBE, exact Adagrad in backward)."""
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        EmbeddingLocation,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    def make() -> tuple[Callable[[Any], Any], list[Any]]:
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[
                (v, s.dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for v in data.vocab
            ],
            optimizer=EmbOptimType.EXACT_ADAGRAD,
            learning_rate=s.sparse_lr,
            eps=s.sparse_eps,
            pooling_mode=PoolingMode.SUM,
        )
        for weight in tbe.split_embedding_weights():
            init_(weight, s)
        f = len(data.vocab)

        def embed(ids: Any) -> Any:  # (B, F) -> (B, F, D)
            b = ids.shape[0]
            # Feature-major bags of one id each; the output is (B, F*D).
            flat = ids.t().reshape(-1).contiguous()
            return tbe(flat, torch.arange(f * b + 1)).view(b, f, s.dim)

        return embed, []

    return fit_network(data, s, seed, make)


# -- deepctr-torch ---------------------------------------------------------------------

# deepctr-torch's own recipe (its README / examples): Adam on every parameter,
# summed BCE, L2 1e-5 on embeddings and the linear part, init_std 1e-4, shuffled
# batches. ``lr`` is the one knob tuned, per dataset, as Estuary's Adagrad lr was
# (seed 0; docs/results.md): Criteo 2.5e-4 / 5e-4 / 1e-3 / 3e-3, Avazu 5e-4 /
# 1e-3 / 2e-3. ``bench/quality.py --deepctr-lr`` overrides it.
DEEPCTR = {"lr": 1e-3, "l2_reg_embedding": 1e-5, "l2_reg_linear": 1e-5, "init_std": 1e-4}
DEEPCTR_LR = {"criteo": 5e-4, "avazu": 1e-3}


def train_deepctr(data: Prepared, s: Settings, seed: int) -> Metrics:
    """``deepctr_torch.models.DeepFM``: factor dim k = D - 1 (Estuary's DeepFM keeps
    the first-order weight in the last component), the job's MLP and dropout."""
    import torch
    from deepctr_torch.inputs import DenseFeat, SparseFeat
    from deepctr_torch.models import DeepFM

    recipe = {**DEEPCTR, **s.extra}
    k = s.dim - 1
    f, dd = data.ids.shape[1], data.dense.shape[1]
    columns = [SparseFeat(f"s{i}", data.vocab[i], embedding_dim=k) for i in range(f)]
    columns += [DenseFeat(f"d{j}", 1) for j in range(dd)]
    torch.manual_seed(seed)
    model = DeepFM(
        columns,
        columns,
        dnn_hidden_units=tuple(s.model_params.get("mlp", (256, 128))),
        dnn_dropout=float(s.model_params.get("dropout", 0.0)),
        l2_reg_embedding=recipe["l2_reg_embedding"],
        l2_reg_linear=recipe["l2_reg_linear"],
        init_std=recipe["init_std"],
        seed=seed,
        device="cpu",
    )
    model.compile(torch.optim.Adam(model.parameters(), lr=recipe["lr"]), "binary_crossentropy")

    def inputs(rows: slice) -> dict[str, np.ndarray]:
        x = {f"s{i}": data.ids[rows, i] for i in range(f)}
        x.update({f"d{j}": data.dense[rows, j] for j in range(dd)})
        return x

    train = slice(0, data.n_train)
    with contextlib.redirect_stdout(io.StringIO()):  # it prints per epoch
        model.fit(
            inputs(train),
            data.labels[train],
            batch_size=s.batch_size,
            epochs=s.epochs,
            verbose=0,
            shuffle=bool(recipe.get("shuffle", True)),
        )
        probs = model.predict(inputs(slice(data.n_train, None)), batch_size=EVAL_BATCH)
    return metrics(data.labels[data.n_train :], probs.reshape(-1))


REFERENCES: dict[str, Callable[[Prepared, Settings, int], Metrics]] = {
    "pytorch": train_pytorch,
    "torchrec": train_torchrec,
    "deepctr": train_deepctr,
}
