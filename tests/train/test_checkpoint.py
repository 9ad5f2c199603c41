"""Checkpoints: atomic, verified, code-free; a corrupt one never hides the previous."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from estuary.config import ConfigError
from estuary.config.spec import OutputSpec
from estuary.train.checkpoint import load_checkpoint, save_checkpoint
from estuary.train.checkpoint_chain import (
    CheckpointError,
    CheckpointKind,
    list_checkpoints,
    resolve_checkpoint,
)


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    return model, opt


def tables() -> dict[str, dict[str, np.ndarray]]:
    return {"C1": {"ids": np.array([-5, 2**63 - 1], np.int64), "rows": np.ones((2, 4), np.float32)}}


def test_round_trip_restores_model_optimizer_and_tables(tmp_path: Path) -> None:
    model, opt = make_model()
    path = save_checkpoint(
        tmp_path, step=7, model=model, optimizer=opt, tables=tables(), metadata={"epoch": 1}
    )
    ckpt = load_checkpoint(tmp_path)  # via `latest`
    assert ckpt.path == path
    assert ckpt.manifest["step"] == 7 and ckpt.manifest["metadata"]["epoch"] == 1
    fresh, fresh_opt = make_model()
    fresh.load_state_dict(ckpt.dense)
    assert ckpt.optimizer is not None
    fresh_opt.load_state_dict(ckpt.optimizer)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    np.testing.assert_array_equal(ckpt.tables["C1"]["ids"], tables()["C1"]["ids"])
    # Safe format only: no pickle files anywhere in the checkpoint.
    assert {p.suffix for p in path.rglob("*") if p.is_file()} == {".json", ".safetensors"}


def test_corrupt_newest_checkpoint_is_reported_and_previous_still_loads(tmp_path: Path) -> None:
    model, opt = make_model()
    first = save_checkpoint(tmp_path, step=1, model=model, optimizer=opt, tables=tables())
    second = save_checkpoint(tmp_path, step=2, model=model, optimizer=opt, tables=tables())
    table_file = second / "tables" / "C1.safetensors"
    data = bytearray(table_file.read_bytes())
    data[-1] ^= 0xFF
    table_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"C1.safetensors: checksum mismatch"):
        load_checkpoint(tmp_path)
    assert load_checkpoint(first).manifest["step"] == 1


def test_truncated_and_partial_checkpoints_give_clear_errors(tmp_path: Path) -> None:
    model, opt = make_model()
    path = save_checkpoint(tmp_path, step=3, model=model, optimizer=opt, tables=tables())
    dense = path / "dense.safetensors"
    dense.write_bytes(dense.read_bytes()[:10])
    with pytest.raises(CheckpointError, match=r"dense.safetensors: .* bytes, manifest says"):
        load_checkpoint(path)
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="no checkpoint here"):
        resolve_checkpoint(tmp_path / "nowhere")


def test_interrupted_write_leaves_only_a_temp_folder_that_is_ignored(tmp_path: Path) -> None:
    model, opt = make_model()
    save_checkpoint(tmp_path, step=1, model=model, optimizer=opt, tables=tables())
    # A writer killed mid-way leaves step-N.tmp-PID behind and `latest` untouched.
    (tmp_path / "step-000000002.tmp-999").mkdir()
    (tmp_path / "step-000000002.tmp-999" / "dense.safetensors").write_bytes(b"partial")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000000001"]
    assert load_checkpoint(tmp_path).manifest["step"] == 1
    assert json.loads((tmp_path / "step-000000001" / "manifest.json").read_text())["format"]


def test_version_1_manifests_still_load_as_full_checkpoints(tmp_path: Path) -> None:
    model, opt = make_model()
    path = save_checkpoint(tmp_path, step=1, model=model, optimizer=opt, tables=tables())
    manifest = json.loads((path / "manifest.json").read_text())
    for key in ("kind", "parent", "chain", "table_versions"):  # added by version 2
        del manifest[key]
    manifest["version"] = 1
    (path / "manifest.json").write_text(json.dumps(manifest))
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.kind is CheckpointKind.FULL and ckpt.chain == [path] and not ckpt.deltas
    manifest["version"] = 3
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="format version 3 is not supported"):
        load_checkpoint(tmp_path)


def test_checkpoint_full_every_must_be_positive() -> None:
    with pytest.raises(ConfigError, match=r"output.checkpoint_full_every: must be >= 1"):
        OutputSpec(checkpoint_full_every=0).validate("output")


def test_restoring_into_a_changed_job_names_what_differs(tmp_path: Path) -> None:
    from estuary.config.spec import TableSpec
    from estuary.embedding import EmbeddingTable

    model, opt = make_model()
    table = EmbeddingTable(TableSpec(dim=4), seed=0, name="C1")
    table.lookup(np.array([1, 2, 3], np.int64), train=True)
    save_checkpoint(tmp_path, step=1, model=model, optimizer=opt, tables={"C1": table.state_dict()})
    ckpt = load_checkpoint(tmp_path)
    same, same_opt = make_model()
    ckpt.restore_dense(same, same_opt)  # the same job restores
    wider = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    with pytest.raises(CheckpointError) as info:
        ckpt.restore_dense(wider, None)
    message = str(info.value)
    assert "dense.safetensors: the dense model does not match" in message
    assert "0.weight: shape [4, 3] in the checkpoint, [8, 3] in this model" in message
    extra = torch.nn.Sequential(*wider, torch.nn.Linear(1, 1))
    with pytest.raises(CheckpointError, match=r"3\.weight: missing from the checkpoint"):
        ckpt.restore_dense(extra, None)
    sgd_two_groups = torch.optim.SGD(
        [{"params": list(same.parameters())[:2]}, {"params": list(same.parameters())[2:]}], lr=0.1
    )
    with pytest.raises(CheckpointError, match=r"optimizer\.safetensors: the dense optimizer"):
        ckpt.restore_dense(same, sgd_two_groups)
    with pytest.raises(CheckpointError, match=r"C1\.safetensors.*\(3, 4\) != \(3, 8\)"):
        ckpt.restore_tables({"C1": EmbeddingTable(TableSpec(dim=8), seed=0, name="C1")})
    with pytest.raises(CheckpointError, match=r"no table for \['C2'\]"):
        ckpt.restore_tables({"C2": EmbeddingTable(TableSpec(dim=4), seed=0, name="C2")})


def test_a_second_checkpoint_of_a_step_replaces_the_first_without_a_gap(tmp_path: Path) -> None:
    # (A run resumed after its end saves its step again.) The new folder is written
    # beside the old one, `latest` moves, and only then the old one goes: at no
    # point does `latest` name a missing folder.
    model, opt = make_model()
    first = save_checkpoint(tmp_path, step=5, model=model, optimizer=opt, tables=tables())
    assert first.name == "step-000000005"
    second = save_checkpoint(
        tmp_path, step=5, model=model, optimizer=opt, tables=tables(), metadata={"again": True}
    )
    assert second.name == "step-000000005-2" and not first.exists()
    assert load_checkpoint(tmp_path).manifest["metadata"] == {"again": True}
    assert list_checkpoints(tmp_path) == [second]
    third = save_checkpoint(tmp_path, step=5, model=model, optimizer=opt, tables=tables())
    assert third.name == "step-000000005-3" and not second.exists()
    later = save_checkpoint(tmp_path, step=6, model=model, optimizer=opt, tables=tables())
    assert list_checkpoints(tmp_path) == [third, later]


def test_checkpoint_folders_sort_by_step_then_save() -> None:
    from estuary.train.checkpoint_chain import checkpoint_order

    names = ["step-000000005-10", "step-000000005", "step-000000004", "step-000000005-2"]
    assert sorted(names, key=checkpoint_order) == [
        "step-000000004",
        "step-000000005",
        "step-000000005-2",
        "step-000000005-10",
    ]
    assert checkpoint_order("step-abc") == (-1, 0)


def test_loading_without_tables_reads_the_dense_part_only(tmp_path: Path) -> None:
    model, opt = make_model()
    path = save_checkpoint(tmp_path, step=3, model=model, optimizer=opt, tables=tables())
    table = path / "tables" / "C1.safetensors"
    data = bytearray(table.read_bytes())
    data[-1] ^= 0xFF  # corrupt, same size: only a full load notices
    table.write_bytes(bytes(data))
    ckpt = load_checkpoint(tmp_path, tables=False)
    assert ckpt.base_tables == {} and ckpt.manifest["step"] == 3
    fresh, fresh_opt = make_model()
    ckpt.restore_dense(fresh, fresh_opt)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_checkpoint(tmp_path)
    table.write_bytes(bytes(data[:-1]))  # truncated: both notice
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(tmp_path, tables=False)
