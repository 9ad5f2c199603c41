"""Atomic, code-free checkpoints: safetensors files + a JSON manifest.

Layout of one checkpoint (a folder)::

    step-000123/
        manifest.json          format, step, job spec, every file's size + sha256
        dense.safetensors      model.state_dict()
        optimizer.safetensors  dense optimizer tensors (its scalars are in the manifest)
        tables/<name>.safetensors   one per embedding table (ids, rows, optimizer state)

It is written as ``step-000123.tmp-<pid>``, every file fsynced, then renamed into
place; ``latest`` (a one-line text file, itself replaced atomically) names the
newest complete checkpoint. Loading verifies sizes and checksums and never runs
code (no pickle): a corrupt or partial folder raises ``CheckpointError`` and the
previous checkpoint still loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import load_file as load_numpy
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import load_file as load_torch
from safetensors.torch import save_file as save_torch

FORMAT = "estuary-checkpoint"
FORMAT_VERSION = 1
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial or corrupt; the message names the file."""


@dataclass
class Checkpoint:
    """A loaded checkpoint.

    Args:
        path: the checkpoint folder.
        manifest: the parsed manifest (step, job spec, metadata).
        dense: model state dict.
        optimizer: dense optimizer state dict (for ``optimizer.load_state_dict``).
        tables: table name -> flat numpy state for ``load_state_dict``.
    """

    path: Path
    manifest: dict[str, Any]
    dense: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    tables: dict[str, dict[str, np.ndarray]]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _optimizer_to_flat(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split a torch optimizer state dict into tensors and JSON-able scalars."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for param_id, param_state in state["state"].items():
        for key, value in param_state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{param_id}.{key}"] = value.detach().contiguous().cpu()
            else:
                scalars.setdefault(str(param_id), {})[key] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _optimizer_from_flat(
    tensors: Mapping[str, torch.Tensor], meta: dict[str, Any]
) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for name, tensor in tensors.items():
        param_id, key = name.split(".", 1)
        state.setdefault(int(param_id), {})[key] = tensor
    for param_id, values in meta.get("scalars", {}).items():
        state.setdefault(int(param_id), {}).update(values)
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(
    root: Path,
    *,
    step: int,
    model: torch.nn.Module,
    tables: Mapping[str, Mapping[str, np.ndarray]],
    optimizer: torch.optim.Optimizer | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write a checkpoint under ``root`` atomically; returns its folder.

    ``tables`` maps table name -> the table's ``state_dict()``; ``metadata`` (job
    spec, data progress, metrics) goes into the manifest and must be JSON-able.
    """
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:09d}"
    final = root / name
    tmp = root / f"{name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / "tables").mkdir(parents=True)
    files: list[Path] = []

    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_torch(state, str(tmp / "dense.safetensors"))
    files.append(tmp / "dense.safetensors")

    optimizer_meta: dict[str, Any] | None = None
    if optimizer is not None:
        opt_tensors, optimizer_meta = _optimizer_to_flat(optimizer.state_dict())
        save_torch(opt_tensors, str(tmp / "optimizer.safetensors"))
        files.append(tmp / "optimizer.safetensors")

    for table_name, table_state in tables.items():
        path = tmp / "tables" / f"{table_name}.safetensors"
        save_numpy({k: np.ascontiguousarray(v) for k, v in table_state.items()}, str(path))
        files.append(path)

    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": step,
        "tables": sorted(tables),
        "optimizer": optimizer_meta,
        "metadata": dict(metadata or {}),
        "files": {
            str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
            for p in files
        },
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    for p in [*files, tmp / "manifest.json"]:
        _fsync_file(p)
    _fsync_dir(tmp / "tables")
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    latest_tmp = root / f"{LATEST}.tmp-{os.getpid()}"
    latest_tmp.write_text(name + "\n")
    _fsync_file(latest_tmp)
    os.replace(latest_tmp, root / LATEST)
    _fsync_dir(root)
    return final


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint folder from ``path``: the folder itself, or the ``latest``
    one under a checkpoints root or a run's output folder."""
    path = Path(path)
    for candidate in (path, path / "checkpoints"):
        if (candidate / "manifest.json").is_file():
            return candidate
        latest = candidate / LATEST
        if latest.is_file():
            return candidate / latest.read_text().strip()
    raise CheckpointError(f"{path}: no checkpoint here (no manifest.json and no '{LATEST}' file)")


def list_checkpoints(root: Path) -> list[Path]:
    """Complete-looking checkpoint folders under ``root``, oldest first."""
    if not root.is_dir():
        return []
    return sorted(
        p
        for p in root.iterdir()
        if p.is_dir() and ".tmp-" not in p.name and p.name.startswith("step-")
    )


def load_checkpoint(path: Path) -> Checkpoint:
    """Load and verify a checkpoint (see ``resolve_checkpoint`` for ``path``)."""
    folder = resolve_checkpoint(path)
    manifest_path = folder / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{manifest_path}: missing (partial checkpoint?)") from exc
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{manifest_path}: not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path}: not an {FORMAT} manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{manifest_path}: format version {manifest.get('version')} is not supported "
            f"(this Estuary reads {FORMAT_VERSION})"
        )
    for rel, info in manifest["files"].items():
        file = folder / rel
        if not file.is_file():
            raise CheckpointError(f"{file}: listed in the manifest but missing")
        if file.stat().st_size != info["bytes"]:
            raise CheckpointError(
                f"{file}: {file.stat().st_size} bytes, manifest says {info['bytes']} (truncated?)"
            )
        if _sha256(file) != info["sha256"]:
            raise CheckpointError(f"{file}: checksum mismatch (corrupt)")
    try:
        dense = load_torch(str(folder / "dense.safetensors"))
        optimizer = None
        if manifest.get("optimizer") is not None:
            optimizer = _optimizer_from_flat(
                load_torch(str(folder / "optimizer.safetensors")), manifest["optimizer"]
            )
        tables = {
            name: load_numpy(str(folder / "tables" / f"{name}.safetensors"))
            for name in manifest["tables"]
        }
    except (OSError, ValueError, RuntimeError) as exc:  # safetensors header errors
        raise CheckpointError(f"{folder}: unreadable tensor file ({exc})") from exc
    return Checkpoint(folder, manifest, dense, optimizer, tables)
