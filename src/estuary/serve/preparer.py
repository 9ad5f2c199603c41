"""``Preparer``: a run's newest checkpoint as whole prepared tables, kept up to
date by merging each new delta into the tables of the last one.

``step`` looks at the run's ``latest`` and decides as the in-process follower
does (``plan_update``): a checkpoint whose chain holds the one prepared last is
reached by merging the deltas after it (each link read once, only the keys a
lookup reads: ``read_link``); anything else (a new chain, a link pruned before
it was read, a delta that does not apply on the tables held) is prepared whole
from its chain. The result is every table (``PreparedTable``) and the newest
link's dense network: what a server swaps in whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from estuary.serve.checkpoints import serving_key
from estuary.serve.follow import UpdateKind, plan_update
from estuary.serve.link_reader import read_link
from estuary.serve.prepared import PreparedTable
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
    """A checkpoint prepared whole.

    Args:
        checkpoint: its folder.
        manifest: its manifest.
        kind: ``DELTA`` (deltas merged into the last prepared tables) or ``FULL``.
        tables: every table, whole.
        dense: the checkpoint's dense network (state dict).
    """

    checkpoint: Path
    manifest: dict[str, Any]
    kind: UpdateKind
    tables: dict[str, PreparedTable]
    dense: dict[str, torch.Tensor]


class Preparer:
    """Prepares the newest checkpoint of ``run_dir`` (a run's output folder, its
    ``checkpoints`` folder, or a checkpoint folder)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.checkpoint: str | None = None  # the folder name of the tables held
        self.tables: dict[str, PreparedTable] = {}

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
        return self._keep(checkpoint, manifest, UpdateKind.FULL, tables, links[-1])

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
        if decision.kind is UpdateKind.DELTA and self.tables:
            links = [self._read(latest, manifest, name) for name in decision.links]
            try:
                tables = _merge(self.tables, links, strict=True)
            except ValueError:  # the tables held are not at the delta's base
                return self.load(latest)
            return self._keep(latest, manifest, UpdateKind.DELTA, tables, links[-1])
        return self.load(latest)

    def _read(self, latest: Path, manifest: dict[str, Any], name: str) -> Link:
        return read_link(
            latest.parent / name,
            manifest if name == latest.name else None,
            table_keys=serving_key,
        )

    def _keep(
        self,
        checkpoint: Path,
        manifest: dict[str, Any],
        kind: UpdateKind,
        tables: dict[str, PreparedTable],
        last: Link,
    ) -> Prepared:
        self.checkpoint, self.tables = checkpoint.name, tables
        return Prepared(checkpoint, manifest, kind, tables, last.dense)


def _merge(
    tables: Mapping[str, PreparedTable], links: list[Link], *, strict: bool = False
) -> dict[str, PreparedTable]:
    """``tables`` with each link's deltas merged, in order (new tables; ``tables``
    unchanged). A delta that does not apply raises ``ValueError`` with ``strict``,
    else ``CheckpointError`` naming its file."""
    out = dict(tables)
    for link in links:
        for name, delta in link.tables.items():
            if name not in out:
                raise CheckpointError(f"{table_file(link.path, name)}: no table {name!r} before")
            try:
                out[name] = out[name].apply(delta)
            except ValueError as exc:
                if strict:
                    raise
                raise CheckpointError(f"{table_file(link.path, name)}: {exc}") from exc
    return out
