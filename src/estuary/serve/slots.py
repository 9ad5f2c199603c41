"""Slot files: prepared versions handed from the preparing process to the server,
each file kept up to date by writing only what changed.

A version is handed over in one of two slot files of a memory-backed folder
(``/dev/shm`` on Linux), written in turn: the preparing process
(``estuary.serve.prepare_process``) writes the version into the slot the server
does not serve, the server maps each file once (shared, read-only) and views the
version's arrays in it (nothing pickled, nothing copied but the dense network's
few tensors).

The layout is safetensors' (an 8-byte header length, a JSON header of dtype,
shape and byte offsets per tensor, then the raw bytes), with room to grow: the
header has a fixed place of its own, and each table a fixed region with room for
``cap`` rows: ``table/<name>/index`` (an open-addressing hash index of the ids
held and where each one's row is), ``.../count`` (how many),
``.../weights`` (the rows as stored, in the order their ids arrived) and
``.../unknown`` (the shards' unknown rows); and ``dense/<key>`` per dense
tensor (``estuary.serve.slot_table`` has the layout and the served table over
it, ``SlotTable``).

Incremental writing (``SlotWriter``): each slot remembers the updates it has
not received yet (the versions written into the other slot since). To hold a
new version, a slot applies its missed deltas in place, touching only what they
change: a held id's row is written where it is, a new id's row after the last
row and its id into the index, an evicted id's index entry marked gone (its row
stays, unreferenced, until the slot is next laid out). Nothing else moves, so
with two slots a slot catches up by the touched rows of the last two versions,
not by a copy of every table. A table that outgrows its region moves: it is
laid out anew, with room to double, in the file's room after the regions (a
new file is ``room`` times the size its version needs; tmpfs backs those bytes
with memory only once written), its rows copied, the other tables left where
they are; its old region stays, unused, until the slot is next laid out. A slot
is laid out and written whole (into a new, larger file when it does not fit its
own, which the server maps anew) when it has not been written yet, a version
was prepared whole (a new chain, a pruned link), a table outgrew its region and
the file has no room left, or a delta changes a shape or encoding.

The server (``SlotReader``) maps each file once without ``MAP_POPULATE`` (which
would map in, and back with memory, the room too) and maps in each table's
region when a version first names it (``Prefaulter``); per version it parses
the header and makes views only of the entries that changed.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from estuary.embedding.delta import EVICTED_IDS, IDS, UNKNOWN_PREFIX, WEIGHTS, is_full
from estuary.embedding.hashing import as_ids
from estuary.serve.link_reader import read_header, tensor_view
from estuary.serve.prefault import Prefaulter
from estuary.serve.prepared import PreparedTable, check_delta
from estuary.serve.slot_table import count_new, fill_index, index_size, remove_ids, upsert_rows
from estuary.train.checkpoint_chain import CheckpointError

__all__ = ["PreparedVersion", "SlotReader", "SlotWriter"]

State = Mapping[str, np.ndarray]
Link = Mapping[str, State]  # table name -> its delta state
_UNKNOWN = UNKNOWN_PREFIX + WEIGHTS
_TABLE, _DENSE = "table/", "dense/"
_ALIGN = 64
_MIN_SPARE_ROWS = 1024
_WIDE = 10**15  # a number as wide as any offset or index size in a header
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


@dataclass(frozen=True)
class PreparedVersion:
    """A version as the server reads it from a slot file: per table its index,
    the rows as stored and the unknown rows (views of
    the mapped file) and how many ids it holds (``SlotTable``'s arguments); and
    the dense network's tensors."""

    tables: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, int]]
    dense: dict[str, torch.Tensor]


def _dense_array(tensor: torch.Tensor) -> tuple[np.ndarray, str]:
    t = tensor.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16), "BF16"
    array = t.numpy()
    return array, _NAMES[array.dtype]


def _rows_dtype(weights: np.ndarray) -> str:
    if weights.dtype == np.uint16:  # bfloat16 bits, as checkpoints store them
        return "BF16"
    return _NAMES[weights.dtype]


def _aligned(n: int) -> int:
    return n + (-n % _ALIGN)


@dataclass
class _Region:
    """One table's place in a slot file (``slot_table``'s hashed layout), and
    what it holds."""

    name: str
    offset: int  # of the region, from the start of the data
    cap: int  # rows it has room for
    index: np.ndarray  # (H, 2) int64 views of the file: (id, row) entries
    count: np.ndarray  # (1,) int64: ids held, for the reader
    weights: np.ndarray  # (cap, D) as stored
    unknown: np.ndarray  # (S', D) float32
    n: int = 0  # ids held
    m: int = 0  # rows used (held, and evicted ones not yet dropped)
    lineage: int = 0
    version: int = 0

    @staticmethod
    def parts(cap: int, dim: int, itemsize: int, unknown: int) -> list[int]:
        """Bytes of the index, count, weights and unknown rows (each aligned)."""
        size = index_size(cap)
        return [
            _aligned(16 * size),
            _aligned(8),
            _aligned(cap * dim * itemsize),
            _aligned(4 * unknown),
        ]

    @classmethod
    def place(
        cls, buf: mmap.mmap, data: int, offset: int, cap: int, table: PreparedTable
    ) -> _Region:
        """The region at ``offset`` (from ``data``, the start of the data) for
        ``cap`` rows of ``table``'s shape, filled with ``table``."""
        dim, dtype = table.weights.shape[1], table.weights.dtype
        sizes = cls.parts(cap, dim, dtype.itemsize, table.unknown.size)
        at = np.cumsum([data + offset, *sizes[:-1]])
        size = index_size(cap)
        index = np.frombuffer(buf, np.int64, 2 * size, at[0]).reshape(size, 2)
        count = np.frombuffer(buf, np.int64, 1, at[1])
        weights = np.frombuffer(buf, dtype, cap * dim, at[2]).reshape(cap, dim)
        unknown = np.frombuffer(buf, np.float32, table.unknown.size, at[3])
        region = cls(
            table.name,
            offset,
            cap,
            index,
            count,
            weights,
            unknown.reshape(table.unknown.shape),
        )
        n = table.ids.size
        fill_index(index, table.ids)
        region.weights[:n] = table.weights
        region.unknown[...] = table.unknown
        region.n = region.m = n
        region.lineage, region.version = table.lineage, table.version
        return region

    def table(self) -> PreparedTable:
        """What the region holds, as a table of its own (sorted, evicted rows dropped)."""
        live = self.index[:, 1] >= 0
        ids, rows = self.index[live, 0], self.index[live, 1]
        order = np.argsort(ids, kind="stable")
        return PreparedTable(
            self.name,
            ids[order],
            self.weights[rows[order]],
            self.unknown.copy(),
            self.lineage,
            self.version,
        )

    def header(self) -> dict[str, Any]:
        dim, item = self.weights.shape[1], self.weights.itemsize
        sizes = self.parts(self.cap, dim, item, self.unknown.size)
        at = np.cumsum([self.offset, *sizes[:-1]]).tolist()
        size = self.index.shape[0]
        base = f"{_TABLE}{self.name}/"
        self.count[0] = self.n
        return {
            base + "index": _entry("I64", [size, 2], at[0], 16 * size),
            base + "count": _entry("I64", [1], at[1], 8),
            base + "weights": _entry(
                _rows_dtype(self.weights), [self.m, dim], at[2], self.m * dim * item
            ),
            base + "unknown": _entry("F32", list(self.unknown.shape), at[3], self.unknown.nbytes),
        }

    def new_rows(self, delta: State) -> int:
        """At most how many rows ``delta`` adds: ids not held now, and any evicted
        id taken back."""
        gone = np.asarray(delta.get(EVICTED_IDS, ())).size
        return count_new(self.index, as_ids(delta[IDS])) + gone

    def apply(self, delta: State) -> None:
        """Merge ``delta`` in place (``_SlotFile.fits`` said it fits)."""
        lineage, version, _ = check_delta(self.name, self.lineage, self.version, delta)
        gone = as_ids(delta.get(EVICTED_IDS, np.empty(0, np.int64)))
        if gone.size:
            self.n -= remove_ids(self.index, gone)
        new_ids = as_ids(delta[IDS])
        if new_ids.size:
            rows = np.ascontiguousarray(delta[WEIGHTS]).view(np.uint8)
            m = self.m
            self.m, _ = upsert_rows(self.index, self.weights.view(np.uint8), m, new_ids, rows)
            self.n += self.m - m
        if _UNKNOWN in delta:
            self.unknown[...] = np.asarray(delta[_UNKNOWN], np.float32).reshape(self.unknown.shape)
        self.lineage, self.version = lineage, version


def _cap(rows: int, growth: float) -> int:
    """Rows a region laid out for ``rows`` rows has room for."""
    return max(int(growth * rows), rows + _MIN_SPARE_ROWS)


def _entry(dtype: str, shape: list[int], offset: int, nbytes: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}


class _SlotFile:
    """One slot file, mapped: its tables' regions and its dense tensors' places."""

    def __init__(self, path: Path, capacity: int) -> None:
        self.path = path
        self.capacity = capacity
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, capacity)
            self.buf = mmap.mmap(fd, capacity, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.head = 0
        self.end = 0  # data bytes laid out (regions moved since included)
        self.regions: dict[str, _Region] = {}
        self.dense: dict[str, tuple[np.ndarray, str, int]] = {}  # view, dtype name, offset

    @staticmethod
    def plan(
        tables: Mapping[str, PreparedTable],
        dense: Mapping[str, torch.Tensor],
        growth: float,
    ) -> tuple[int, dict[str, tuple[int, int]], dict[str, int], int]:
        """Where everything goes: the header's room, per table (offset, cap), per
        dense tensor its offset, and the file's size."""
        offset = 0
        places: dict[str, tuple[int, int]] = {}
        for name, table in tables.items():
            n = table.ids.size
            cap = _cap(n, growth)
            places[name] = (offset, cap)
            dim, item = table.weights.shape[1], table.weights.itemsize
            offset += sum(_Region.parts(cap, dim, item, table.unknown.size))
        dense_at: dict[str, int] = {}
        for key, tensor in dense.items():
            dense_at[key] = offset
            offset += _aligned(_dense_array(tensor)[0].nbytes)
        # The header's room: its text with every shape and offset at its largest
        # (a table's region may move to the end of a larger file: ``move``).
        widest = {
            f"{_TABLE}{name}/{part}": _entry("BF16", [_WIDE, 10**6], _WIDE, _WIDE)
            for name in places
            for part in ("index", "count", "weights", "unknown")
        }
        widest.update(
            {f"{_DENSE}{key}": _entry("BF16", [10**9] * 4, _WIDE, _WIDE) for key in dense}
        )
        head = _aligned(len(json.dumps(widest, separators=(",", ":"))) + 256) - 8
        return head, places, dense_at, 8 + head + offset

    def fill(
        self,
        tables: Mapping[str, PreparedTable],
        dense: Mapping[str, torch.Tensor],
        growth: float,
    ) -> None:
        """Lay the file out for ``tables`` (fitting: ``plan``'s size) and write them whole."""
        head, places, dense_at, size = self.plan(tables, dense, growth)
        if size > self.capacity:
            raise ValueError(f"{self.path}: {size} bytes do not fit in {self.capacity}")
        self.head = head
        self.end = size - 8 - head
        data = 8 + head
        self.regions = {
            name: _Region.place(self.buf, data, *places[name], table)
            for name, table in tables.items()
        }
        self.dense = {}
        for key, tensor in dense.items():
            array, dtype = _dense_array(tensor)
            view = np.frombuffer(self.buf, array.dtype, array.size, data + dense_at[key])
            self.dense[key] = (view.reshape(array.shape), dtype, dense_at[key])
        self.write_dense(dense)

    def grows(
        self, links: Sequence[Link], dense: Mapping[str, torch.Tensor]
    ) -> dict[str, int] | None:
        """Whether ``links`` (in order) can be merged in place and ``dense`` written
        in its places: ``None`` when not (a shape, an encoding or a chain key
        changed, a delta of every row), else the tables whose regions are too
        small, each with at most how many rows it will use (``move`` them first)."""
        if sorted(dense) != sorted(self.dense):
            return None
        for key, tensor in dense.items():
            array, dtype = _dense_array(tensor)
            view, held, _ = self.dense[key]
            if dtype != held or array.shape != view.shape:
                return None
        keys = {name: (r.lineage, r.version) for name, r in self.regions.items()}
        used = {name: r.m for name, r in self.regions.items()}
        for link in links:
            for name, delta in link.items():
                region = self.regions.get(name)
                if region is None or is_full(dict(delta)):
                    return None
                try:
                    lineage, version, _ = check_delta(name, *keys[name], delta)
                except ValueError:
                    return None
                keys[name] = (lineage, version)
                rows = np.asarray(delta[WEIGHTS])
                ids = as_ids(delta[IDS])
                dim = region.weights.shape[1]
                if rows.dtype != region.weights.dtype or rows.shape != (ids.size, dim):
                    return None
                if _UNKNOWN in delta and np.asarray(delta[_UNKNOWN]).size != region.unknown.size:
                    return None
                # At most every id new; counted exactly only when that does not fit.
                bound = ids.size + np.asarray(delta.get(EVICTED_IDS, ())).size
                used[name] += bound if used[name] + bound <= region.cap else region.new_rows(delta)
        return {name: rows for name, rows in used.items() if rows > self.regions[name].cap}

    def move_bytes(self, grows: Mapping[str, int], growth: float) -> int:
        """Bytes the regions ``move`` would lay out for ``grows`` (table -> rows)."""
        total = 0
        for name, rows in grows.items():
            region = self.regions[name]
            dim, item = region.weights.shape[1], region.weights.itemsize
            total += sum(_Region.parts(_cap(rows, growth), dim, item, region.unknown.size))
        return total

    def room(self) -> int:
        """Bytes free at the end of the file (not backed by memory until written)."""
        return self.capacity - (8 + self.head + self.end)

    def move(self, name: str, rows: int, growth: float) -> None:
        """Lay table ``name`` out anew, with room for ``rows`` rows and more, at the
        end of the file (``room`` checked by the caller): its rows held are copied,
        O(its rows), the other tables stay where they are. Its old region stays,
        unused, until the slot is next written whole."""
        table = self.regions[name].table()
        region = _Region.place(self.buf, 8 + self.head, self.end, _cap(rows, growth), table)
        self.regions[name] = region
        dim, item = region.weights.shape[1], region.weights.itemsize
        self.end += sum(_Region.parts(region.cap, dim, item, region.unknown.size))

    def apply(self, link: Link) -> None:
        for name, delta in link.items():
            self.regions[name].apply(delta)

    def write_dense(self, dense: Mapping[str, torch.Tensor]) -> None:
        for key, tensor in dense.items():
            self.dense[key][0][...] = _dense_array(tensor)[0]

    def write_header(self) -> None:
        header: dict[str, Any] = {}
        for region in self.regions.values():
            header.update(region.header())
        for key, (view, dtype, offset) in self.dense.items():
            header[f"{_DENSE}{key}"] = _entry(dtype, list(view.shape), offset, view.nbytes)
        text = json.dumps(header, separators=(",", ":")).encode()
        if len(text) > self.head:
            raise ValueError(f"{self.path}: a header of {len(text)} bytes, room for {self.head}")
        self.buf[:8] = self.head.to_bytes(8, "little")
        self.buf[8 : 8 + self.head] = text + b" " * (self.head - len(text))

    def tables(self) -> dict[str, PreparedTable]:
        return {name: region.table() for name, region in self.regions.items()}

    def close(self) -> None:
        self.regions, self.dense = {}, {}  # the views, before the mapping
        self.path.unlink(missing_ok=True)  # the server's mapping of it lives on


@dataclass(frozen=True)
class _Whole:
    """A version prepared whole."""

    tables: Mapping[str, PreparedTable]


@dataclass(frozen=True)
class _Deltas:
    """Deltas merged into the version before (per link, per table)."""

    links: Sequence[Link]


class SlotWriter:
    """Writes prepared versions into ``slots`` files of ``folder`` in turn (the
    preparing process's side), each by what it missed (module docstring).

    ``base`` names the version the server serves already (every slot starts from
    it); ``write_whole`` and ``write_deltas`` write the next version into the slot
    the server does not serve; ``served`` (the server serves the version written
    last) moves on to the other slot. A version the server did not take is
    written over by the next one. ``last_whole``: whether the last version was
    written whole; ``whole_writes`` and ``writes``: counts.

    Args:
        folder: where the slot files go (memory-backed, ``/dev/shm``).
        slots: how many files take turns.
        growth: a table written whole gets room for ``growth`` times its rows
            (at least 1,024 more); so does a table moved.
        room: a new file is ``room`` times the size its version needs: bytes
            that tmpfs backs with memory only once written, where the regions of
            tables that outgrew theirs move to (``moves`` counts them).
    """

    def __init__(
        self, folder: Path, slots: int = 2, growth: float = 2.0, room: float = 8.0
    ) -> None:
        if room < 1:
            raise ValueError(f"SlotWriter: room must be >= 1, not {room}")
        self.folder = folder
        self.growth = growth
        self.room = room
        self.moves = 0
        self._files: list[_SlotFile | None] = [None] * slots
        self._missed: list[list[_Whole | _Deltas]] = [[] for _ in range(slots)]
        self._next = 0
        self._made = 0
        self.last_whole = False
        self.whole_writes = 0
        self.writes = 0

    def base(self, tables: Mapping[str, PreparedTable]) -> None:
        """The version the server serves now (not written): slots start from it."""
        for missed in self._missed:
            missed.append(_Whole(tables))

    def write_whole(
        self, tables: Mapping[str, PreparedTable], dense: Mapping[str, torch.Tensor]
    ) -> tuple[Path, int]:
        """Write a version prepared whole; returns its file and size."""
        return self._write(_Whole(tables), dense)

    def write_deltas(
        self, links: Sequence[Link], dense: Mapping[str, torch.Tensor]
    ) -> tuple[Path, int]:
        """Write the version after the last by ``links``' deltas (in order)."""
        return self._write(_Deltas(links), dense)

    @property
    def next_slot(self) -> int:
        """The index of the slot the next version is written into."""
        return self._next

    def served(self) -> None:
        """The server serves the version written last: the next goes to another slot."""
        self._next = (self._next + 1) % len(self._files)

    def close(self) -> None:
        """Remove the slot files (mappings of them live on until unmapped)."""
        for slot in self._files:
            if slot is not None:
                slot.close()
        self._files = [None] * len(self._files)

    def _write(
        self, update: _Whole | _Deltas, dense: Mapping[str, torch.Tensor]
    ) -> tuple[Path, int]:
        for missed in self._missed:
            missed.append(update)
        index = self._next
        missed = self._missed[index]
        slot = self._files[index]
        wholes = [i for i, u in enumerate(missed) if isinstance(u, _Whole)]
        after = missed[wholes[-1] + 1 :] if wholes else missed
        links = [link for u in after if isinstance(u, _Deltas) for link in u.links]
        grows = slot.grows(links, dense) if not wholes and slot is not None else None
        if grows is not None and slot is not None and self._moved(slot, grows):
            for link in links:
                slot.apply(link)
            slot.write_dense(dense)
            self.last_whole = False
        else:
            if wholes:
                start = missed[wholes[-1]]
                assert isinstance(start, _Whole)
                tables = dict(start.tables)
            elif slot is not None:
                tables = slot.tables()
            else:
                raise RuntimeError("a slot has no version to start from (no base)")
            for link in links:  # merged in memory: the same checks, new arrays
                for name, delta in link.items():
                    if name not in tables:
                        raise ValueError(f"delta of table {name!r}, a table not held")
                    tables[name] = tables[name].apply(delta)
            slot = self._whole(index, tables, dense)
            self.last_whole = True
            self.whole_writes += 1
        slot.write_header()
        missed.clear()
        self.writes += 1
        return slot.path, slot.capacity

    def _whole(
        self, index: int, tables: Mapping[str, PreparedTable], dense: Mapping[str, torch.Tensor]
    ) -> _SlotFile:
        slot = self._files[index]
        size = _SlotFile.plan(tables, dense, self.growth)[3]
        if slot is None or slot.capacity < size:
            # A new file is mapped anew by the server: rare, as each table has
            # room to grow and the file room (``room``) for regions to move into.
            self._made += 1
            path = self.folder / f"{os.getpid()}-{self._made}.slot"
            new = _SlotFile(path, int(self.room * size))
            if slot is not None:
                slot.close()
            slot = self._files[index] = new
        slot.fill(tables, dense, self.growth)
        return slot

    def _moved(self, slot: _SlotFile, grows: Mapping[str, int]) -> bool:
        """Move the regions of ``grows``' tables to the end of ``slot`` (each with
        room for its rows and more); ``False`` (nothing moved) when the file has
        not the room."""
        if grows and slot.move_bytes(grows, self.growth) > slot.room():
            return False
        for name, rows in grows.items():
            slot.move(name, rows, self.growth)
            self.moves += 1
        return True


@dataclass
class _Mapped:
    """A slot file as the server maps it: the mapping, what of it is mapped in,
    and the views made of it (tensor -> its header entry, the view)."""

    buf: mmap.mmap
    prefault: Prefaulter
    views: dict[str, tuple[dict[str, Any], np.ndarray]] = field(default_factory=dict)


class SlotReader:
    """Views the versions in slot files (the server's side): each file is mapped
    once, shared and read-only, and its arrays are views of the mapping (nothing
    copied but the dense network's few tensors)."""

    def __init__(self, keep: int = 4) -> None:
        self._maps: dict[str, _Mapped] = {}
        self._keep = keep

    def read(self, path: Path, size: int, *, dense: bool = True) -> PreparedVersion:
        """The version in the file ``path`` of ``size`` bytes; its dense tensors
        (copied out of the file) only with ``dense`` (else ``{}``).

        Per version only what changed costs: a tensor whose header entry is the
        one read before from this mapping is the view made then; a table region
        seen before is mapped in already.

        Raises:
            CheckpointError: missing or not a slot file (naming ``path``).
        """
        mapped = self._maps.get(str(path))
        if mapped is None or len(mapped.buf) < size:
            mapped = self._map(path)
        buf, views = mapped.buf, mapped.views
        header, data = read_header(buf, path)
        tables: dict[str, dict[str, np.ndarray]] = {}
        tensors: dict[str, torch.Tensor] = {}
        for key, spec in header.items():
            is_dense = key.startswith(_DENSE)
            if is_dense and not dense:
                continue
            if not is_dense and not key.startswith(_TABLE):
                raise CheckpointError(f"{path}: unexpected tensor {key!r}")
            held = views.get(key)
            if held is not None and held[0] == spec:  # dtype, shape, offsets: unchanged
                array = held[1]
            else:
                array = tensor_view(buf, data, key, spec, path)
                views[key] = (spec, array)
            if is_dense:
                t = torch.from_numpy(array.copy())  # a few small tensors, writable
                bf16 = spec["dtype"] == "BF16"
                tensors[key[len(_DENSE) :]] = t.view(torch.bfloat16) if bf16 else t
            else:
                name, part = key[len(_TABLE) :].rsplit("/", 1)
                tables.setdefault(name, {})[part] = array
        try:
            out = {
                n: (p["index"], p["weights"], p["unknown"], int(p["count"][0]))
                for n, p in tables.items()
            }
            for name in tables:
                # The region's pages, from its index to its unknown rows (its rows
                # and spare rows between): mapped in once, now, not by the lookups.
                begin = header[f"{_TABLE}{name}/index"]["data_offsets"][0]
                end = header[f"{_TABLE}{name}/unknown"]["data_offsets"][1]
                mapped.prefault.span(data + int(begin), data + int(end))
        except KeyError as exc:
            raise CheckpointError(f"{path}: a table lacks {exc}") from None
        return PreparedVersion(out, tensors)

    def _map(self, path: Path) -> _Mapped:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise CheckpointError(f"{path}: prepared version missing ({exc})") from exc
        try:
            # No MAP_POPULATE: the file's room would be mapped too (and backed
            # with memory); ``read`` maps in the pages each version uses.
            buf = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        mapped = self._maps[str(path)] = _Mapped(buf, Prefaulter(buf))
        while len(self._maps) > self._keep:  # files replaced since: their views live on
            del self._maps[next(iter(self._maps))]
        return mapped

    def forget(self) -> None:
        """Map every file anew from now on (a new preparing process writes new ones)."""
        self._maps.clear()
