"""Table state files: safetensors written and flushed, with the size and SHA-256
a checkpoint manifest records. Used by the checkpoint writer and by parameter
servers that write their own part of a checkpoint.

Tables store what they hold: bf16 weights (``uint16`` bit patterns in a state,
``estuary.embedding.precision``) are written as safetensors ``BF16`` and read
back as the same bits; fp16 weights as ``F16``. numpy cannot name bfloat16, so
files holding it go through torch's safetensors reader and writer (imported
only for them)."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

__all__ = ["fsync", "read_state", "sha256", "write_state"]

_BF16 = "BF16"


def sha256(path: Path) -> str:
    """The file's SHA-256, hex (read in 1 MiB blocks)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync(path: Path) -> None:
    """Flush a written file, or a folder's entries (a rename or a new file in it),
    to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_state(path: Path, state: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """Write ``state`` (name -> array) to ``path`` as safetensors, flushed to disk;
    returns the manifest entry ``{"bytes": ..., "sha256": ...}``."""
    arrays = {k: np.ascontiguousarray(v) for k, v in state.items()}
    if any(a.dtype == np.uint16 for a in arrays.values()):
        _save_bf16(arrays, path)
    else:
        save_file(arrays, str(path))
    fsync(path)
    return {"bytes": path.stat().st_size, "sha256": sha256(path)}


def read_state(path: Path) -> dict[str, np.ndarray]:
    """The arrays of a state file written by ``write_state`` (``BF16`` tensors as
    uint16 bits).

    Raises:
        OSError, ValueError, RuntimeError: unreadable file or header.
    """
    if not _has_bf16(path):
        return load_file(str(path))
    import torch
    from safetensors.torch import load_file as load_torch

    return {
        k: t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()
        for k, t in load_torch(str(path)).items()
    }


def _has_bf16(path: Path) -> bool:
    # The safetensors header: an 8-byte little-endian length, then JSON.
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file (no header)")
        (size,) = struct.unpack("<Q", head)
        header = json.loads(f.read(size))
    return any(isinstance(v, dict) and v.get("dtype") == _BF16 for v in header.values())


def _save_bf16(arrays: dict[str, np.ndarray], path: Path) -> None:
    import torch
    from safetensors.torch import save_file as save_torch

    tensors = {}
    for k, a in arrays.items():
        t = torch.from_numpy(a if a.flags.writeable else a.copy())  # zero-copy views
        tensors[k] = t.view(torch.bfloat16) if a.dtype == np.uint16 else t
    save_torch(tensors, str(path))
