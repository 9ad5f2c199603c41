import pytest
import torch

from estuary.config import ConfigError
from estuary.nn.models import DLRM, MODELS, build_model


@pytest.mark.parametrize(
    ("name", "params", "dim"),
    [
        ("dlrm", {"bottom_mlp": [32, 8], "top_mlp": [16]}, 8),
        ("deepfm", {"mlp": [16], "dropout": 0.1}, 9),
        ("dcnv2", {"cross_layers": 2, "mlp": [16], "low_rank": 4}, 8),
        ("dcnv2", {"cross_layers": 1, "mlp": [16]}, 8),
        ("logreg", {}, 1),
    ],
)
def test_every_model_maps_dense_and_sparse_to_one_logit_per_row(
    name: str, params: dict, dim: int
) -> None:
    model = build_model(name, params, num_dense=13, num_sparse=5, embedding_dim=dim)
    dense = torch.randn(7, 13)
    sparse = torch.randn(7, 5, dim, requires_grad=True)
    logits = model(dense, sparse)
    assert logits.shape == (7,)
    logits.sum().backward()
    assert sparse.grad is not None and sparse.grad.abs().sum() > 0


def test_models_work_without_dense_features() -> None:
    for name, dim, params in [
        ("dlrm", 8, {"bottom_mlp": [8]}),
        ("deepfm", 5, {}),
        ("dcnv2", 4, {}),
    ]:
        model = build_model(name, params, num_dense=0, num_sparse=3, embedding_dim=dim)
        assert model(torch.zeros(2, 0), torch.randn(2, 3, dim)).shape == (2,)


def test_dlrm_interaction_uses_every_pair_once() -> None:
    model = DLRM(num_dense=2, num_sparse=3, embedding_dim=4, bottom_mlp=[4], top_mlp=[8])
    # 4 vectors -> 6 pairs; top MLP input = 4 (bottom output) + 6
    assert model.top[0].in_features == 10


def test_unknown_model_and_parameter_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"model.type: unknown model 'nope'"):
        build_model("nope", {}, num_dense=1, num_sparse=1, embedding_dim=4)
    with pytest.raises(ConfigError, match=r"model.params.top_mpl: unknown parameter for dlrm"):
        build_model("dlrm", {"top_mpl": [1]}, num_dense=1, num_sparse=1, embedding_dim=4)
    with pytest.raises(ConfigError, match=r"model.params.bottom_mlp: last size must equal"):
        build_model("dlrm", {"bottom_mlp": [8, 3]}, num_dense=1, num_sparse=1, embedding_dim=4)
    assert {"dlrm", "deepfm", "dcnv2", "logreg"} <= set(MODELS)
