"""``estuary export``: a folder that loads without pickle, verified by checksums."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from estuary.cli import main
from estuary.serve.checkpoints import model_from_checkpoint
from estuary.serve.export import ROW_ENCODINGS, ExportError, export_checkpoint, load_export
from estuary.train.checkpoint import load_checkpoint

from .conftest import TinyRun, instances


def test_the_dense_program_loads_with_torch_alone_and_holds_no_pickle(tiny_run: TinyRun) -> None:
    path = tiny_run.export_dir / "dense.pt2"
    with zipfile.ZipFile(path) as archive:
        for name in archive.namelist():
            data = archive.read(name)
            assert not name.endswith((".pkl", ".pt")) or data == b"", name
            assert not data.startswith((b"\x80", b"PK")), f"{name} looks pickled"
    program = torch.export.load(str(path)).module()
    logits = program(torch.zeros(3, 2), torch.zeros(3, 2, 4))  # (B, Dd), (B, F, D)
    assert logits.shape == (3,)


def test_the_onnx_program_computes_what_the_torch_program_does(
    tiny_run: TinyRun, tmp_path: Path
) -> None:
    """``--onnx``: dense.onnx, listed with its checksum, runs in onnxruntime
    (no torch) with a dynamic batch and gives the torch program's logits."""
    ort = pytest.importorskip("onnxruntime", reason="the onnx extra is not installed")
    out = tmp_path / "export"
    assert main(["export", str(tiny_run.run_dir), "--output", str(out), "--onnx"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert "dense.onnx" in manifest["files"]
    program = torch.export.load(str(out / "dense.pt2")).module()
    session = ort.InferenceSession(str(out / "dense.onnx"))
    names = [i.name for i in session.get_inputs()]
    rng = np.random.default_rng(0)
    for batch in (1, 5, 300):
        dense = rng.normal(size=(batch, 2)).astype(np.float32)  # (B, Dd)
        sparse = rng.normal(size=(batch, 2, 4)).astype(np.float32)  # (B, F, D)
        (got,) = session.run(None, dict(zip(names, (dense, sparse), strict=True)))
        want = program(torch.from_numpy(dense), torch.from_numpy(sparse)).detach().numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    load_export(out)  # the checksums (dense.onnx's too) hold


def test_the_manifest_lists_every_file_with_its_checksum(tiny_run: TinyRun) -> None:
    manifest = json.loads((tiny_run.export_dir / "manifest.json").read_text())
    assert manifest["version"] == "tiny@step-000000100-2"
    files = {p.relative_to(tiny_run.export_dir).as_posix() for p in tiny_run.export_dir.rglob("*")}
    listed = set(manifest["files"])
    assert listed == {f for f in files if "." in f and f != "manifest.json"}
    pipeline = json.loads((tiny_run.export_dir / "pipeline.json").read_text())
    assert pipeline["fields"] == ["I1", "I2", "C1", "C2"]


def test_a_changed_file_is_refused_naming_it(tiny_run: TinyRun, tmp_path: Path) -> None:
    copy = tmp_path / "export"
    export_checkpoint(tiny_run.run_dir, copy)
    table = copy / "tables" / "C1.safetensors"
    data = bytearray(table.read_bytes())
    data[-1] ^= 0xFF
    table.write_bytes(bytes(data))
    with pytest.raises(ExportError, match=r"C1\.safetensors"):
        load_export(copy)


def test_export_refuses_a_folder_that_is_not_empty(tiny_run: TinyRun, tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="not empty"):
        export_checkpoint(tiny_run.run_dir, tmp_path)
    assert (tmp_path / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize(("rows", "atol"), [("float16", 1e-3), ("bfloat16", 1e-2), ("int8", 2e-2)])
def test_smaller_rows_predict_close_to_float32(
    tiny_run: TinyRun, tmp_path: Path, rows: str, atol: float
) -> None:
    argv = ["export", str(tiny_run.run_dir), "--output", str(tmp_path / rows), "--rows", rows]
    assert main(argv) == 0
    full, small = load_export(tiny_run.export_dir), load_export(tmp_path / rows)
    batch = full.pipeline.parse(instances(tiny_run.eval_rows))
    exact, approx = full.predict(batch).probabilities, small.predict(batch).probabilities
    np.testing.assert_allclose(approx, exact, atol=atol)
    assert not np.array_equal(approx, exact)  # the rows really were stored smaller
    smaller = (tmp_path / rows / "tables" / "C1.safetensors").stat().st_size
    assert smaller < (tiny_run.export_dir / "tables" / "C1.safetensors").stat().st_size


def test_row_encodings_round_trip_within_their_precision() -> None:
    rows = np.random.default_rng(0).normal(size=(100, 8)).astype(np.float32)
    rows[3] = 0.0  # an all-zero row (int8 scale of 0)
    for name, bound in [("float32", 0.0), ("float16", 1e-3), ("bfloat16", 8e-3), ("int8", 8e-3)]:
        encoding = ROW_ENCODINGS[name]
        back = encoding.decode(encoding.encode(rows))
        relative = np.abs(back - rows).max(axis=1) / np.maximum(np.abs(rows).max(axis=1), 1e-9)
        assert relative.max() <= bound, name


def test_a_model_with_an_unpooled_history_exports_and_serves_as_trained(tmp_path: Path) -> None:
    # DLRM + attention pooling over "hist" (pooling: none): the program takes the
    # padded history and its mask; its length differs from batch to batch.
    rng = np.random.default_rng(0)
    lines = ["label,price,item,hist"]
    for _ in range(400):
        hist = "|".join(f"i{v}" for v in rng.integers(0, 20, size=int(rng.integers(0, 6))))
        lines.append(f"{int(rng.random() < 0.3)},{rng.random():.2f},i{rng.integers(0, 20)},{hist}")
    (tmp_path / "clicks.csv").write_text("\n".join(lines) + "\n")
    job = {
        "name": "history",
        "data": {
            "sources": [{"path": "clicks.csv", "format": "csv"}],
            "schema": {
                "dense": ["price"],
                "sparse": ["item"],
                "features": [{"name": "hist", "kind": "sequence", "columns": ["hist"]}],
            },
        },
        "model": {
            "type": "dlrm",
            "params": {"bottom_mlp": [4], "top_mlp": [8]},
            "embedding": {"default": {"dim": 4}, "tables": {"hist": {"pooling": "none"}}},
        },
        "train": {"batch_size": 64, "epochs": 1, "threads": 1},
        "output": {"dir": "out", "progress": False},
    }
    (tmp_path / "job.yaml").write_text(json.dumps(job))
    assert main(["train", str(tmp_path / "job.yaml"), "-q"]) == 0
    exported = load_export(export_checkpoint(tmp_path / "out", tmp_path / "export").path)
    assert json.loads((tmp_path / "export" / "manifest.json").read_text())["sequence_features"] == [
        "hist"
    ]
    eager = model_from_checkpoint(load_checkpoint(tmp_path / "out"))
    short = [{"price": 0.5, "item": "i3", "hist": "i1|i3"}, {"price": None, "item": "i4"}]
    for rows in (short, [{"price": 1.0, "item": "i9", "hist": "i2|i2|i7|i8|i9|i1|i4"}]):
        rows = [{"hist": None, **row} for row in rows]
        batch = exported.pipeline.parse(rows)
        np.testing.assert_allclose(
            exported.predict(batch).probabilities, eager.predict(batch).probabilities, atol=1e-6
        )
