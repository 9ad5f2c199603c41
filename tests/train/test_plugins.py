"""Plugins end to end: an optimizer and a model that are not built in, one added
through a Python entry point and one registered in Python, named from a job file
and trained through ``Trainer``."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import estuary
from estuary import plugins
from estuary.config import ConfigError

# An entry-point plugin: a sign-SGD sparse optimizer (w -= lr * sign(g)) in a
# third-party module, counting its steps so the test sees it ran.
PLUGIN = """
import numpy as np
from estuary.embedding.optimizers import SGDParams, SparseOptimizer

STEPS = []

class SignSGD(SparseOptimizer):
    params_type = SGDParams

    def update(self, storage, rows, grads, lr, decay):
        STEPS.append(rows.size)
        d = self.dim
        storage[rows, :d] -= np.float32(lr) * np.sign(grads)
"""


def write_data(path: Path, rows: int, seed: int = 0) -> None:
    """CSV rows whose label depends on the sparse column C1 (so it is learnable)."""
    rng = np.random.default_rng(seed)
    lines = ["label,I1,C1,C2"]
    for _ in range(rows):
        c1, c2 = int(rng.integers(0, 30)), int(rng.integers(0, 30))
        label = int(rng.random() < (0.85 if c1 % 3 == 0 else 0.15))
        lines.append(f"{label},{int(rng.integers(0, 9))},c{c1},d{c2}")
    path.write_text("\n".join(lines) + "\n")


class Bilinear(torch.nn.Module):
    """A model registered in Python: logits = w . flatten(sparse) + v . dense."""

    def __init__(self, num_dense: int, num_sparse: int, embedding_dim: int, scale: float = 1.0):
        super().__init__()
        self.scale = scale
        self.linear = torch.nn.Linear(num_dense + num_sparse * embedding_dim, 1)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return self.scale * self.linear(torch.cat([dense, sparse.flatten(1)], 1)).squeeze(1)


def installed_optimizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, source: str, attr: str
) -> Iterator[None]:
    """Optimizer ``name`` as an ``estuary.optimizers`` entry point of an installed
    distribution ``estuary-<name>`` (module ``estuary_<name>``: ``source``), and
    ``bilinear`` registered with ``register_model``; both removed afterwards."""
    module = f"estuary_{name}"
    site = tmp_path / "site"
    site.mkdir()
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{module}-0.1.dist-info"
    info.mkdir()
    dist = module.replace("_", "-")
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[estuary.optimizers]\n{name} = {module}:{attr}\n")
    monkeypatch.syspath_prepend(str(site))
    estuary.register_model("bilinear", Bilinear)
    try:
        yield
    finally:
        plugins.MODELS.unregister("bilinear")
        plugins.OPTIMIZERS.unregister(name)
        sys.modules.pop(module, None)


@pytest.fixture
def plugin_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``sign_sgd`` as an entry point of an installed distribution, and ``bilinear``."""
    yield from installed_optimizer(tmp_path, monkeypatch, "sign_sgd", PLUGIN, "SignSGD")


def write_job(tmp_path: Path, optimizer: dict[str, object]) -> Path:
    write_data(tmp_path / "train.csv", 3000)
    job = {
        "data": {
            "sources": [{"path": "train.csv", "format": "csv"}],
            "schema": {"label": "label", "dense": ["I1"], "sparse": ["C1", "C2"]},
            "eval_fraction": 0.2,
        },
        "model": {
            "type": "bilinear",
            "params": {"scale": 2.0},
            "embedding": {"default": {"dim": 4, "optimizer": optimizer}},
        },
        "train": {"batch_size": 64, "epochs": 2, "seed": 3},
        "output": {"dir": "out", "progress": False, "checkpoint": False},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.mark.usefixtures("plugin_installed")
def test_plugin_optimizer_and_model_named_in_a_job_file_train_end_to_end(tmp_path: Path) -> None:
    job = estuary.load_job(write_job(tmp_path, {"name": "sign_sgd", "lr": 0.05}))
    assert job.table_spec("C1").optimizer.name == "sign_sgd"
    trainer = estuary.Trainer(job)
    assert isinstance(trainer.model, Bilinear) and trainer.model.scale == 2.0
    result = trainer.fit(progress=False)
    steps = sys.modules["estuary_sign_sgd"].STEPS
    assert len(steps) == 2 * 2 * (2400 // 64 + 1)  # 2 tables x 2 epochs x batches
    assert result.auc > 0.75  # C1 carries the label: the plugin optimizer learned it


@pytest.mark.usefixtures("plugin_installed")
def test_a_plugin_optimizer_refuses_parameters_it_does_not_declare(tmp_path: Path) -> None:
    path = write_job(tmp_path, {"name": "sign_sgd", "lr": 0.05, "eps": 0.1})
    with pytest.raises(ConfigError) as err:
        estuary.load_job(path)
    assert str(err.value) == (
        "model.embedding.default.optimizer.eps: not a parameter of optimizer 'sign_sgd' "
        "(its parameters: lr, weight_decay, clip)"
    )


def test_an_unknown_optimizer_lists_the_known_names_with_the_field_path(tmp_path: Path) -> None:
    path = write_job(tmp_path, {"name": "adagard", "lr": 0.05})
    with pytest.raises(ConfigError) as err:
        estuary.load_job(path)
    assert str(err.value) == (
        "model.embedding.default.optimizer.name: must be one of 'sgd', 'adagrad', 'adam', "
        "'ftrl', 'rowwise_adagrad', 'rowwise_adagrad_elem', 'rowwise_adam'; got str 'adagard' "
        "(did you mean 'adagrad'?)"
    )


# An entry-point plugin with a parameter of its own: Lion's ``beta`` (momentum
# decay), declared with its type, default and check, read from ``self.params``.
LION = """
from dataclasses import dataclass

import numpy as np
from estuary.config import ConfigError
from estuary.embedding.optimizers import SGDParams, SparseOptimizer

BETAS = []

@dataclass(frozen=True)
class LionParams(SGDParams):
    beta: float = 0.9

    def validate(self, path):
        if not 0.0 <= self.beta < 1.0:
            raise ConfigError(f"{path}.beta", "must be in [0, 1)")

class Lion(SparseOptimizer):
    state_names = ("momentum",)
    params_type = LionParams

    def update(self, storage, rows, grads, lr, decay):
        BETAS.append(self.params.beta)
        d, beta = self.dim, np.float32(self.params.beta)
        m = storage[rows, d : 2 * d]
        mixed = beta * m + (np.float32(1.0) - beta) * grads
        storage[rows, :d] = storage[rows, :d] * np.float32(decay) - np.float32(lr) * np.sign(mixed)
        storage[rows, d : 2 * d] = mixed
"""


@pytest.fixture
def lion_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``lion`` as an ``estuary.optimizers`` entry point of an installed distribution."""
    yield from installed_optimizer(tmp_path, monkeypatch, "lion", LION, "Lion")


@pytest.mark.usefixtures("lion_installed")
def test_a_plugin_optimizer_parameter_is_set_from_a_job_file_trains_and_resumes(
    tmp_path: Path,
) -> None:
    from estuary.config import job_from_dict, to_dict
    from estuary.train.callbacks import FaultInjection, LoopState
    from estuary.train.checkpoint import load_checkpoint

    path = write_job(tmp_path, {"name": "lion", "lr": 0.01, "beta": 0.8})
    job = estuary.load_job(path)
    optimizer = job.table_spec("C1").optimizer
    assert optimizer.name == "lion" and optimizer.extra == {"beta": 0.8}
    flat = to_dict(job)["model"]["embedding"]["default"]["optimizer"]
    assert flat["beta"] == 0.8 and "extra" not in flat  # the section stays flat
    assert job_from_dict(to_dict(job), base_dir=tmp_path).table_spec("C1") == job.table_spec("C1")

    reference = estuary.Trainer(job)
    want = reference.fit(progress=False)
    assert set(sys.modules["estuary_lion"].BETAS) == {0.8}  # the parameter reached the kernel
    assert want.auc > 0.75

    saving = ["output.checkpoint=true", "output.checkpoint_every_steps=20"]
    job = estuary.load_job(path, overrides=[f"output.dir={tmp_path / 'crashed'}", *saving])

    def crash(state: LoopState) -> None:
        raise RuntimeError("crash")

    with pytest.raises(RuntimeError, match="crash"):
        estuary.Trainer(job, callbacks=[FaultInjection(crash, at_step=50)]).fit(progress=False)
    folder = tmp_path / "crashed" / "checkpoints"
    newest = load_checkpoint(folder)
    assert newest.manifest["step"] == 40
    stored = newest.manifest["metadata"]["job"]["model"]["embedding"]["default"]["optimizer"]
    assert stored["beta"] == 0.8
    assert job_from_dict(newest.manifest["metadata"]["job"]).table_spec("C1") == job.table_spec(
        "C1"
    )

    resumed = estuary.Trainer(job)
    resumed.load_checkpoint(folder)
    got = resumed.fit(progress=False)
    assert resumed.step == reference.step
    for name, table in reference.tables.items():
        a, b = resumed.tables[name].state_dict(), table.state_dict()
        order_a, order_b = np.argsort(a["ids"]), np.argsort(b["ids"])
        for key in ("ids", "weights", "opt.momentum"):
            np.testing.assert_allclose(
                np.asarray(a[key])[order_a], np.asarray(b[key])[order_b], rtol=1e-6, atol=1e-7
            )
    assert got.auc == pytest.approx(want.auc, abs=1e-6)


@pytest.mark.usefixtures("lion_installed")
@pytest.mark.parametrize(
    ("optimizer", "message"),
    [
        (
            {"name": "lion", "gamma": 0.5},
            "model.embedding.default.optimizer.gamma: not a parameter of optimizer 'lion' "
            "(its parameters: lr, weight_decay, clip, beta)",
        ),
        (
            {"name": "lion", "beta": "high"},
            "model.embedding.default.optimizer.beta: expected float, got str 'high'",
        ),
        (
            {"name": "lion", "beta": 1.5},
            "model.embedding.default.optimizer.beta: must be in [0, 1)",
        ),
        (
            {"name": "adam", "beta": 0.5},
            "model.embedding.default.optimizer.beta: unknown key (did you mean 'beta2'?)",
        ),
        (
            {"name": "sgd", "momentum": 0.5},
            "model.embedding.default.optimizer.momentum: not a parameter of optimizer 'sgd' "
            "(its parameters: lr, weight_decay, clip)",
        ),
    ],
)
def test_an_optimizer_parameter_is_checked_against_the_named_optimizers_own(
    tmp_path: Path, optimizer: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        estuary.load_job(write_job(tmp_path, optimizer))
    assert str(err.value) == message


@pytest.mark.usefixtures("lion_installed")
def test_a_table_switching_from_a_plugin_optimizer_drops_its_own_parameters(
    tmp_path: Path,
) -> None:
    path = write_job(tmp_path, {"name": "lion", "lr": 0.01, "beta": 0.8})
    job = estuary.load_job(path, overrides=["model.embedding.tables.C1.optimizer.name=adam"])
    assert job.table_spec("C2").optimizer.extra == {"beta": 0.8}
    switched = job.table_spec("C1").optimizer
    assert (switched.name, switched.lr, switched.extra) == ("adam", 0.01, {})
