"""Table state files: safetensors written and flushed, with the size and SHA-256
a checkpoint manifest records. Used by the checkpoint writer and by parameter
servers that write their own part of a checkpoint."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

__all__ = ["fsync", "sha256", "write_state"]


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
    save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, str(path))
    fsync(path)
    return {"bytes": path.stat().st_size, "sha256": sha256(path)}
