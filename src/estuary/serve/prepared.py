"""Tables prepared for serving: each table's rows sorted by id, in the checkpoint's
encoding, with deltas merged in; and the file that hands a prepared version from
the process that prepares it to the server.

``PreparedTable`` holds what a lookup reads (``FrozenTable``'s layout: sorted
ids, the rows as stored, the shards' unknown rows) and the checkpoint chain's
keys, so a delta is checked as ``EmbeddingTable.apply_delta`` checks it (same
lineage, based on the version held, or full). Merging a delta does what
``EmbeddingTable.apply_delta`` does to the rows a lookup reads: the delta's
evicted ids are removed, then its rows upserted, and its unknown rows (when it
has them) replace the held ones. So a ``FrozenTable`` over a prepared table
looks up what the ``EmbeddingTable`` restored from the same chain looks up
(``tests/serve/test_prepared.py``).

The handoff file (``write_version`` / ``read_version``) is the safetensors
layout (an 8-byte header length, a JSON header, the raw bytes): tensors
``table/<name>/ids``, ``table/<name>/weights``, ``table/<name>/unknown`` and
``dense/<key>``, written into a memory-backed folder (``/dev/shm`` on Linux) by
the preparing process and mapped by the server, whose arrays are views of the
mapping (nothing is copied, nothing pickled).
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from estuary.embedding.delta import (
    BASE,
    EVICTED_IDS,
    IDS,
    LINEAGE,
    UNKNOWN_PREFIX,
    VERSION,
    WEIGHTS,
    is_full,
)
from estuary.embedding.hashing import as_ids
from estuary.serve.frozen_table import decode_rows
from estuary.serve.link_reader import parse_safetensors
from estuary.train.checkpoint_chain import CheckpointError

__all__ = ["PreparedTable", "PreparedVersion", "read_version", "write_version"]

State = Mapping[str, np.ndarray]
_UNKNOWN = UNKNOWN_PREFIX + WEIGHTS
_TABLE, _DENSE = "table/", "dense/"
_NAMES: dict[np.dtype[Any], str] = {
    np.dtype(np.float64): "F64",
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(np.int64): "I64",
    np.dtype(np.int32): "I32",
    np.dtype(np.int16): "I16",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint8): "U8",
    np.dtype(np.bool_): "BOOL",
}


@dataclass
class PreparedTable:
    """One table's rows as a lookup reads them, and its chain keys.

    Args:
        name: the table's name (in errors).
        ids: int64 (R,), sorted, unique.
        weights: (R, D) as stored (float32, float16 or bfloat16 bits as uint16).
        unknown: float32 (S', D), the unknown rows as saved.
        lineage, version: the checkpoint chain's keys of the state held.
    """

    name: str
    ids: np.ndarray
    weights: np.ndarray
    unknown: np.ndarray
    lineage: int
    version: int

    @classmethod
    def from_state(cls, name: str, state: State) -> PreparedTable:
        """A table state (``state_dict``, any shard count) as a prepared table."""
        ids = as_ids(state[IDS])
        weights = np.asarray(state[WEIGHTS])
        if weights.ndim != 2 or weights.shape[0] != ids.size:
            raise ValueError(f"{name}: weights shape {weights.shape} does not fit {ids.size} ids")
        order = np.argsort(ids, kind="stable")
        sorted_ids = ids[order]
        if sorted_ids.size > 1 and not (np.diff(sorted_ids) > 0).all():
            raise ValueError(f"{name}: duplicate ids")
        unknown = np.asarray(state[_UNKNOWN], np.float32).reshape(-1, weights.shape[1])
        return cls(
            name,
            np.ascontiguousarray(sorted_ids),
            np.ascontiguousarray(weights[order]),
            np.array(unknown),
            int(state[LINEAGE][0]) if LINEAGE in state else 0,
            int(state[VERSION][0]) if VERSION in state else 0,
        )

    @property
    def dim(self) -> int:
        return int(self.weights.shape[1])

    def apply(self, delta: State) -> PreparedTable:
        """This table with ``delta`` (a ``delta_state_dict``) merged in, as a new
        table (this one is left as it is: it may still be served).

        Raises:
            ValueError: ``delta`` is not based on this state (as
                ``EmbeddingTable.apply_delta``), or its rows do not fit.
        """
        if BASE not in delta:
            raise ValueError(f"{self.name}: not a delta (no {BASE!r})")
        lineage, base = int(delta[LINEAGE][0]), int(delta[BASE][0])
        if lineage != self.lineage:
            raise ValueError(
                f"{self.name}: delta is from checkpoint chain {lineage:#x}, "
                f"this table follows {self.lineage:#x}"
            )
        full = is_full(dict(delta))
        if base != self.version and not full:
            raise ValueError(
                f"{self.name}: delta applies on top of version {base}, this table is at "
                f"version {self.version} (apply deltas in order, once each)"
            )
        if full:
            return PreparedTable.from_state(self.name, {**delta, _UNKNOWN: self._unknown(delta)})
        ids, weights = self.ids, self.weights
        gone = as_ids(delta.get(EVICTED_IDS, np.empty(0, np.int64)))
        if gone.size and ids.size:
            at = np.searchsorted(ids, gone)
            inside = at < ids.size
            at = at[inside][ids[at[inside]] == gone[inside]]
            if at.size:
                keep = np.ones(ids.size, np.bool_)
                keep[at] = False
                ids, weights = ids[keep], weights[keep]
        new_ids = as_ids(delta[IDS])
        rows = np.asarray(delta[WEIGHTS])
        if rows.shape != (new_ids.size, self.dim):
            raise ValueError(
                f"{self.name}: delta weights {rows.shape}, expected ({new_ids.size}, {self.dim})"
            )
        if rows.dtype != weights.dtype:  # another encoding: both as float32
            rows, weights = decode_rows(rows, None), decode_rows(weights, None)
        order = np.argsort(new_ids, kind="stable")
        new_ids, rows = new_ids[order], rows[order]
        at = np.searchsorted(ids, new_ids)
        hit = np.zeros(new_ids.size, np.bool_)
        inside = at < ids.size
        hit[inside] = ids[at[inside]] == new_ids[inside]
        fresh = ~hit
        merged_ids = np.insert(ids, at[fresh], new_ids[fresh])
        merged = np.insert(weights, at[fresh], rows[fresh], axis=0)
        # Rows that were held: their new places after the insertions before them.
        if hit.any():
            shift: np.ndarray = np.cumsum(fresh) - fresh  # insertions placed before each hit
            merged[at[hit] + shift[hit]] = rows[hit]
        return PreparedTable(
            self.name,
            merged_ids,
            merged,
            self._unknown(delta),
            lineage,
            int(delta[VERSION][0]) if VERSION in delta else self.version,
        )

    def _unknown(self, delta: State) -> np.ndarray:
        if _UNKNOWN not in delta:
            return self.unknown
        return np.array(np.asarray(delta[_UNKNOWN], np.float32).reshape(-1, self.dim))


@dataclass(frozen=True)
class PreparedVersion:
    """A version as the server reads it from a handoff file: per table its sorted
    ids, rows as stored and unknown rows (views of the mapped file), and the
    dense network's tensors."""

    tables: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]
    dense: dict[str, torch.Tensor]


def _dense_array(tensor: torch.Tensor) -> tuple[np.ndarray, str]:
    t = tensor.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16), "BF16"
    array = t.numpy()
    return array, _NAMES[array.dtype]


def _table_array(array: np.ndarray) -> tuple[np.ndarray, str]:
    if array.dtype == np.uint16:  # bfloat16 bits, as checkpoints store them
        return array, "BF16"
    return array, _NAMES[array.dtype]


def write_version(
    path: Path, tables: Mapping[str, PreparedTable], dense: Mapping[str, torch.Tensor]
) -> int:
    """Write a handoff file at ``path`` (through a temporary name, then renamed);
    returns its bytes. Tensors are laid out widest element first, so each starts
    aligned to its element size."""
    arrays: dict[str, tuple[np.ndarray, str]] = {}
    for name, table in tables.items():
        arrays[f"{_TABLE}{name}/ids"] = _table_array(table.ids)
        arrays[f"{_TABLE}{name}/weights"] = _table_array(table.weights)
        arrays[f"{_TABLE}{name}/unknown"] = _table_array(table.unknown)
    for key, tensor in dense.items():
        arrays[f"{_DENSE}{key}"] = _dense_array(tensor)
    order = sorted(arrays, key=lambda k: -arrays[k][0].dtype.itemsize)
    header: dict[str, Any] = {}
    offset = 0
    for key in order:
        array, dtype = arrays[key]
        header[key] = {
            "dtype": dtype,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)  # the data starts 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for key in order:
            f.write(np.ascontiguousarray(arrays[key][0]).data.cast("B"))
    os.replace(tmp, path)
    return 8 + len(text) + offset


def read_version(path: Path, *, unlink: bool = True) -> PreparedVersion:
    """Map a handoff file (copy-on-write: the arrays are writable, the file is
    never written) and view its tensors; ``unlink``: remove the file once mapped
    (the mapping lives on until its arrays are freed).

    Raises:
        CheckpointError: missing or not a handoff file (naming ``path``).
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise CheckpointError(f"{path}: prepared version missing ({exc})") from exc
    try:
        if unlink:
            os.unlink(path)
        buf = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    arrays, bf16 = parse_safetensors(buf, path)
    tables: dict[str, dict[str, np.ndarray]] = {}
    dense: dict[str, torch.Tensor] = {}
    for key, array in arrays.items():
        if key.startswith(_DENSE):
            t = torch.from_numpy(array)
            dense[key[len(_DENSE) :]] = t.view(torch.bfloat16) if key in bf16 else t
        elif key.startswith(_TABLE):
            name, part = key[len(_TABLE) :].rsplit("/", 1)
            tables.setdefault(name, {})[part] = array
        else:
            raise CheckpointError(f"{path}: unexpected tensor {key!r}")
    try:
        out = {n: (p["ids"], p["weights"], p["unknown"]) for n, p in tables.items()}
    except KeyError as exc:
        raise CheckpointError(f"{path}: a table lacks {exc}") from None
    return PreparedVersion(out, dense)
