"""Asynchronous checkpoints (``output.checkpoint_async``): the files a background
writer (and, for tables on parameter servers, each server) commits are the ones
a blocking checkpoint of the same step writes; a run checkpointing
asynchronously ends exactly as one checkpointing blocking; its checkpoints
resume; a delta whose parts disagree on being full is made full everywhere."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from estuary.cli import main
from estuary.config.spec import EvictionSpec
from estuary.embedding import EmbeddingTable
from estuary.embedding.delta import is_full, merge_server_parts
from estuary.embedding.hashing import SERVER_SALT, shard_of
from estuary.ps import HostedTable, PSClient, ServerConfig, ShardedPSClient, server_share, serving
from estuary.ps.snapshots import ServerSnapshot
from estuary.train import load_checkpoint
from estuary.train.checkpoint import stage_checkpoint, table_versions
from estuary.train.checkpoint_chain import list_checkpoints, read_manifest

from .conftest import DIM, SPEC, write_job

pytestmark = pytest.mark.distributed


def by_id(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    order = np.argsort(state["ids"])
    return {k: np.asarray(state[k])[order] for k in ("ids", "weights", "opt.accum")}


def same_tables(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert set(a) == set(b)
    for name in a:
        x, y = by_id(a[name]), by_id(b[name])
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=f"{name}.{key}")


def job_file(folder: Path, *, checkpoint_async: bool, **runtime: Any) -> Path:
    folder.mkdir()
    path = write_job(folder)  # sync mode: deterministic
    raw = yaml.safe_load(path.read_text())
    raw["output"].update(
        checkpoint_every_steps=3, checkpoint_full_every=3, checkpoint_async=checkpoint_async
    )
    raw["runtime"] = runtime
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize(
    "runtime",
    [{}, {"trainers": 2, "ps_shards": 2}],
    ids=["in-process-tables", "2-trainers-2-servers"],
)
def test_asynchronous_checkpoints_hold_what_blocking_ones_hold(
    tmp_path: Path, runtime: dict[str, Any]
) -> None:
    runs = {}
    for mode in ("blocking", "async"):
        path = job_file(tmp_path / mode, checkpoint_async=mode == "async", **runtime)
        assert main(["train", str(path), "--no-progress"]) == 0
        runs[mode] = path.parent / "out"
    summaries = {m: json.loads((p / "summary.json").read_text()) for m, p in runs.items()}
    assert summaries["async"]["auc"] == summaries["blocking"]["auc"]
    assert summaries["async"]["checkpoints"] == summaries["blocking"]["checkpoints"] > 0
    kept = {m: [f.name for f in list_checkpoints(p / "checkpoints")] for m, p in runs.items()}
    assert kept["async"] == kept["blocking"]  # the same steps kept, deltas and all
    for name in kept["async"]:
        got = load_checkpoint(runs["async"] / "checkpoints" / name)
        want = load_checkpoint(runs["blocking"] / "checkpoints" / name)
        assert got.kind == want.kind and got.manifest["chain"] == want.manifest["chain"]
        same_tables(got.tables, want.tables)
        for key, value in want.dense.items():
            assert got.dense[key].equal(value), key
        meta = ("epoch", "epoch_step")
        assert [got.manifest["metadata"][k] for k in meta] == [
            want.manifest["metadata"][k] for k in meta
        ]
    if runtime:  # every server wrote its own part of each mid-run checkpoint
        mid = [n for n in kept["async"] if n != f"step-{summaries['async']['steps']:09d}"]
        manifest = read_manifest(runs["async"] / "checkpoints" / mid[-1])
        assert set(manifest["table_parts"].values()) == {2}
        assert any(".part-1.safetensors" in f for f in manifest["files"])


def test_an_asynchronous_checkpoint_resumes_to_the_uninterrupted_result(tmp_path: Path) -> None:
    whole = job_file(tmp_path / "whole", checkpoint_async=True, trainers=2, ps_shards=2)
    assert main(["train", str(whole), "--no-progress"]) == 0
    cut = job_file(tmp_path / "cut", checkpoint_async=True, trainers=2, ps_shards=2)
    # Stop after the first epoch's checkpoints (7 steps per epoch), then resume.
    assert main(["train", str(cut), "--no-progress", "--set", "train.epochs=1"]) == 0
    assert main(["train", str(cut), "--no-progress", "--resume"]) == 0
    a = load_checkpoint(whole.parent / "out")
    b = load_checkpoint(cut.parent / "out")
    assert a.manifest["step"] == b.manifest["step"] == 14
    same_tables(a.tables, b.tables)


def test_a_delta_some_servers_must_send_full_is_full_on_every_server(tmp_path: Path) -> None:
    """Server 0 evicts more ids since the last mark than its log holds (its delta
    must be full), server 1 hardly any: the snapshot makes both parts full, and
    base + that delta loads to the servers' state."""
    spec = replace(SPEC, eviction=EvictionSpec(capacity_rows=40))
    hosted = server_share(HostedTable(spec, seed=3), 2)
    config = ServerConfig({"t": hosted}, world_size=1, staleness=None)
    ids = np.arange(20_000, dtype=np.int64)
    owner = shard_of(ids, 2, salt=SERVER_SALT)
    to_0, to_1 = ids[owner == 0], ids[owner == 1]
    with serving(config) as s0, serving(config) as s1:
        client = ShardedPSClient([PSClient(s.address, s.authkey, timeout_s=30) for s in (s0, s1)])
        table = client.tables()["t"]
        grads = np.ones((64, DIM), np.float32)
        for batch in (to_0[:64], to_1[:64]):
            table.lookup(batch, train=True)
            table.apply_gradients(batch, grads)
        base = table.state_dict()
        for start in range(64, 6400, 64):  # 20 new rows a batch through server 0's 20
            batch = to_0[start : start + 64]
            table.lookup(batch, train=True)
            table.apply_gradients(batch, grads[: batch.size])
        table.lookup(to_1[64:70], train=True)  # server 1: a few rows change
        table.apply_gradients(to_1[64:70], grads[:6])
        overflowed = [s.tables["t"].shards[0].log_overflowed() for s in (s0, s1)]
        assert overflowed == [True, False]  # the parts would disagree
        snap = ServerSnapshot({"t": table}, delta=True)
        assert is_full(snap.chains["t"])
        staged = stage_checkpoint(tmp_path, step=1, parent=None)
        snap.write(staged.part_paths)
        files = snap.wait()["t"]
        assert len(files) == 2
        staged.add_files("t", 2, files)
        path = staged.commit(versions=table_versions(snap.chains))
        want = table.state_dict()
        client.close()
    parts = [load_file(str(path / "tables" / f"t.part-{p}.safetensors")) for p in range(2)]
    assert all(is_full(part) for part in parts)
    local = EmbeddingTable(spec, seed=3, name="t")
    local.load_state_dict(base)
    local.apply_delta(merge_server_parts(parts, "t"))
    got = local.state_dict()
    assert sorted(got["ids"].tolist()) == sorted(want["ids"].tolist())
    np.testing.assert_array_equal(by_id(got)["weights"], by_id(want)["weights"])
