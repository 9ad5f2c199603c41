"""``estuary export``: a checkpoint as a folder a server loads, with no pickle.

Layout::

    DIR/
        manifest.json       format, version, row encoding, unpooled features (in the
                            program's order), every file's bytes + sha256
        dense.pt2           the dense network as a torch.export program (torch.export.save;
                            a zip of the graph, JSON and raw weights), batch size dynamic:
                            forward(dense (B, Dd), sparse (B, F, D)[, values (B, L, D),
                            mask (B, L) per unpooled feature]) -> logits (B,)
        dense.onnx          (``--onnx``) the same program as ONNX (opset of torch's
                            exporter), for runtimes without torch; the same inputs
        tables/<name>.safetensors   ids (R,), the rows (encoded), unknown rows (S, D)
        pipeline.json       the feature pipeline (``FeaturePipeline.to_json``)
        job.json            the training job (plain data; table specs, model type)

``dense.pt2`` loads with torch alone (``torch.export.load(path).module()``);
it holds raw weight bytes and JSON, no example inputs (torch would pickle them).
The tables are plain safetensors. A server verifies every checksum before it
loads anything (``load_export``).

Rows may be stored smaller for serving (``ROW_ENCODINGS``): ``float16`` and
``bfloat16`` halve the table files; ``int8`` stores each row as int8 times a
per-row float32 scale (max |x| / 127), a quarter plus 4 bytes a row. The server
keeps them so (``FrozenTable``) and decodes only the rows a request looks up, so
serving memory shrinks as the files do. The cost in AUC is measured in
docs/serving.md.

The folder is written as ``DIR.tmp-<pid>`` and renamed into place: a reader sees
a whole export or none.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from estuary.config import job_from_dict, to_dict
from estuary.embedding.delta import IDS, UNKNOWN_PREFIX, WEIGHTS
from estuary.embedding.files import read_state, sha256, write_state
from estuary.serve.checkpoints import job_of, model_from_checkpoint, version_of
from estuary.serve.frozen_table import SCALE as _SCALE
from estuary.serve.frozen_table import FrozenTable
from estuary.serve.model import ExportedDense, FlatSequences, ServingModel
from estuary.serve.pipeline import FeaturePipeline
from estuary.train.build import TableStore
from estuary.train.checkpoint import load_checkpoint
from estuary.train.plan import TrainPlan

__all__ = [
    "EXPORT_FORMAT",
    "ROW_ENCODINGS",
    "ExportError",
    "ExportResult",
    "RowEncoding",
    "export_checkpoint",
    "load_export",
]

EXPORT_FORMAT = "estuary.export/1"
MANIFEST = "manifest.json"
DENSE = "dense.pt2"
DENSE_ONNX = "dense.onnx"
PIPELINE = "pipeline.json"
JOB = "job.json"
_UNKNOWN = UNKNOWN_PREFIX + WEIGHTS

State = dict[str, np.ndarray]


class ExportError(RuntimeError):
    """An export that cannot be written or loaded; the message names the file."""


@dataclass(frozen=True)
class RowEncoding:
    """How a table file stores its rows.

    Args:
        encode: float32 rows (R, D) -> the file's tensors.
        decode: the file's tensors -> float32 rows (R, D).
    """

    encode: Callable[[np.ndarray], State]
    decode: Callable[[State], np.ndarray]


def _bfloat16(rows: np.ndarray) -> State:
    # bf16 = the top 16 bits of float32, rounded to nearest even; numpy has no
    # bf16, so it is stored as its bits (uint16).
    bits = rows.astype(np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return {WEIGHTS: (rounded >> 16).astype(np.uint16)}


def _int8(rows: np.ndarray) -> State:
    scale = np.abs(rows).max(axis=1, initial=0.0) / 127.0  # (R,)
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    quantized = np.clip(np.rint(rows / scale[:, None]), -127, 127).astype(np.int8)
    return {WEIGHTS: quantized, _SCALE: scale}


ROW_ENCODINGS: dict[str, RowEncoding] = {
    "float32": RowEncoding(lambda rows: {WEIGHTS: rows}, lambda s: s[WEIGHTS]),
    "float16": RowEncoding(
        lambda rows: {WEIGHTS: rows.astype(np.float16)}, lambda s: s[WEIGHTS].astype(np.float32)
    ),
    "bfloat16": RowEncoding(
        _bfloat16, lambda s: (s[WEIGHTS].astype(np.uint32) << 16).view(np.float32)
    ),
    "int8": RowEncoding(_int8, lambda s: s[WEIGHTS].astype(np.float32) * s[_SCALE][:, None]),
}
"""``estuary export --rows`` name -> how the table files store rows."""


@dataclass(frozen=True)
class ExportResult:
    """What ``export_checkpoint`` wrote.

    Args:
        path: the export folder.
        version: the model version it serves as.
        rows: table name -> rows exported.
        size_bytes: all files together.
    """

    path: Path
    version: str
    rows: dict[str, int]
    size_bytes: int


def export_checkpoint(
    checkpoint: Path, output: Path, *, rows: str = "float32", onnx: bool = False
) -> ExportResult:
    """Write ``checkpoint`` (a checkpoint, checkpoints root or run folder) to
    ``output`` (see module docstring); ``onnx``: also ``dense.onnx``.

    Raises:
        ExportError: ``output`` exists and is not empty, ``rows`` is unknown, or
            ``onnx`` without the onnx extra (``pip install 'estuary[onnx]'``).
        CheckpointError: the checkpoint does not load (naming the file).
    """
    if rows not in ROW_ENCODINGS:
        raise ExportError(f"--rows: unknown {rows!r} (known: {', '.join(ROW_ENCODINGS)})")
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ExportError(f"{output}: exists and is not empty; choose another --output")
    ckpt = load_checkpoint(checkpoint)
    job = job_of(ckpt)
    model = model_from_checkpoint(ckpt)
    tmp = output.with_name(f"{output.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "tables").mkdir(parents=True)
    try:
        program, sequence_features = _write_dense(model, tmp / DENSE)
        files: dict[str, Any] = {}
        if onnx:
            _write_onnx(program, tmp / DENSE_ONNX)
            files[DENSE_ONNX] = {
                "bytes": (tmp / DENSE_ONNX).stat().st_size,
                "sha256": sha256(tmp / DENSE_ONNX),
            }
        counts: dict[str, int] = {}
        for name, table in model.tables.items():
            state = table.state_dict()
            counts[name] = int(state[IDS].shape[0])
            encoded = {IDS: state[IDS], _UNKNOWN: state[_UNKNOWN]}
            encoded.update(ROW_ENCODINGS[rows].encode(state[WEIGHTS]))
            files[f"tables/{name}.safetensors"] = write_state(
                tmp / "tables" / f"{name}.safetensors", encoded
            )
        for name, data in (
            (PIPELINE, FeaturePipeline.from_job(job).to_json()),
            (JOB, to_dict(job, resolve_paths=True)),
        ):
            (tmp / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        for name in (DENSE, PIPELINE, JOB):
            files[name] = {"bytes": (tmp / name).stat().st_size, "sha256": sha256(tmp / name)}
        manifest = {
            "format": EXPORT_FORMAT,
            "version": version_of(job, ckpt),
            "checkpoint": str(ckpt.path),
            "step": ckpt.manifest.get("step"),
            "rows": rows,
            "tables": sorted(model.tables),
            "sequence_features": sequence_features,
            "files": files,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        if output.exists():
            output.rmdir()  # empty (checked above)
        os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(f.stat().st_size for f in output.rglob("*") if f.is_file())
    return ExportResult(output, version_of(job, ckpt), counts, size)


def _write_dense(model: ServingModel, path: Path) -> tuple[Any, list[str]]:
    """The dense network as a torch.export program; the batch size (and each
    unpooled feature's length) dynamic. Returns the program and the unpooled
    features, in the order the program takes them (see ``ExportedDense``)."""
    names = list(model.engine.embeddings.sequence_features)
    network = FlatSequences(model.dense_model.eval(), names)
    dd, f, d = len(model.pipeline.decoder.dense), len(model.plan.features), network_dim(model)
    batch = torch.export.Dim("batch", min=1, max=1 << 20)
    flat: list[torch.Tensor] = []
    flat_shapes: list[dict[int, Any]] = []
    for i in range(len(names)):  # values (B, L, D) and mask (B, L) share their L
        length = torch.export.Dim(f"length_{i}", min=1, max=1 << 16)
        flat += [torch.zeros(2, 3, d), torch.ones(2, 3, dtype=torch.bool)]
        flat_shapes += [{0: batch, 1: length}, {0: batch, 1: length}]
    example = (torch.zeros(2, dd), torch.zeros(2, f, d), *flat)
    # torch matches the shapes to the arguments given: *flat only when there are some.
    shapes = ({0: batch}, {0: batch}, *((tuple(flat_shapes),) if flat else ()))
    try:
        program = torch.export.export(network, example, dynamic_shapes=shapes)
    except Exception as exc:  # torch raises many kinds for a model it cannot trace
        raise ExportError(f"{path.name}: torch.export failed for model.type: {exc}") from exc
    # The archive's weights are raw bytes and its graph JSON; only the example
    # inputs would be written with torch.save (a pickle), so none are kept.
    program.example_inputs = None
    with _quiet_archive():
        torch.export.save(program, str(path))
    return program, names


def _write_onnx(program: Any, path: Path) -> None:
    """``program`` as ONNX through torch's exporter (it needs onnx and onnxscript)."""
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as exc:
        raise ExportError(
            f"--onnx needs the onnx extra: pip install 'estuary[onnx]' ({exc})"
        ) from exc
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's notes on ops it does not use
        try:
            exported = torch.onnx.export(program, dynamo=True, verbose=False)
        except Exception as exc:  # the exporter raises many kinds for an op it lacks
            raise ExportError(f"{path.name}: ONNX export failed: {exc}") from exc
    assert exported is not None
    exported.save(str(path))


@contextlib.contextmanager
def _quiet_archive() -> Iterator[None]:
    """Hides torch's note, on every .pt2 write, that a weight shares no storage
    with a larger one ("No complete tensor found in the group"): true of every
    plain weight; harmless."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "No complete tensor found", UserWarning)
        yield


def network_dim(model: ServingModel) -> int:
    """D, the pooled embedding width the dense network takes."""
    return int(model.engine.embeddings.dim)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ExportError(f"{path}: unreadable ({exc})") from exc
    if not isinstance(data, dict):
        raise ExportError(f"{path}: expected a JSON object")
    return data


def load_export(folder: Path) -> ServingModel:
    """A ``ServingModel`` of an export folder; every file's size and checksum are
    verified first.

    Raises:
        ExportError: not an export, a file missing or changed (naming it).
    """
    manifest = _read_json(folder / MANIFEST)
    if manifest.get("format") != EXPORT_FORMAT:
        raise ExportError(
            f"{folder / MANIFEST}: format {manifest.get('format')!r}, expected "
            f"{EXPORT_FORMAT!r} (is this an `estuary export` folder?)"
        )
    for name, info in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            raise ExportError(f"{path}: missing (listed in {MANIFEST})")
        if path.stat().st_size != info["bytes"] or sha256(path) != info["sha256"]:
            raise ExportError(f"{path}: size or sha256 differs from {MANIFEST} (changed?)")
    job = job_from_dict(_read_json(folder / JOB))
    pipeline = FeaturePipeline.from_json(_read_json(folder / PIPELINE), str(folder / PIPELINE))
    with _quiet_archive():
        program = torch.export.load(str(folder / DENSE))
    dense = ExportedDense(program, manifest.get("sequence_features", []))
    if str(manifest.get("rows")) not in ROW_ENCODINGS:
        raise ExportError(f"{folder / MANIFEST}: rows: unknown encoding {manifest.get('rows')!r}")
    # The rows stay as stored; lookups decode the rows they read (FrozenTable).
    plan = TrainPlan.from_job(job, pipeline.decoder.features)
    if sorted(manifest["tables"]) != sorted(plan.tables):
        raise ExportError(
            f"{folder / MANIFEST}: tables {sorted(manifest['tables'])}, but {folder / JOB} "
            f"has {sorted(plan.tables)}"
        )
    tables: dict[str, TableStore] = {}
    for name in manifest["tables"]:
        path = folder / "tables" / f"{name}.safetensors"
        try:
            tables[name] = FrozenTable(name, read_state(path), plan.tables[name].shards)
        except (KeyError, ValueError) as exc:
            raise ExportError(f"{path}: not an exported table ({exc})") from exc
    return ServingModel(job, pipeline, str(manifest["version"]), dense, tables)
