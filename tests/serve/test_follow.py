"""Following a run: deltas change the rows whose ids they touched and no others;
dense swaps and full checkpoints swap in whole; versions name what is served."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from estuary.serve.checkpoints import model_from_checkpoint
from estuary.serve.follow import Follower, UpdateKind, plan_update
from estuary.serve.link_reader import read_link
from estuary.train.checkpoint import load_checkpoint, load_link
from estuary.train.checkpoint_chain import CheckpointError

from .conftest import TinyRun, instances

FULL, D1, D2, D3 = "step-000000060", "step-000000070", "step-000000080", "step-000000090"
NEXT_FULL = "step-000000100-2"


def land(run: TinyRun, follow_dir: Path, *names: str) -> None:
    """Checkpoints ``names`` land in ``follow_dir`` as the trainer writes them:
    each folder whole, then ``latest``, both by rename (a follower polling in
    another process never reads a half-written ``latest``)."""
    root = follow_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for name in names:
        partial = root / f"{name}.tmp-land"
        shutil.copytree(run.run_dir / "checkpoints" / name, partial)
        os.replace(partial, root / name)
    pointer = root / "latest.tmp-land"
    pointer.write_text(names[-1] + "\n")
    os.replace(pointer, root / "latest")


def test_plan_update_applies_deltas_on_the_served_chain_and_reloads_otherwise() -> None:
    chain = [FULL, D1, D2]
    assert plan_update(D2, D2, chain, dense_due=True).kind is UpdateKind.NONE
    decision = plan_update(FULL, D2, chain, dense_due=False)
    assert (decision.kind, decision.links, decision.dense) == (UpdateKind.DELTA, [D1, D2], False)
    assert plan_update(D1, D2, chain, dense_due=True).links == [D2]
    assert plan_update("step-000000050", D2, chain, dense_due=True).kind is UpdateKind.FULL
    assert plan_update(D2, NEXT_FULL, [NEXT_FULL], dense_due=True).kind is UpdateKind.FULL


def test_a_delta_changes_the_rows_it_touched_and_no_others(
    tiny_run: TinyRun, tmp_path: Path
) -> None:
    land(tiny_run, tmp_path, FULL)
    ckpt = load_checkpoint(tmp_path)
    model = model_from_checkpoint(ckpt)
    follower = Follower(tmp_path, model, ckpt.path, dense_every_s=1e9)  # tables only
    # Every C2 value is trained in each 10 steps; new C2 values (their shard's
    # unknown row, not in the delta) leave C1 to tell touched rows from others.
    rows = [{**row, "C2": f"new-{i}"} for i, row in enumerate(instances(tiny_run.rows))]
    batch = model.pipeline.parse(rows)
    before = model.predict(batch)
    assert before.version == f"tiny@{FULL}"

    served = load_link(tmp_path / "checkpoints" / FULL).tables  # the rows served now
    land(tiny_run, tmp_path, D1)
    assert follower.poll() is UpdateKind.DELTA
    after = model.predict(batch)
    assert after.version == f"tiny@{D1}+dense@{FULL}"
    # The ids whose rows the delta changes (a delta may also carry rows whose
    # optimizer state changed and weights did not).
    delta = load_link(tmp_path / "checkpoints" / D1).tables
    touched = np.zeros(batch.num_rows, dtype=bool)
    for feature in ("C1", "C2"):
        old = dict(zip(served[feature]["ids"].tolist(), served[feature]["weights"], strict=True))
        ids = delta[feature]["ids"]
        moved = [
            i
            for i, w in zip(ids.tolist(), delta[feature]["weights"], strict=True)
            if i not in old or not np.array_equal(old[i], w)
        ]
        touched |= np.isin(batch.sparse[feature].values, moved)
    assert 0 < touched.sum() < batch.num_rows  # the data has rows of both kinds
    changed = before.probabilities != after.probabilities
    np.testing.assert_array_equal(changed, touched)
    assert follower.poll() is UpdateKind.NONE


@pytest.mark.parametrize("standby", [True, False], ids=["standby", "in-place"])
def test_following_ends_where_loading_the_checkpoint_ends(
    tiny_run: TinyRun, tmp_path: Path, standby: bool
) -> None:
    land(tiny_run, tmp_path, FULL)
    ckpt = load_checkpoint(tmp_path)
    model = model_from_checkpoint(ckpt, standby=standby)
    kinds: list[UpdateKind] = []
    follower = Follower(
        tmp_path,
        model,
        ckpt.path,
        on_update=lambda kind, age_s: kinds.append(kind),
        standby=standby,
    )
    batch = model.pipeline.parse(instances(tiny_run.eval_rows))
    land(tiny_run, tmp_path, D1, D2, D3)  # two deltas land between polls
    follower.poll()
    loaded = model_from_checkpoint(load_checkpoint(tmp_path / "checkpoints" / D3))
    assert model.predict(batch).version == f"tiny@{D3}"  # dense swapped with the deltas
    np.testing.assert_array_equal(
        model.predict(batch).probabilities, loaded.predict(batch).probabilities
    )
    if standby:  # updates swapped the copies; predictions held back only for the swap
        assert model.last_stall_s < 0.01
    land(tiny_run, tmp_path, NEXT_FULL)  # a new chain: reloaded whole
    follower.poll()
    assert kinds == [UpdateKind.DELTA, UpdateKind.FULL]
    reference = model_from_checkpoint(load_checkpoint(tiny_run.run_dir))
    assert model.predict(batch).version == f"tiny@{NEXT_FULL}"
    np.testing.assert_array_equal(
        model.predict(batch).probabilities, reference.predict(batch).probabilities
    )


def test_a_delta_that_does_not_fit_the_served_tables_reloads_whole(
    tiny_run: TinyRun, tmp_path: Path
) -> None:
    land(tiny_run, tmp_path, FULL, D1)
    model = model_from_checkpoint(load_checkpoint(tmp_path / "checkpoints" / FULL))
    # The follower believes D1 is served; the tables hold FULL's state.
    follower = Follower(tmp_path, model, tmp_path / "checkpoints" / D1)
    land(tiny_run, tmp_path, D2)
    assert follower.poll() is UpdateKind.FULL  # D2 does not apply on FULL: reloaded
    assert model.version == f"tiny@{D2}"
    batch = model.pipeline.parse(instances(tiny_run.eval_rows))
    loaded = model_from_checkpoint(load_checkpoint(tmp_path / "checkpoints" / D2))
    np.testing.assert_array_equal(
        model.predict(batch).probabilities, loaded.predict(batch).probabilities
    )


def test_a_broken_checkpoint_is_not_applied_and_serving_goes_on(
    tiny_run: TinyRun, tmp_path: Path
) -> None:
    land(tiny_run, tmp_path, FULL)
    ckpt = load_checkpoint(tmp_path)
    model = model_from_checkpoint(ckpt)
    follower = Follower(tmp_path, model, ckpt.path)
    land(tiny_run, tmp_path, D1)
    (tmp_path / "checkpoints" / D1 / "tables" / "C1.safetensors").write_bytes(b"torn")
    with pytest.raises(CheckpointError, match=r"C1\.safetensors"):
        follower.poll()
    assert model.version == f"tiny@{FULL}"


def test_dense_swaps_refill_the_replaced_network_and_serve_each_checkpoint(
    tiny_run: TinyRun, tmp_path: Path
) -> None:
    land(tiny_run, tmp_path, FULL)
    ckpt = load_checkpoint(tmp_path)
    model = model_from_checkpoint(ckpt, standby=True)
    first = model.dense_model
    follower = Follower(tmp_path, model, ckpt.path, dense_every_s=0.0)
    batch = model.pipeline.parse(instances(tiny_run.eval_rows))
    served = []
    for name in (D1, D2, D3):  # one dense swap each
        land(tiny_run, tmp_path, name)
        assert follower.poll() is UpdateKind.DELTA
        loaded = model_from_checkpoint(load_checkpoint(tmp_path / "checkpoints" / name))
        assert model.predict(batch).version == f"tiny@{name}"
        np.testing.assert_array_equal(
            model.predict(batch).probabilities, loaded.predict(batch).probabilities
        )
        served.append(model.dense_model)
    # Two networks in turn: the second swap refilled the one the first replaced.
    assert served[0] is not first and served[1] is first and served[2] is served[0]


def test_read_link_reads_what_load_link_reads_and_names_a_truncated_file(
    tiny_run: TinyRun, tmp_path: Path
) -> None:
    folder = tiny_run.run_dir / "checkpoints" / D1
    fast, reference = read_link(folder), load_link(folder)
    assert fast.manifest == reference.manifest
    assert sorted(fast.dense) == sorted(reference.dense)
    for key, tensor in reference.dense.items():
        assert fast.dense[key].dtype == tensor.dtype
        assert torch.equal(fast.dense[key], tensor)
    for name, state in reference.tables.items():
        assert sorted(fast.tables[name]) == sorted(state)
        for key, array in state.items():
            assert fast.tables[name][key].dtype == array.dtype
            np.testing.assert_array_equal(fast.tables[name][key], array)
    only = read_link(folder, table_keys=lambda key: key == "ids").tables["C1"]
    assert list(only) == ["ids"]
    land(tiny_run, tmp_path, D1)
    torn = tmp_path / "checkpoints" / D1 / "tables" / "C2.safetensors"
    torn.write_bytes(torn.read_bytes()[:-3])
    with pytest.raises(CheckpointError, match=r"C2\.safetensors.*truncated"):
        read_link(torn.parent.parent)
