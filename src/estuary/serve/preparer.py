"""``Preparer``: a run's newest checkpoint, as the deltas after the one prepared
last or, when it cannot be reached so, whole.

``step`` looks at the run's ``latest`` and decides as the in-process follower
does (``plan_update``): a checkpoint whose chain holds the one prepared last is
reached by the deltas after it (each link read once, only the keys a lookup
reads: ``read_link``; each delta checked against the chain keys of the tables
as ``EmbeddingTable.apply_delta`` checks it, but not merged: the slot files
merge them, ``estuary.serve.slots``); anything else (a new chain, a link pruned
before it was read, a delta that does not apply on the version held, a delta
carrying every row) is prepared whole from its chain (``PreparedTable``). The
result also carries the newest link's dense network.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from estuary.embedding.delta import WEIGHTS
from estuary.serve.checkpoints import serving_key
from estuary.serve.follow import UpdateKind, plan_update
from estuary.serve.link_reader import read_link
from estuary.serve.prepared import PreparedTable, check_delta
from estuary.train.checkpoint import Link
from estuary.train.checkpoint_chain import (
    CheckpointError,
    chain_of,
    read_manifest,
    resolve_checkpoint,
    table_file,
)

__all__ = ["Prepared", "Preparer"]


@dataclass(frozen=True)
class Prepared:
    """A checkpoint prepared.

    Args:
        checkpoint: its folder.
        manifest: its manifest.
        kind: ``DELTA`` (``links``: the deltas after the checkpoint prepared
            last) or ``FULL`` (``tables``: every table, whole).
        tables: every table, whole (``FULL``; empty for ``DELTA``).
        dense: the checkpoint's dense network (state dict).
        links: per link after the one prepared last, in order, its tables'
            deltas (``DELTA``; checked, not merged).
    """

    checkpoint: Path
    manifest: dict[str, Any]
    kind: UpdateKind
    tables: dict[str, PreparedTable]
    dense: dict[str, torch.Tensor]
    links: Sequence[Mapping[str, Mapping[str, Any]]] = field(default_factory=list)


class Preparer:
    """Prepares the newest checkpoint of ``run_dir`` (a run's output folder, its
    ``checkpoints`` folder, or a checkpoint folder)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.checkpoint: str | None = None  # the folder name of the version prepared last
        self.keys: dict[str, _Keys] = {}  # its tables' chain keys and row layout

    def load(self, checkpoint: Path) -> Prepared:
        """Prepare ``checkpoint`` whole (its chain from the full link).

        Raises:
            CheckpointError: a file missing, corrupt, or rows that do not fit (naming it).
        """
        manifest = read_manifest(checkpoint)
        names = chain_of(checkpoint, manifest)
        links = [self._read(checkpoint, manifest, name) for name in names]
        tables: dict[str, PreparedTable] = {}
        for name, state in links[0].tables.items():
            try:
                tables[name] = PreparedTable.from_state(name, state)
            except ValueError as exc:
                raise CheckpointError(f"{table_file(links[0].path, name)}: {exc}") from exc
        tables = _merge(tables, links[1:])
        self.checkpoint = checkpoint.name
        self.keys = {name: _Keys.of(table) for name, table in tables.items()}
        return Prepared(checkpoint, manifest, UpdateKind.FULL, tables, links[-1].dense)

    def step(self) -> Prepared | None:
        """The newest checkpoint prepared, or ``None`` when it is the one held.

        Raises:
            CheckpointError: it does not load (the tables held stay as they are).
        """
        latest = resolve_checkpoint(self.run_dir)
        if latest.name == self.checkpoint:  # nothing new: no manifest parsed
            return None
        manifest = read_manifest(latest)
        served = self.checkpoint or ""
        decision = plan_update(served, latest.name, chain_of(latest, manifest), dense_due=True)
        if decision.kind is UpdateKind.DELTA and self.keys:
            links = [self._read(latest, manifest, name) for name in decision.links]
            try:
                keys = _check(self.keys, links)
            except ValueError:  # not at the delta's base, or a delta of every row
                return self.load(latest)
            self.checkpoint, self.keys = latest.name, keys
            deltas = [link.tables for link in links]
            return Prepared(latest, manifest, UpdateKind.DELTA, {}, links[-1].dense, deltas)
        return self.load(latest)

    def _read(self, latest: Path, manifest: dict[str, Any], name: str) -> Link:
        return read_link(
            latest.parent / name,
            manifest if name == latest.name else None,
            table_keys=serving_key,
        )


@dataclass(frozen=True)
class _Keys:
    """A table's chain keys and row layout: what a delta must fit."""

    lineage: int
    version: int
    dim: int
    dtype: str

    @classmethod
    def of(cls, table: PreparedTable) -> _Keys:
        return cls(table.lineage, table.version, table.dim, str(table.weights.dtype))


def _check(keys: Mapping[str, _Keys], links: list[Link]) -> dict[str, _Keys]:
    """The tables' keys after ``links``' deltas, each checked in order.

    Raises:
        ValueError: a delta that cannot be merged into the version held (not based
            on it, carrying every row, another row layout): prepare it whole.
        CheckpointError: a delta of a table not held (naming its file).
    """
    out = dict(keys)
    for link in links:
        for name, delta in link.tables.items():
            held = out.get(name)
            if held is None:
                raise CheckpointError(f"{table_file(link.path, name)}: no table {name!r} before")
            lineage, version, full = check_delta(name, held.lineage, held.version, delta)
            rows = np.asarray(delta[WEIGHTS])
            if full or rows.ndim != 2 or rows.shape[1] != held.dim or str(rows.dtype) != held.dtype:
                raise ValueError(f"{name}: delta to prepare whole")
            out[name] = _Keys(lineage, version, held.dim, held.dtype)
    return out


def _merge(tables: Mapping[str, PreparedTable], links: list[Link]) -> dict[str, PreparedTable]:
    """``tables`` with each link's deltas merged, in order (new tables; ``tables``
    unchanged). A delta that does not apply raises ``CheckpointError`` naming its
    file."""
    out = dict(tables)
    for link in links:
        for name, delta in link.tables.items():
            if name not in out:
                raise CheckpointError(f"{table_file(link.path, name)}: no table {name!r} before")
            try:
                out[name] = out[name].apply(delta)
            except ValueError as exc:
                raise CheckpointError(f"{table_file(link.path, name)}: {exc}") from exc
    return out
