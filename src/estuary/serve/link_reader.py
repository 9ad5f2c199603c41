"""``read_link``: one checkpoint folder as a server following a run reads it, with
little time holding the GIL.

``estuary.train.checkpoint.load_link`` reads every file twice (once for its
SHA-256, once through safetensors' reader) and safetensors' reader holds the GIL
while it copies a file's tensors. On a server that is time the event loop and
the prediction thread wait: profiled with ``py-spy record --gil`` on the bench
model (26 tables, deltas of ~18k rows), safetensors' ``load_file`` was the
largest holder of the follower thread's GIL time (~5 ms per delta, of ~22 ms).

Here each file is read once, into one buffer (``readinto``: the GIL is released
during the read), hashed from that buffer (``hashlib`` releases the GIL for
buffers over 2 KiB), and its tensors are numpy views into it (the safetensors
layout: an 8-byte little-endian header length, a JSON header of dtype, shape
and byte offsets per tensor, then the raw bytes; no copy). The checks are those
of ``load_link``: every file the manifest lists is present with its size and
checksum, else ``CheckpointError`` naming it.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from estuary.embedding.delta import merge_server_parts
from estuary.train.checkpoint import Link, table_part_file
from estuary.train.checkpoint_chain import CheckpointError, read_manifest, table_file

__all__ = ["parse_safetensors", "read_header", "read_link", "read_verified", "tensor_view"]

State = dict[str, np.ndarray]

# safetensors dtype names -> numpy; BF16 as its bits (uint16), as
# ``estuary.embedding.files.read_state`` returns it.
_DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(t)
    for name, t in {
        "F64": np.float64,
        "F32": np.float32,
        "F16": np.float16,
        "BF16": np.uint16,
        "I64": np.int64,
        "I32": np.int32,
        "I16": np.int16,
        "I8": np.int8,
        "U64": np.uint64,
        "U32": np.uint32,
        "U16": np.uint16,
        "U8": np.uint8,
        "BOOL": np.bool_,
    }.items()
}


def read_verified(path: Path, info: Mapping[str, Any]) -> bytearray:
    """The bytes of ``path``, checked against the manifest's ``info``
    (``bytes``, ``sha256``).

    Raises:
        CheckpointError: missing, another size, or another checksum.
    """
    size = int(info["bytes"])
    buf = bytearray(size)
    try:
        with path.open("rb", buffering=0) as f:
            view, got = memoryview(buf), 0
            while got < size:  # readinto releases the GIL; a read may come short
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
            longer = bool(f.read(1))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: listed in the manifest but missing") from None
    if got != size or longer:
        raise CheckpointError(
            f"{path}: {path.stat().st_size} bytes, manifest says {size} (truncated?)"
        )
    if hashlib.sha256(buf).hexdigest() != info["sha256"]:
        raise CheckpointError(f"{path}: checksum mismatch (corrupt)")
    return buf


def parse_safetensors(
    buf: bytearray | mmap.mmap, path: Path, keep: Callable[[str], bool] | None = None
) -> tuple[State, set[str]]:
    """The tensors of a safetensors file's bytes, as writable numpy views of ``buf``
    (only those ``keep`` accepts, when given), and the keys stored as BF16.

    Raises:
        CheckpointError: not a safetensors layout (naming ``path``).
    """
    header, data = read_header(buf, path)
    out: State = {}
    bf16: set[str] = set()
    for key, spec in header.items():
        if keep is not None and not keep(key):
            continue
        if spec["dtype"] == "BF16":
            bf16.add(key)
        out[key] = tensor_view(buf, data, key, spec, path)
    return out, bf16


def read_header(buf: bytearray | mmap.mmap, path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (tensor name -> its spec; ``__metadata__``
    left out) and where its data starts.

    Raises:
        CheckpointError: not a safetensors header (naming ``path``).
    """
    try:
        (n,) = struct.unpack_from("<Q", buf, 0)
        header = json.loads(bytes(buf[8 : 8 + n]))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (struct.error, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable tensor file ({exc!r})") from exc
    header.pop("__metadata__", None)
    return header, 8 + n


def tensor_view(
    buf: bytearray | mmap.mmap, data: int, key: str, spec: Mapping[str, Any], path: Path
) -> np.ndarray:
    """The numpy view of ``buf`` that ``spec`` (a header entry: dtype, shape,
    data offsets from ``data``) describes; BF16 as its bits (uint16).

    Raises:
        CheckpointError: a spec that does not fit ``buf`` (naming ``path`` and ``key``).
    """
    try:
        dtype = _DTYPES[spec["dtype"]]
        begin, end = (data + int(o) for o in spec["data_offsets"])
        shape = tuple(int(d) for d in spec["shape"])
        count = math.prod(shape)
        if end > len(buf) or end - begin != count * dtype.itemsize:
            raise ValueError(f"tensor {key!r}: offsets {spec['data_offsets']} do not fit")
        return np.frombuffer(buf, dtype, count, begin).reshape(shape)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: unreadable tensor file ({exc!r})") from exc


def read_link(
    folder: Path,
    manifest: dict[str, Any] | None = None,
    *,
    table_keys: Callable[[str], bool] | None = None,
) -> Link:
    """``load_link(folder)`` with each file read once (see module docstring);
    ``manifest``: the folder's, when the caller has read it already;
    ``table_keys``: only the table tensors it accepts (e.g. what lookups read:
    the rest of each file is verified, not parsed).

    Raises:
        CheckpointError: a file missing, truncated, corrupt or unreadable (naming it).
    """
    manifest = read_manifest(folder) if manifest is None else manifest
    files = {rel: read_verified(folder / rel, info) for rel, info in manifest["files"].items()}

    def state(path: Path, keep: Callable[[str], bool] | None = table_keys) -> State:
        rel = path.relative_to(folder).as_posix()
        if rel not in files:
            raise CheckpointError(f"{path}: not listed in {folder / 'manifest.json'}")
        return parse_safetensors(files[rel], path, keep)[0]

    dense_path = folder / "dense.safetensors"
    if dense_path.name not in files:
        raise CheckpointError(f"{dense_path}: not listed in {folder / 'manifest.json'}")
    arrays, bf16 = parse_safetensors(files[dense_path.name], dense_path)
    dense = {
        k: torch.from_numpy(a).view(torch.bfloat16) if k in bf16 else torch.from_numpy(a)
        for k, a in arrays.items()
    }
    parts = manifest.get("table_parts", {})
    tables: dict[str, State] = {}
    for name in manifest["tables"]:
        count = int(parts.get(name, 1))
        if count == 1:
            tables[name] = state(table_file(folder, name))
            continue
        states = [state(table_part_file(folder, name, p)) for p in range(count)]
        try:
            tables[name] = merge_server_parts(states, name)
        except ValueError as exc:
            raise CheckpointError(f"{table_part_file(folder, name, 0)}: {exc}") from exc
    return Link(folder, manifest, dense, tables)
