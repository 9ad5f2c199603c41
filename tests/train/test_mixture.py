"""Mixture training (``model.type: mixture``): towers, gate, split tables, and
the update rules applied per batch origin, checked against a reference step."""

from __future__ import annotations

import copy
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from estuary.config import ConfigError, JobSpec, job_from_dict, load_job
from estuary.data.synthetic import SyntheticSpec, SynthOutput, write_synthetic
from estuary.data.types import Batch, JaggedIds
from estuary.nn.mixture import MixtureModel
from estuary.nn.mixture_rules import MixtureRules, Rule
from estuary.runtime.launcher import run_distributed
from estuary.train import Trainer
from estuary.train.checkpoint import load_checkpoint
from estuary.train.mixture import HistoryIds, MixturePlans, find_mixture

START = datetime(2026, 1, 1, tzinfo=UTC)
HOURS, ROWS, BATCH = 4, 600, 50
SPEC = SyntheticSpec(
    rows_per_hour=ROWS,
    hours=HOURS,
    start=START,
    num_dense=2,
    vocab_sizes=(40,) * 3,
    num_interactions=0,
    drift=1.5,
    drift_fraction=1.0,
    diurnal_amplitude=0.0,
    missing_rate=0.0,
    signal_scale=2.0,
    drift_kind="abrupt",
    drift_at=START + timedelta(hours=2),
    seed=3,
)
COLUMNS = ["label", "I1", "I2", "C1", "C2", "C3"]


def mixture_params(**over: Any) -> dict[str, Any]:
    params: dict[str, Any] = {
        "memory": {"type": "dlrm", "params": {"bottom_mlp": [4], "top_mlp": [4]}},
        "adapt": {"type": "dcnv2", "params": {"cross_layers": 1, "mlp": [4]}},
        "combine": "gate",
        "update": {
            "history_streams": ["hist"],
            "history": {"memory": 1, "adapt": 1, "gate": 1, "embeddings": 1},
            "stream": {"memory": 0, "adapt": 3, "gate": 1, "embeddings": 0.2},
        },
    }
    params.update(over)
    return params


def job_for(
    root: Path,
    params: dict[str, Any],
    dim: int = 4,
    model_type: str = "mixture",
    init: dict[str, Any] | None = None,
    **train: Any,
) -> JobSpec:
    """History hours [0, 2) in stream ``hist``, hours [2, 4) in stream ``live``."""

    def source(name: str, start: int, end: int) -> dict[str, Any]:
        return {
            "name": name,
            "path": "data/{{YYYY}}{{MM}}{{DD}}/{{HH}}/part-*.tsv",
            "columns": COLUMNS,
            "start": f"2026-01-01T{start:02d}",
            "end": f"2026-01-01T{end:02d}",
        }

    return job_from_dict(
        {
            "data": {
                "schema": {"dense": ["I1", "I2"], "sparse": ["C1", "C2", "C3"]},
                "dataset": {
                    "streams": {
                        "hist": {"sources": [source("synth", 0, 2)]},
                        "live": {"sources": [source("feed", 2, HOURS)]},
                    },
                    "timer": {"poll_interval_s": 0.01, "ready_timeout_s": 2},
                },
            },
            "model": {
                "type": model_type,
                "params": params,
                "embedding": {
                    "default": {
                        "dim": dim,
                        "optimizer": {"name": "sgd", "lr": 0.5},
                        **({"initializer": init} if init else {}),
                    }
                },
            },
            "train": {
                "batch_size": BATCH,
                "threads": 1,
                "dense_optimizer": {"name": "sgd", "lr": 0.1},
                "progressive_eval": True,
                **train,
            },
            "output": {"dir": "out", "progress": False},
        },
        base_dir=root,
    )


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mixture")
    write_synthetic(SPEC, root / "data", SynthOutput(format="criteo_tsv"))
    return root


def tower_state(model: MixtureModel, part: str) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in getattr(model, part).state_dict().items()}


def fit_and_watch(trainer: Trainer) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
    """Fit; returns the progressive report and the towers' state at the first
    stream batch (the end of the history)."""
    mixture = find_mixture(trainer.engine.model)
    assert mixture is not None and trainer.plan_for is not None
    inner, at_boundary = trainer.plan_for, {}

    def plan_for(batch: Any) -> Any:
        if batch.origin.startswith("live/") and not at_boundary:
            at_boundary.update({p: tower_state(mixture, p) for p in ("memory", "adapt")})
        return inner(batch)

    trainer.plan_for = plan_for
    result = trainer.fit()
    return result.extra["progressive"], at_boundary


@pytest.mark.parametrize("mode", ["sync", "hybrid"])
def test_stream_rows_leave_the_frozen_memory_tower_unchanged(data_root: Path, mode: str) -> None:
    job = job_for(data_root, mixture_params(), mode=mode, staleness=2)
    trainer = Trainer(job)
    report, boundary = fit_and_watch(trainer)
    mixture = find_mixture(trainer.engine.model)
    assert mixture is not None and boundary
    for name, value in tower_state(mixture, "memory").items():
        assert torch.equal(value, boundary["memory"][name]), name  # frozen on stream rows
    changed = [
        n
        for n, v in tower_state(mixture, "adapt").items()
        if not torch.equal(v, boundary["adapt"][n])
    ]
    assert changed  # the adapt tower learnt from the stream
    assert set(report["origins"]) >= {"hist/synth", "live/feed"}
    assert report["origins"]["live/feed"]["rows"] == 2 * ROWS
    assert len(report["windows"]) == HOURS


def test_split_tables_keep_the_memory_columns_of_stream_rows(data_root: Path) -> None:
    params = mixture_params(embeddings="split", memory_dim=3, combine="sum")
    params["memory"] = {"type": "dlrm", "params": {"bottom_mlp": [3], "top_mlp": [4]}}
    params["adapt"] = {"type": "logreg", "params": {}}
    trainer = Trainer(job_for(data_root, params, dim=4))
    tables = trainer.tables
    keys: dict[str, np.ndarray] = {}
    rows_at_boundary: dict[str, np.ndarray] = {}
    inner = trainer.plan_for
    assert inner is not None

    def plan_for(batch: Any) -> Any:
        if batch.origin.startswith("live/") and not rows_at_boundary:
            for name, table in tables.items():
                state = table.state_dict()
                keys[name], rows_at_boundary[name] = state["ids"], state["weights"].copy()
        return inner(batch)

    trainer.plan_for = plan_for
    trainer.fit()
    moved_adapt = 0
    for name, table in tables.items():
        state = table.state_dict()
        now = dict(zip(state["ids"].tolist(), state["weights"], strict=True))
        before = rows_at_boundary[name]
        for key, row in zip(keys[name].tolist(), before, strict=True):
            np.testing.assert_array_equal(now[key][:3], row[:3])  # memory columns kept
            moved_adapt += int(not np.array_equal(now[key][3:], row[3:]))
    assert moved_adapt > 0  # the adapt column (logreg weight) did learn


def test_a_stream_step_matches_a_reference_step(data_root: Path) -> None:
    """One stream batch: memory tower untouched, adapt tower at 3 x lr, gate at
    1 x lr, embedding rows at 0.2 x lr (plain SGD, recomputed by hand)."""
    trainer = Trainer(job_for(data_root, mixture_params()))
    engine, updater = trainer.engine, trainer.sparse_updater()
    mixture = find_mixture(engine.model)
    assert mixture is not None and trainer.plan_for is not None
    rng = np.random.default_rng(0)
    batch = Batch(  # ids repeat within the batch (20 values, 50 rows)
        labels=(rng.random(BATCH) < 0.3).astype(np.float32),
        dense=rng.random((BATCH, 2)).astype(np.float32),
        sparse={f: JaggedIds.single(rng.integers(0, 20, BATCH)) for f in trainer.features},
        origin="live/feed",
    )
    assert isinstance(mixture.gate, torch.nn.Linear)
    with torch.no_grad():  # a gate already trained away from its zero start
        mixture.gate.weight.normal_(0, 0.5)
        mixture.gate.bias.fill_(0.7)
    looked_up = engine.lookup(batch)  # inserts the ids
    reference = copy.deepcopy(mixture)
    ids = {f: batch.sparse[f].values for f in trainer.features}
    rows_before = {
        f: trainer.tables[f].lookup(ids[f], train=False).copy() for f in trainer.features
    }
    # Reference gradients: the same forward on leaf copies of the rows.
    leaves = {f: torch.tensor(rows_before[f], requires_grad=True) for f in trainer.features}
    sparse = torch.stack([leaves[f] for f in trainer.features], dim=1)  # (B, F, D)
    reference.train()
    reference.use_rule(mixture.rules.stream)
    logits = reference(torch.from_numpy(batch.dense), sparse)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(
        logits, torch.from_numpy(batch.labels)
    )
    loss.backward()

    engine.step(batch, looked_up, updater, trainer.plan_for(batch))
    updater.flush()
    scale = {"memory": 0.0, "adapt": 3.0, "gate": 1.0}
    for name, after in mixture.named_parameters():
        ref = dict(reference.named_parameters())[name]
        assert ref.grad is not None
        want = ref.detach() - 0.1 * scale[name.split(".")[0]] * ref.grad
        torch.testing.assert_close(after.detach(), want, rtol=1e-5, atol=1e-6, msg=name)
    for f in trainer.features:  # one id per row; repeated ids sum their gradients
        grads = leaves[f].grad
        assert grads is not None
        uniq, inverse = np.unique(ids[f], return_inverse=True)
        summed = np.zeros((len(uniq), grads.shape[1]), np.float32)
        np.add.at(summed, inverse, grads.numpy())
        before = trainer.tables[f].lookup(uniq, train=False)
        start = {k: r for k, r in zip(ids[f].tolist(), rows_before[f], strict=True)}
        want = np.stack([start[k] for k in uniq.tolist()]) - 0.5 * 0.2 * summed
        np.testing.assert_allclose(before, want, rtol=1e-5, atol=1e-6)


def test_rules_pick_the_kind_by_stream_and_name_bad_fields() -> None:
    rules = MixtureRules.parse({"history_streams": ["hist"], "unknown_origin": "stream"})
    assert rules.kind("hist/a") == "history"
    assert rules.kind("live/a") == "stream"
    assert rules.kind(None) == "stream"
    assert rules.stream == Rule(memory=0.0, adapt=1.0, gate=1.0, embeddings=0.1)
    with pytest.raises(ConfigError, match=r"model\.params\.update\.stream\.memroy"):
        MixtureRules.parse({"stream": {"memroy": 0}})
    with pytest.raises(ConfigError, match=r"model\.params\.update\.history\.adapt"):
        MixtureRules.parse({"history": {"adapt": -1}})


def test_bad_tower_and_split_settings_name_their_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.params\.adapt\.params\.bogus"):
        Trainer(job_for(tmp_path, mixture_params(adapt={"type": "dlrm", "params": {"bogus": 1}})))
    with pytest.raises(ConfigError, match=r"model\.params\.memory_dim"):
        Trainer(job_for(tmp_path, mixture_params(embeddings="split", memory_dim=4)))
    with pytest.raises(ConfigError, match=r"model\.params\.memory\.type"):
        Trainer(job_for(tmp_path, mixture_params(memory={"type": "nope"})))


@pytest.mark.parametrize("learns_new_ids", [False, True])
def test_two_trainers_equal_one_trainer_on_the_whole_batch(
    data_root: Path, learns_new_ids: bool
) -> None:
    """``--nproc 2`` (sync): each rank takes half of every batch and picks the
    same plan from the batch's origin; the result is one trainer's on the whole
    batch, memory tower frozen over the stream included. With
    ``memory_learns_new_ids`` every rank knows the history ids of both halves
    (a rank's own half alone would call some of them new)."""
    if learns_new_ids:
        params = mixture_params(
            combine="sum", embeddings="split", memory_dim=4, memory_learns_new_ids=True
        )
        dims = {"dim": 8}
    else:
        params, dims = mixture_params(combine="sum"), {}
    world = 2
    job = job_for(
        data_root, params, mode="sync", progressive_eval=False, batch_size=BATCH // 2, **dims
    )
    job = replace(job, output=replace(job.output, dir="out2"))
    result = run_distributed(job, trainers=world, startup_timeout_s=60)
    assert result.train_rows == HOURS * ROWS
    reference = Trainer(job_for(data_root, params, mode="sync", **dims))
    _, boundary = fit_and_watch(reference)
    ckpt = load_checkpoint(data_root / "out2")
    if learns_new_ids:
        history = reference.checkpointer.extras["history_ids"]
        assert isinstance(history, HistoryIds) and history.seen
        saved = ckpt.extra("history_ids")
        assert saved is not None
        assert {f: set(t.tolist()) for f, t in saved.items()} == history.seen
    for key, value in reference.model.state_dict().items():
        torch.testing.assert_close(ckpt.dense[key], value, rtol=1e-5, atol=1e-6, msg=key)
        if key.startswith("memory."):
            assert torch.equal(value, boundary["memory"][key.removeprefix("memory.")])
    for name, table in reference.tables.items():
        want, got = table.state_dict(), ckpt.tables[name]
        order_w, order_g = np.argsort(want["ids"]), np.argsort(got["ids"])
        np.testing.assert_array_equal(got["ids"][order_g], want["ids"][order_w])
        np.testing.assert_allclose(
            got["weights"][order_g], want["weights"][order_w], rtol=1e-5, atol=1e-6
        )


def test_history_rows_train_the_memory_tower_exactly_as_a_model_of_its_own(
    data_root: Path,
) -> None:
    """Rules ``history: {adapt: 0, gate: 0}``, split tables: the gate starts at
    zero, so on history the mixture is its memory tower, which starts and trains
    as the same model built alone (same seed, same columns); scored as history,
    it answers as that model, and after stream rows it still does."""
    tower = {"type": "dlrm", "params": {"bottom_mlp": [4], "top_mlp": [4]}}
    params = mixture_params(
        memory=tower,
        adapt={"type": "dcnv2", "params": {"cross_layers": 1, "mlp": [4]}},
        embeddings="split",
        memory_dim=4,
        adapt_reads="all",
        update={
            "history_streams": ["hist"],
            "history": {"memory": 1, "adapt": 0, "gate": 0, "embeddings": 1},
            "stream": {"memory": 0, "adapt": 2, "gate": 1, "embeddings": 1},
        },
    )
    init = {"name": "uniform", "scale": 0.5}  # a column's value: (seed, id, column) only
    mix = Trainer(job_for(data_root, params, dim=8, init=init))
    alone = Trainer(job_for(data_root, tower["params"], dim=4, model_type="dlrm", init=init))
    mixture = find_mixture(mix.engine.model)
    assert mixture is not None and mix.plan_for is not None
    rng = np.random.default_rng(1)

    def batch(origin: str) -> Batch:
        return Batch(
            labels=(rng.random(BATCH) < 0.3).astype(np.float32),
            dense=rng.random((BATCH, 2)).astype(np.float32),
            sparse={f: JaggedIds.single(rng.integers(0, 30, BATCH)) for f in mix.features},
            origin=origin,
        )

    history = [batch("hist/synth") for _ in range(6)]
    up_mix, up_alone = mix.sparse_updater(), alone.sparse_updater()
    for b in history:
        mix.engine.step(b, mix.engine.lookup(b), up_mix, mix.plan_for(b))
        alone.engine.step(b, alone.engine.lookup(b), up_alone)
        torch.testing.assert_close(mix.engine.last_logits, alone.engine.last_logits)
    for b in [batch("live/feed") for _ in range(4)]:
        mix.engine.step(b, mix.engine.lookup(b), up_mix, mix.plan_for(b))
    assert mixture.last_gate is not None and mixture.last_gate.abs().max() > 0  # it learnt
    mixture.score_as("history")
    for b in history:
        np.testing.assert_allclose(mix.predict(b), alone.predict(b), rtol=1e-5, atol=1e-6)
    mixture.score_as(None)
    assert not np.allclose(mix.predict(history[0]), alone.predict(history[0]), atol=1e-4)


def test_two_hybrid_trainers_never_move_a_frozen_tower_or_its_columns(data_root: Path) -> None:
    """``--nproc 2``, hybrid mode, every row a stream row with the memory tower
    frozen (split tables): after the run the memory tower and every id's memory
    columns still hold their initial values, while the adapt side learnt."""
    params = mixture_params(
        embeddings="split",
        memory_dim=4,
        combine="sum",
        memory={"type": "dlrm", "params": {"bottom_mlp": [4], "top_mlp": [4]}},
        adapt={"type": "logreg", "params": {}},
        update={"history_streams": [], "stream": {"memory": 0, "adapt": 1, "embeddings": 1}},
    )
    job = job_for(
        data_root,
        params,
        dim=5,
        mode="hybrid",
        staleness=2,
        progressive_eval=False,
        batch_size=BATCH // 2,
    )
    job = replace(job, output=replace(job.output, dir="out-hybrid"))
    result = run_distributed(job, trainers=2, startup_timeout_s=60)
    assert result.train_rows == HOURS * ROWS
    fresh = Trainer(job)  # same seed: the initial weights and rows
    ckpt = load_checkpoint(data_root / "out-hybrid")
    for key, value in fresh.model.state_dict().items():
        if key.startswith("memory."):
            torch.testing.assert_close(ckpt.dense[key], value, rtol=0, atol=0, msg=key)
    adapt_moved = False
    for name, got in ckpt.tables.items():
        initial = fresh.tables[name].lookup(got["ids"], train=True)  # inserts: initial rows
        np.testing.assert_array_equal(got["weights"][:, :4], initial[:, :4])
        adapt_moved |= not np.array_equal(got["weights"][:, 4], initial[:, 4])
    assert adapt_moved


def test_the_example_job_trains_history_then_stream(tmp_path: Path) -> None:
    """examples/mixture.yaml on a small copy of its data: both origins are
    scored, one table row per id holds both towers' columns."""
    root = Path(__file__).resolve().parents[2]
    (tmp_path / "examples").mkdir()
    example = (root / "examples" / "mixture.yaml").read_text()
    (tmp_path / "examples" / "mixture.yaml").write_text(example)
    spec = replace(
        SPEC,
        rows_per_hour=200,
        hours=8,
        vocab_sizes=(30,) * 6,
        drift_at=START + timedelta(hours=4),
    )
    write_synthetic(spec, tmp_path / "data" / "mixture", SynthOutput(format="criteo_tsv"))
    job = load_job(tmp_path / "examples" / "mixture.yaml")
    trainer = Trainer(job)
    assert find_mixture(trainer.engine.model) is not None and trainer.plan_for is not None
    report = trainer.fit().extra["progressive"]
    assert len(report["windows"]) == 8
    assert report["origins"]["history/synth"]["rows"] == 4 * 200
    assert report["origins"]["stream/live"]["rows"] == 4 * 200
    assert all(t.dim == 16 for t in trainer.tables.values())


def test_the_history_ids_are_checkpointed_and_a_resume_knows_them(
    data_root: Path, tmp_path: Path
) -> None:
    """``memory_learns_new_ids``: the ids the history had are saved with the
    checkpoint (safetensors, listed in the manifest) and restored by a resume,
    so its stream rows are not all "new"."""
    params = mixture_params(embeddings="split", memory_dim=4, memory_learns_new_ids=True)
    job = job_for(data_root, params, dim=8)
    job = replace(job, output=replace(job.output, dir=str(tmp_path / "out"), checkpoint=True))
    trainer = Trainer(job)
    trainer.fit()
    plans = trainer.plan_for
    assert isinstance(plans, MixturePlans) and plans.history_ids is not None
    seen = plans.history_ids.seen
    assert set(seen) == {"C1", "C2", "C3"} and all(len(ids) > 5 for ids in seen.values())
    folder = tmp_path / "out" / "checkpoints"
    ckpt = load_checkpoint(folder)
    assert ckpt.manifest["extras"] == ["history_ids", "progressive"]  # progressive_eval is on
    assert "extra/history_ids.safetensors" in ckpt.manifest["files"]
    saved = ckpt.extra("history_ids")
    assert saved is not None and saved["C1"].dtype == torch.int64
    assert set(saved["C1"].tolist()) == seen["C1"]
    # The asynchronous path (output.checkpoint_async) carries them too.
    trainer.state.step += 1
    staged = trainer.checkpointer.save_async(trainer.engine.sparse_updater(), trainer.state)
    trainer.checkpointer.wait()
    later = load_checkpoint(staged).extra("history_ids")
    assert later is not None and set(later["C2"].tolist()) == seen["C2"]

    resumed = Trainer(job)
    fresh = resumed.plan_for
    assert isinstance(fresh, MixturePlans) and fresh.history_ids is not None
    stream = Batch(
        labels=np.zeros(2, np.float32),
        dense=np.zeros((2, 2), np.float32),
        sparse={f: JaggedIds.single(np.array([min(seen[f]), 10**12])) for f in seen},
    )
    assert fresh.history_ids.new(stream, list(seen)).tolist() == [[True] * 3, [True] * 3]
    resumed.load_checkpoint(folder)
    assert fresh.history_ids.seen == seen
    assert fresh.history_ids.new(stream, list(seen)).tolist() == [[False] * 3, [True] * 3]
    fresh.history_ids.restore_state(None)  # a checkpoint from before: none known
    assert fresh.history_ids.seen == {}
