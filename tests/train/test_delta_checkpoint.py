"""Delta checkpoints on disk: a chain full -> delta -> delta restores exactly what
a full checkpoint at the same step holds, into any shard count, local or on a
parameter server; a broken link is named and everything before it still loads.

Timeline of the chain tests (T = the source table, 4 shards)::

    T: train | full step-1 | train, evict, remove | delta step-2 | train | delta step-3
    fresh table (S shards): load step-3 = load step-1, apply step-2, apply step-3
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import estuary.train.checkpoint as checkpoint_module
from estuary.config.spec import (
    AdmissionSpec,
    EvictionSpec,
    InitializerSpec,
    SparseOptimizerSpec,
    TableSpec,
)
from estuary.embedding import EmbeddingStore, EmbeddingTable
from estuary.ps import HostedTable, PSClient, RemoteTable, ServerConfig, serving
from estuary.train.checkpoint import load_checkpoint, save_checkpoint
from estuary.train.checkpoint_chain import (
    LATEST,
    CheckpointError,
    CheckpointKind,
    list_checkpoints,
    prune_checkpoints,
    read_link,
)

DIM = 4
State = dict[str, np.ndarray]
SPEC = TableSpec(
    dim=DIM,
    shards=4,
    initializer=InitializerSpec("normal", 0.1),
    optimizer=SparseOptimizerSpec(name="adam", lr=0.01),
    admission=AdmissionSpec(min_count=2),
    eviction=EvictionSpec(capacity_rows=300, policy="lfu"),
    initial_capacity_rows=16,
)


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train(table: EmbeddingStore, steps: int, seed: int, hot: int = 400) -> None:
    """Lookups + gradients on a hot range and a drifting cold one (evictions)."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = np.unique(
            np.concatenate(
                [rng.integers(0, hot, 30), rng.integers(seed * 1000, seed * 1000 + 500, 30)]
            )
        ).astype(np.int64)
        table.lookup(ids, train=True)
        table.apply_gradients(ids, rng.normal(size=(ids.size, DIM)).astype(np.float32))


def by_id(state: State) -> State:
    """Row keys sorted by id, pending keys by pending id, per-shard keys as they are;
    the chain keys (``delta.*``) left out."""
    rows = np.argsort(state["ids"], kind="stable")
    out: State = {}
    for key, value in state.items():
        if key.startswith("delta."):
            continue
        if key.startswith("admission.sketch."):  # per shard, as it is
            out[key] = np.asarray(value)
        elif key.startswith("admission."):  # exact counter: by pending id
            out[key] = np.asarray(value)[np.argsort(state["admission.ids"], kind="stable")]
        elif key.startswith(("unknown.", "meta.")):
            out[key] = np.asarray(value)
        else:
            out[key] = np.asarray(value)[rows]
    return out


def assert_same_tables(got: State, want: State) -> None:
    got, want = by_id(got), by_id(want)
    assert set(got) == set(want)
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)


def write_chain(root: Path, table: EmbeddingTable) -> list[Path]:
    """full step-1, delta step-2, delta step-3 of ``table`` (see the module docstring)."""
    model, opt = make_model()
    train(table, 6, seed=0)
    first = save_checkpoint(
        root, step=1, model=model, optimizer=opt, tables={"t": table.state_dict()}
    )
    train(table, 6, seed=1)
    table.remove(np.arange(0, 20, dtype=np.int64))
    second = save_checkpoint(
        root,
        step=2,
        model=model,
        optimizer=opt,
        tables={"t": table.delta_state_dict()},
        parent=read_link(first),
    )
    train(table, 3, seed=2)
    third = save_checkpoint(
        root,
        step=3,
        model=model,
        optimizer=opt,
        tables={"t": table.delta_state_dict()},
        parent=read_link(second),
    )
    return [first, second, third]


@pytest.mark.parametrize("load_shards", [4, 1, 3])
def test_delta_chain_loads_the_state_of_a_full_checkpoint_at_the_same_step(
    tmp_path: Path, load_shards: int
) -> None:
    source = EmbeddingTable(SPEC, seed=7, name="t")
    first, second, third = write_chain(tmp_path / "chain", source)
    ckpt = load_checkpoint(tmp_path / "chain")  # via `latest`: step-3
    assert ckpt.kind is CheckpointKind.DELTA and ckpt.chain == [first, second, third]
    assert ckpt.manifest["parent"] == second.name
    assert ckpt.manifest["chain"] == [first.name, second.name, third.name]

    model, opt = make_model()
    full = save_checkpoint(
        tmp_path / "full", step=3, model=model, optimizer=opt, tables={"t": source.state_dict()}
    )
    assert load_checkpoint(full).kind is CheckpointKind.FULL
    from_chain = EmbeddingTable(replace(SPEC, shards=load_shards), seed=7, name="t")
    ckpt.restore_tables({"t": from_chain})
    from_full = EmbeddingTable(replace(SPEC, shards=load_shards), seed=7, name="t")
    load_checkpoint(full).restore_tables({"t": from_full})
    got = from_chain.state_dict(mark_clean=False)
    assert_same_tables(got, from_full.state_dict())
    if load_shards == SPEC.shards:  # same shards: the very state the source held
        assert_same_tables(got, source.state_dict())
    # The restored table continues the chain: its next delta applies on step-3.
    assert read_link(third).accepts({"t": from_chain.delta_state_dict()})


def test_delta_files_are_much_smaller_when_few_rows_change(tmp_path: Path) -> None:
    spec = replace(SPEC, dim=16, admission=AdmissionSpec(), eviction=EvictionSpec())
    table = EmbeddingTable(spec, seed=1, name="t")
    ids = np.arange(20_000, dtype=np.int64)
    table.lookup(ids, train=True)
    table.apply_gradients(ids, np.ones((ids.size, 16), np.float32))
    model, opt = make_model()
    full = save_checkpoint(
        tmp_path, step=1, model=model, optimizer=opt, tables={"t": table.state_dict()}
    )
    few = ids[::200]  # 100 of 20,000 rows change
    table.lookup(few, train=True)
    table.apply_gradients(few, np.ones((few.size, 16), np.float32))
    delta = save_checkpoint(
        tmp_path,
        step=2,
        model=model,
        optimizer=opt,
        tables={"t": table.delta_state_dict()},
        parent=read_link(full),
    )
    full_bytes = (full / "tables" / "t.safetensors").stat().st_size
    delta_bytes = (delta / "tables" / "t.safetensors").stat().st_size
    assert full_bytes > 3_000_000
    assert delta_bytes < full_bytes / 50, (full_bytes, delta_bytes)
    assert load_checkpoint(delta).deltas[0]["t"]["ids"].size == few.size


def test_corrupt_or_missing_link_is_named_and_earlier_checkpoints_load(tmp_path: Path) -> None:
    first, second, third = write_chain(tmp_path, EmbeddingTable(SPEC, seed=7, name="t"))
    table_file = second / "tables" / "t.safetensors"
    data = bytearray(table_file.read_bytes())
    data[-1] ^= 0xFF
    table_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"step-000000002/tables/t.safetensors: checksum"):
        load_checkpoint(third)  # the newest is fine; its parent is not
    assert load_checkpoint(first).manifest["step"] == 1

    (second / "manifest.json").unlink()  # a link gone (deleted, or never finished)
    with pytest.raises(CheckpointError, match=r"step-000000002/manifest.json: missing, but"):
        load_checkpoint(tmp_path)
    (third / "tables" / "t.safetensors").write_bytes(b"trunc")
    with pytest.raises(CheckpointError, match=r"t.safetensors: 5 bytes, manifest says"):
        load_checkpoint(third)
    assert load_checkpoint(first).kind is CheckpointKind.FULL


def test_a_rewritten_parent_is_detected_before_anything_loads(tmp_path: Path) -> None:
    table = EmbeddingTable(SPEC, seed=7, name="t")
    _, second, third = write_chain(tmp_path, table)
    model, opt = make_model()
    # step-2 saved again in full (another version of the table): the new one goes
    # beside it, and the old one stays, since step-3 is built on it.
    second_full = save_checkpoint(
        tmp_path, step=2, model=model, optimizer=opt, tables={"t": table.state_dict()}
    )
    assert second_full.name == "step-000000002-2" and second.is_dir()
    load_checkpoint(third)
    # A parent rewritten in place (copied over by hand): step-3 no longer applies.
    shutil.rmtree(second)
    shutil.copytree(second_full, second)
    with pytest.raises(CheckpointError, match=r"is not the start of step-000000003"):
        load_checkpoint(third)


def test_retention_keeps_the_checkpoints_a_kept_delta_is_built_on(tmp_path: Path) -> None:
    table = EmbeddingTable(SPEC, seed=7, name="t")
    model, opt = make_model()
    link = None
    written = []
    for step in range(1, 7):  # full every 3: F1 d2 d3 F4 d5 d6
        train(table, 1, seed=step)
        parent = link if step % 3 != 1 else None
        state = table.delta_state_dict() if parent is not None else table.state_dict()
        path = save_checkpoint(
            tmp_path, step=step, model=model, optimizer=opt, tables={"t": state}, parent=parent
        )
        link = read_link(path)
        written.append(path)
        prune_checkpoints(tmp_path, keep=2, newest=path)
        kept = [p.name for p in list_checkpoints(tmp_path)]
        if step == 3:  # d2, d3 kept, and F1 they are built on
            assert kept == [p.name for p in written[:3]]
        if step == 4:  # d3 (needs F1, d2) and F4
            assert kept == [p.name for p in written[:4]]
        if step == 5:  # F4, d5: the old chain is gone
            assert kept == [p.name for p in written[3:5]]
        assert load_checkpoint(tmp_path).manifest["step"] == step
        for folder in list_checkpoints(tmp_path):
            load_checkpoint(folder)  # every kept checkpoint still loads
    # A kept checkpoint with an unreadable manifest may need anything: nothing goes.
    (written[-1] / "manifest.json").write_text("{")
    assert prune_checkpoints(tmp_path, keep=1) == []


class Killed(Exception):
    """Stands in for SIGKILL at a chosen point of a checkpoint write."""


def test_kill_mid_delta_write_leaves_the_previous_chain_loadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = EmbeddingTable(SPEC, seed=7, name="t")
    write_chain(tmp_path, table)
    # A fourth checkpoint dies after its files are written, before the rename.
    fsync_dir = checkpoint_module._fsync_dir

    def die_at_tables(path: Path) -> None:
        if path.name == "tables":
            raise Killed
        fsync_dir(path)

    monkeypatch.setattr(checkpoint_module, "_fsync_dir", die_at_tables)
    model, opt = make_model()
    train(table, 2, seed=3)
    link = read_link(tmp_path / "step-000000003")
    with pytest.raises(Killed):
        save_checkpoint(
            tmp_path,
            step=4,
            model=model,
            optimizer=opt,
            tables={"t": table.delta_state_dict()},
            parent=link,
        )
    monkeypatch.setattr(checkpoint_module, "_fsync_dir", fsync_dir)
    assert (tmp_path / LATEST).read_text().strip() == "step-000000003"
    assert any(".tmp-" in p.name for p in tmp_path.iterdir())
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.manifest["step"] == 3 and len(ckpt.deltas) == 2
    # The lost delta marked the table: the next delta would miss its rows, so it is refused.
    assert not link.accepts({"t": table.delta_state_dict()})
    prune_checkpoints(tmp_path, keep=2)
    assert not any(".tmp-" in p.name for p in tmp_path.iterdir())


@pytest.fixture
def remote_tables() -> Iterator[dict[int, RemoteTable]]:
    """Parameter servers hosting table ``t`` with 2 and with 1 shard."""
    with contextlib.ExitStack() as stack:
        tables = {}
        for shards in (2, 1):
            hosted = HostedTable(replace(SPEC, shards=shards), seed=7)
            config = ServerConfig({"t": hosted}, world_size=1, staleness=None)
            server = stack.enter_context(serving(config))
            client = PSClient(server.address, server.authkey, timeout_s=30)
            stack.callback(client.close)
            tables[shards] = client.table("t")
        yield tables


def test_delta_chain_of_remote_tables_loads_local_and_remote(
    tmp_path: Path, remote_tables: dict[int, RemoteTable]
) -> None:
    remote = remote_tables[2]  # written from a 2-shard server table
    model, opt = make_model()
    train(remote, 4, seed=0)
    tables = {"t": remote.state_dict()}
    first = save_checkpoint(tmp_path, step=1, model=model, optimizer=opt, tables=tables)
    train(remote, 3, seed=1)
    remote.remove(np.arange(0, 10, dtype=np.int64))
    tables = {"t": remote.delta_state_dict()}  # over the wire
    assert tables["t"]["evicted_ids"].size > 0
    second = save_checkpoint(
        tmp_path, step=2, model=model, optimizer=opt, tables=tables, parent=read_link(first)
    )
    ckpt = load_checkpoint(second)
    assert ckpt.kind is CheckpointKind.DELTA
    local = EmbeddingTable(replace(SPEC, shards=3), seed=7, name="t")
    ckpt.restore_tables({"t": local})
    want = EmbeddingTable(replace(SPEC, shards=3), seed=7, name="t")
    want.load_state_dict(remote.state_dict())
    assert_same_tables(local.state_dict(), want.state_dict())
    # Onto a 1-shard server table: the same state as a local 1-shard table.
    onto_server, local_one = (
        remote_tables[1],
        EmbeddingTable(replace(SPEC, shards=1), seed=7, name="t"),
    )
    ckpt.restore_tables({"t": onto_server})
    ckpt.restore_tables({"t": local_one})
    assert_same_tables(onto_server.state_dict(), local_one.state_dict())
