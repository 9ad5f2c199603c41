"""Attention pooling of unpooled features and the wrapper that feeds the
reference models: padding never changes a result, empty bags pool to zeros,
gradients reach the sequence and the query, config errors name the field."""

import pytest
import torch
from torch import nn

from estuary.config import ConfigError
from estuary.nn import SequenceEmbedding, SequencePooling, accepts_sequences, build_model
from estuary.nn.sequence_pooling import AttentionPooling, TargetAttention, masked_softmax


def padded(values: torch.Tensor, lengths: list[int], extra: int = 0) -> SequenceEmbedding:
    """values (B, L, D) with positions >= length masked, plus ``extra`` padded
    positions of garbage (which must not matter)."""
    b, length, d = values.shape
    values = torch.cat([values, 100 * torch.randn(b, extra, d)], dim=1)
    mask = torch.arange(length + extra) < torch.tensor(lengths).unsqueeze(1)
    return SequenceEmbedding(values, mask)


def test_masked_softmax_ignores_masked_positions_and_zeroes_empty_rows() -> None:
    scores = torch.tensor([[1.0, 2.0, 50.0], [3.0, 3.0, 3.0]])
    mask = torch.tensor([[True, True, False], [False, False, False]])
    weights = masked_softmax(scores, mask)
    assert weights[0, 2] == 0
    torch.testing.assert_close(weights[0, :2], torch.softmax(torch.tensor([1.0, 2.0]), 0))
    assert torch.equal(weights[1], torch.zeros(3))


@pytest.mark.parametrize(
    "pooler",
    [AttentionPooling(6, heads=2), TargetAttention(6, 0), TargetAttention(6, 0, softmax=True)],
    ids=["attention", "target", "target-softmax"],
)
def test_poolers_ignore_padding_and_map_empty_bags_to_zeros(pooler: nn.Module) -> None:
    torch.manual_seed(0)
    sparse = torch.randn(3, 2, 6)
    values = torch.randn(3, 4, 6)
    lengths = [4, 2, 0]
    out = pooler(sparse, padded(values, lengths))
    assert out.shape == (3, 6)
    torch.testing.assert_close(out, pooler(sparse, padded(values, lengths, extra=3)))
    torch.testing.assert_close(out[2], torch.zeros(6))
    short = pooler(
        sparse[1:2], SequenceEmbedding(values[1:2, :2], torch.ones(1, 2, dtype=torch.bool))
    )
    torch.testing.assert_close(out[1:2], short)


def test_attention_pooling_starts_as_mean_pooling() -> None:
    pooler = AttentionPooling(4, heads=2)
    values = torch.randn(2, 3, 4)
    sequence = padded(values, [3, 1])
    expected = torch.stack(
        [pooler.out(pooler.value(values[0]).mean(0)), pooler.out(pooler.value(values[1, 0]))]
    )
    torch.testing.assert_close(pooler(torch.zeros(2, 1, 4), sequence), expected)


def test_target_attention_weighs_items_by_the_query_like_din() -> None:
    torch.manual_seed(1)
    pooler = TargetAttention(3, query_index=1, hidden=(5,))
    sparse = torch.randn(2, 2, 3, requires_grad=True)
    values = torch.randn(2, 2, 3, requires_grad=True)
    out = pooler(sparse, padded(values, [2, 1]))
    for b, length in enumerate([2, 1]):
        q = sparse[b, 1]
        expected = sum(pooler.mlp(torch.cat([k, q, k - q, k * q])) * k for k in values[b, :length])
        torch.testing.assert_close(out[b], expected)
    out.sum().backward()
    assert sparse.grad is not None and values.grad is not None
    assert sparse.grad[:, 1].abs().sum() > 0 and sparse.grad[:, 0].abs().sum() == 0
    assert values.grad[1, 1].abs().sum() == 0  # padding gets no gradient


@pytest.mark.parametrize(
    ("name", "params", "dim"),
    [
        ("dlrm", {"bottom_mlp": [8, 4], "top_mlp": [8]}, 4),
        ("deepfm", {"mlp": [8]}, 5),
        ("dcnv2", {"cross_layers": 1, "mlp": [8]}, 4),
    ],
)
@pytest.mark.parametrize(
    "pooling",
    [
        None,
        {"hist": {"type": "attention", "heads": 1}},
        {"hist": {"type": "target_attention", "query": "item", "softmax": True}},
    ],
    ids=["default", "attention", "target"],
)
def test_reference_models_take_sequences_through_the_wrapper(
    name: str, params: dict, dim: int, pooling: dict | None
) -> None:
    features = ["user", "hist", "item"]
    if pooling is not None:
        params = {**params, "sequence_pooling": pooling}
    model = build_model(
        name,
        params,
        num_dense=2,
        num_sparse=3,
        embedding_dim=dim,
        features=features,
        sequence_features=["hist"],
    )
    assert isinstance(model, SequencePooling) and accepts_sequences(model)
    sparse = torch.randn(5, 3, dim)
    sparse[:, 1] = 0  # the unpooled slot, as EmbeddingCollection leaves it
    sparse.requires_grad_(True)
    values = torch.randn(5, 4, dim, requires_grad=True)
    sequences = {"hist": padded(values, [4, 0, 1, 2, 3])}
    logits = model(torch.randn(5, 2), sparse, sequences)
    assert logits.shape == (5,)
    logits.sum().backward()
    assert values.grad is not None and values.grad[0].abs().sum() > 0
    assert values.grad[1].abs().sum() == 0  # an empty bag: nothing to train
    assert sparse.grad is not None and sparse.grad[:, 1].abs().sum() == 0


def test_the_wrapper_writes_the_pooled_vector_into_the_feature_slot() -> None:
    seen: list[torch.Tensor] = []

    class Probe(nn.Module):
        def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
            seen.append(sparse)
            return sparse.sum(dim=(1, 2))

    class First(nn.Module):  # pools a sequence to its first item
        def forward(self, sparse: torch.Tensor, sequence: SequenceEmbedding) -> torch.Tensor:
            return sequence.values[:, 0]

    wrapper = SequencePooling(Probe(), ["a", "s", "b"], {"s": First()})
    sparse = torch.randn(2, 3, 4)
    values = torch.randn(2, 3, 4)
    wrapper(torch.zeros(2, 0), sparse, {"s": padded(values, [3, 3])})
    torch.testing.assert_close(seen[0][:, 1], values[:, 0])
    torch.testing.assert_close(seen[0][:, [0, 2]], sparse[:, [0, 2]])


@pytest.mark.parametrize(
    ("pooling", "sequences", "path"),
    [
        ({"hist": {"type": "attention"}}, [], "model.params.sequence_pooling"),
        ({"user": {"type": "attention"}}, ["hist"], "model.params.sequence_pooling.user"),
        ({"hist": {"type": "lstm"}}, ["hist"], "model.params.sequence_pooling.hist.type"),
        (
            {"hist": {"heads": 2, "hidden": [4]}},
            ["hist"],
            "model.params.sequence_pooling.hist.hidden",
        ),
        ({"hist": {"heads": 3}}, ["hist"], "model.params.sequence_pooling.hist"),
        ({"hist": {"type": "target_attention"}}, ["hist"], "model.params.sequence_pooling.hist"),
        (
            {"hist": {"type": "target_attention", "query": "nope"}},
            ["hist"],
            "model.params.sequence_pooling.hist",
        ),
        (
            {"hist": {"type": "target_attention", "query": "tags"}},
            ["hist", "tags"],
            "model.params.sequence_pooling.hist.query",
        ),
    ],
)
def test_sequence_pooling_config_errors_name_the_field(
    pooling: dict, sequences: list[str], path: str
) -> None:
    with pytest.raises(ConfigError) as info:
        build_model(
            "dcnv2",
            {"sequence_pooling": pooling},
            num_dense=0,
            num_sparse=3,
            embedding_dim=4,
            features=["user", "hist", "tags"],
            sequence_features=sequences,
        )
    assert info.value.path == path


def test_accepts_sequences_reads_the_forward_signature() -> None:
    class Two(nn.Module):
        def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
            return dense

    class Three(nn.Module):
        def forward(
            self, dense: torch.Tensor, sparse: torch.Tensor, sequences: dict
        ) -> torch.Tensor:
            return dense

    assert not accepts_sequences(Two()) and accepts_sequences(Three())
