"""The mixture's evidence weight of the adapt tower (``evidence_rows``) and the
memory columns of new ids (``memory_learns_new_ids``, ``HistoryIds``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from estuary.config import ConfigError
from estuary.data.types import Batch, JaggedIds
from estuary.nn.mixture import MixtureModel, mixture
from estuary.train.mixture import HistoryIds, mixture_plan_for

TOWER = {"type": "dlrm", "params": {"bottom_mlp": [4], "top_mlp": [8]}}
B, F, D, DM = 6, 3, 8, 4


def build(**params: object) -> MixtureModel:
    torch.manual_seed(0)
    model = mixture(
        2,
        F,
        D,
        memory=TOWER,
        adapt=TOWER,
        combine="gate",
        embeddings="split",
        memory_dim=DM,
        **params,  # type: ignore[arg-type]
    )
    assert model.gate is not None
    last = model.gate
    assert isinstance(last, nn.Linear)
    nn.init.constant_(last.bias, 0.7)  # a non-zero gate, so the adapt tower counts
    return model


def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    dense = torch.randn(B, 2, generator=g)
    sparse = torch.randn(B, F, D, generator=g)
    labels = (torch.rand(B, generator=g) > 0.5).float()
    return dense, sparse, labels


def test_a_steps_logits_never_see_its_labels_and_the_evidence_sums_both_losses() -> None:
    model = build(evidence_rows=50)
    model.train()
    dense, sparse, labels = inputs()
    model.use_rule(model.rules.stream, labels)
    first = model(dense, sparse)
    assert model.adapt_weight() != 0.5  # the evidence moved after the step
    other = build(evidence_rows=50)
    other.train()
    other.use_rule(other.rules.stream, 1 - labels)
    assert torch.equal(other(dense, sparse), first)  # same logits, other labels
    # The evidence: each expert's summed log loss of the step's rows.
    m = model.memory(dense, sparse[..., :DM]).detach()
    full = (m + model.last_gate * model.adapt(dense, sparse[..., DM:])).detach()
    bce = nn.functional.binary_cross_entropy_with_logits
    expected = [float(bce(x, labels, reduction="sum")) for x in (m, full)]
    assert model.evidence.tolist() == pytest.approx(expected, rel=1e-5)
    # The next step's logits weight the adapt term by sigmoid(L_memory - L_mixture).
    pi = 1 / (1 + math.exp(expected[1] - expected[0]))
    assert model.adapt_weight() == pytest.approx(pi, rel=1e-5)
    model.use_rule(model.rules.stream, labels)
    second = model(dense, sparse)
    assert torch.allclose(second, m + pi * (full - m), atol=1e-5)
    # decay: a second step's evidence is the first's * (1 - 1/50)^B plus its own
    assert model.evidence.tolist() == pytest.approx(
        [e * (1 - 1 / 50) ** B + e for e in expected], rel=1e-5
    )


def test_without_evidence_rows_the_weight_is_one_and_history_rows_add_no_evidence() -> None:
    dense, sparse, labels = inputs()
    plain = build()
    plain.train()
    plain.use_rule(plain.rules.stream, labels)
    a = plain(dense, sparse)
    assert plain.adapt_weight() == 1.0
    weighted = build(evidence_rows=50)
    weighted.train()
    plan_for = mixture_plan_for(weighted, ["t"])
    assert plan_for is not None
    history = Batch(
        labels=labels.numpy(),
        dense=dense.numpy(),
        sparse={f"f{j}": JaggedIds.single(np.arange(B)) for j in range(F)},
        origin="history/x",
    )
    plan_for(history)  # history rows add no evidence
    weighted(dense, sparse)
    assert weighted.evidence.tolist() == [0.0, 0.0]
    plan_for(Batch(history.labels, history.dense, history.sparse, origin="stream/x"))
    b = weighted(dense, sparse)  # the first stream step: weight 1/2
    assert weighted.evidence.tolist() != [0.0, 0.0]
    m = plain.memory(dense, sparse[..., :DM])
    assert torch.allclose(b - m, 0.5 * (a - m), atol=1e-6)


def test_history_ids_mark_rows_whose_ids_no_history_row_had() -> None:
    ids = HistoryIds()
    ids.add(
        Batch(
            labels=np.zeros(2, np.float32),
            dense=np.zeros((2, 0), np.float32),
            sparse={
                "a": JaggedIds.single(np.array([1, 2])),
                "b": JaggedIds(np.array([5, 6, 7]), np.array([0, 2, 3])),
            },
        )
    )
    stream = Batch(
        labels=np.zeros(3, np.float32),
        dense=np.zeros((3, 0), np.float32),
        sparse={
            "a": JaggedIds.single(np.array([2, 3, 9])),
            # bags: one old id -> not new; all new -> new; empty -> not new
            "b": JaggedIds(np.array([8, 6, 9, 10]), np.array([0, 2, 4, 4])),
        },
    )
    assert ids.new(stream, ["a", "b"]).tolist() == [
        [False, False],
        [True, True],
        [True, False],
    ]
    assert ids.new(stream, ["b", "c"]).tolist() == [[False, False], [True, False], [False, False]]


def test_stream_rows_train_the_memory_columns_of_new_ids_only() -> None:
    dense, sparse, labels = inputs()
    new = torch.zeros(B, F, dtype=torch.bool)
    new[0, 1] = new[3, 2] = True
    for learns in (True, False):
        model = build(memory_learns_new_ids=learns)
        model.train()
        leaf = sparse.clone().requires_grad_(True)
        model.use_rule(model.rules.stream, labels, new)
        nn.functional.binary_cross_entropy_with_logits(model(dense, leaf), labels).backward()
        assert leaf.grad is not None
        moved = leaf.grad[..., :DM].abs().sum(dim=-1) > 0  # (B, F)
        assert moved.tolist() == (new if learns else torch.zeros_like(new)).tolist()
        assert bool((leaf.grad[..., DM:].abs().sum(dim=-1) > 0).all())  # adapt columns


def test_plan_for_feeds_new_ids_from_the_history_it_saw() -> None:
    model = build(memory_learns_new_ids=True)
    plan_for = mixture_plan_for(model, ["t"], ["a", "b", "c"])
    assert plan_for is not None

    def batch(values: list[int], origin: str) -> Batch:
        return Batch(
            labels=np.zeros(2, np.float32),
            dense=np.zeros((2, 2), np.float32),
            sparse={f: JaggedIds.single(np.array(values)) for f in "abc"},
            origin=origin,
        )

    plan_for(batch([1, 2], "history/x"))
    assert model._new is None
    plan_for(batch([2, 3], "stream/x"))
    assert model._new is not None
    assert model._new.tolist() == [[False] * 3, [True] * 3]


def test_bad_evidence_and_new_id_settings_name_their_field() -> None:
    with pytest.raises(ConfigError, match=r"model\.params\.evidence_rows"):
        build(evidence_rows=-1)
    with pytest.raises(ConfigError, match=r"model\.params\.memory_learns_new_ids"):
        mixture(2, F, D, memory=TOWER, adapt=TOWER, memory_learns_new_ids=True)


def test_the_evidence_is_checkpointed_and_older_states_without_it_load() -> None:
    model = build(evidence_rows=50)
    model.train()
    dense, sparse, labels = inputs()
    model.use_rule(model.rules.stream, labels)
    model(dense, sparse)
    state = model.state_dict()
    restored = build(evidence_rows=50)
    restored.load_state_dict(state)
    assert torch.equal(restored.evidence, model.evidence)
    older = {k: v for k, v in state.items() if k != "evidence"}
    fresh = build(evidence_rows=50)
    fresh.load_state_dict(older)  # strict: no missing-key error
    assert fresh.evidence.tolist() == [0.0, 0.0]
