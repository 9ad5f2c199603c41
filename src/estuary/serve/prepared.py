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

A version is handed over in a slot file (``SlotWriter`` / ``SlotReader``) in
the safetensors layout (an 8-byte header length, a JSON header, the raw bytes):
tensors ``table/<name>/ids``, ``table/<name>/weights``, ``table/<name>/unknown``
and ``dense/<key>``, written by the preparing process into files of a
memory-backed folder (``/dev/shm`` on Linux) that it reuses in turn, and mapped
once by the server, whose arrays are views of the mapping (nothing pickled;
per version no new mapping and no page faults: measured on the bench model, a
new mapping per version cost the server ~8 ms of CPU to map and populate).
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

__all__ = ["PreparedTable", "PreparedVersion", "SlotReader", "SlotWriter"]

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


def _layout(
    tables: Mapping[str, PreparedTable], dense: Mapping[str, torch.Tensor]
) -> tuple[bytes, list[np.ndarray]]:
    """The header (length and JSON, padded so the data starts 8-byte aligned) and
    the arrays in their order: widest element first, so each starts aligned."""
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
    text += b" " * (-(8 + len(text)) % 8)
    return len(text).to_bytes(8, "little") + text, [arrays[k][0] for k in order]


@dataclass
class _Slot:
    path: Path
    capacity: int
    buf: mmap.mmap


class SlotWriter:
    """Writes prepared versions into ``slots`` files of ``folder`` in turn (the
    preparing process's side). A file is written over in place, so the server's
    mapping of it stays (no new mapping, no page faults per version); a version
    that does not fit goes to a new, larger file, and the old one is unlinked.

    ``write`` writes into the slot the server does not serve; ``served`` (the
    server serves the version written last) moves on to the other slot. A
    version the server did not take is written over by the next one.
    """

    def __init__(self, folder: Path, slots: int = 2) -> None:
        self.folder = folder
        self.slots: list[_Slot | None] = [None] * slots
        self._next = 0
        self._files = 0

    def write(
        self, tables: Mapping[str, PreparedTable], dense: Mapping[str, torch.Tensor]
    ) -> tuple[Path, int]:
        """Write a version into the next slot; returns its file and bytes used."""
        head, arrays = _layout(tables, dense)
        size = len(head) + sum(a.nbytes for a in arrays)
        index = self._next
        slot = self.slots[index]
        if slot is None or slot.capacity < size:
            slot = self.slots[index] = self._grow(slot, size)
        slot.buf[: len(head)] = head
        at = len(head)
        for array in arrays:
            flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
            np.frombuffer(slot.buf, np.uint8, flat.size, at)[:] = flat
            at += flat.size
        return slot.path, size

    def served(self) -> None:
        """The server serves the version written last: the next goes to another slot."""
        self._next = (self._next + 1) % len(self.slots)

    def _grow(self, old: _Slot | None, size: int) -> _Slot:
        # Room for the tables to double: a new file is mapped anew by the server
        # (and its pages faulted in), so it should be rare while a run grows.
        capacity = 2 * size + 4096
        self._files += 1
        path = self.folder / f"{os.getpid()}-{self._files}.slot"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, capacity)
            buf = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        if old is not None:
            old.path.unlink(missing_ok=True)  # the server's mapping of it lives on
        return _Slot(path, capacity, buf)

    def close(self) -> None:
        """Remove the slot files (mappings of them live on until unmapped)."""
        for slot in self.slots:
            if slot is not None:
                slot.path.unlink(missing_ok=True)


class SlotReader:
    """Views the versions in slot files (the server's side): each file is mapped
    once, shared and read-only, and its arrays are views of the mapping (nothing
    copied but the dense network's few tensors)."""

    def __init__(self, keep: int = 4) -> None:
        self._maps: dict[str, mmap.mmap] = {}
        self._keep = keep

    def read(self, path: Path, size: int) -> PreparedVersion:
        """The version of ``size`` bytes at the start of ``path``.

        Raises:
            CheckpointError: missing or not a handoff file (naming ``path``).
        """
        buf = self._maps.get(str(path))
        if buf is None or len(buf) < size:
            buf = self._map(path)
        arrays, bf16 = parse_safetensors(buf, path)
        tables: dict[str, dict[str, np.ndarray]] = {}
        dense: dict[str, torch.Tensor] = {}
        for key, array in arrays.items():
            if key.startswith(_DENSE):
                t = torch.from_numpy(array.copy())  # a few small tensors, writable
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

    def _map(self, path: Path) -> mmap.mmap:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise CheckpointError(f"{path}: prepared version missing ({exc})") from exc
        try:
            # Every page mapped now (MAP_POPULATE; the GIL released during the
            # call), not faulted in one by one by the lookups after the swap.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            buf = mmap.mmap(fd, 0, flags=flags, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._maps[str(path)] = buf
        while len(self._maps) > self._keep:  # files replaced since: their views live on
            del self._maps[next(iter(self._maps))]
        return buf

    def forget(self) -> None:
        """Map every file anew from now on (a new preparing process writes new ones)."""
        self._maps.clear()
