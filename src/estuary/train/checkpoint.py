"""Atomic, code-free checkpoints: safetensors files + a JSON manifest; full or delta.

Layout of one checkpoint (a folder)::

    step-000123/
        manifest.json          format, kind, chain, step, job spec, every file's size + sha256
        dense.safetensors      model.state_dict()
        optimizer.safetensors  dense optimizer tensors (its scalars are in the manifest)
        tables/<name>.safetensors   one per embedding table (ids, rows, optimizer state)
        tables/<name>.part-<p>.safetensors   or P parts, one per parameter server that
                               wrote its own (manifest ``table_parts``: name -> P;
                               loading merges them, ``merge_server_parts``)
        extra/<name>.safetensors    other training state (manifest ``extras``), e.g. a
                               mixture's ``history_ids``, progressive evaluation's
                               figures (``progressive``): ``Checkpoint.extra(name)``

A *full* checkpoint holds every table row (``state_dict``). A *delta* holds, per
table, only the rows changed and the ids evicted since its parent checkpoint
(``delta_state_dict``, layout in ``estuary.embedding.delta``); the dense model
and optimizer, being small, are always whole. Chains on disk::

    step-4 (full) <- step-8 (delta) <- step-12 (delta)   step-16 (full) <- ...
    manifest "chain" of step-12: ["step-000000004", "step-000000008", "step-000000012"]

Each delta's manifest names its ``parent`` and records, per table, the chain
version it applies on (``base``) and leaves (``version``); loading walks back to
the full one, verifies every link (sizes, checksums, versions) before anything
is restored, then replays full -> delta1 -> ... -> target.

It is written as ``step-000123.tmp-<pid>``, every file fsynced, then renamed into
place; ``latest`` (a one-line text file, itself replaced atomically) names the
newest complete checkpoint. Loading never runs code (no pickle): a corrupt,
partial or missing link raises ``CheckpointError`` naming the file, and every
checkpoint not built on it still loads.

This module writes and loads the files; ``estuary.train.checkpoint_chain`` holds
the manifest format, chain links, full-vs-delta planning, finding and pruning.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from safetensors.torch import load_file as load_torch
from safetensors.torch import save_file as save_torch

from estuary.embedding.delta import BASE, LINEAGE, VERSION, merge_server_parts
from estuary.embedding.files import read_state, write_state
from estuary.train.checkpoint_chain import (
    FORMAT,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    ChainLink,
    CheckpointError,
    CheckpointKind,
    CheckpointWarning,
    chain_of,
    checkpoint_name,
    checkpoint_order,
    kind_of,
    list_checkpoints,
    read_manifest,
    resolve_checkpoint,
    table_file,
)
from estuary.train.checkpoint_io import fsync as _fsync_dir
from estuary.train.checkpoint_io import fsync as _fsync_file
from estuary.train.checkpoint_io import optimizer_from_flat as _optimizer_from_flat
from estuary.train.checkpoint_io import optimizer_to_flat as _optimizer_to_flat
from estuary.train.checkpoint_io import sha256 as _sha256

if TYPE_CHECKING:
    from estuary.config import JobSpec

State = dict[str, np.ndarray]


class RestorableTable(Protocol):
    """A table a checkpoint can restore (``EmbeddingTable``, ``RemoteTable``)."""

    def load_state_dict(self, state: State) -> None: ...

    def apply_delta(self, delta: State) -> None: ...


@dataclass
class Checkpoint:
    """A loaded checkpoint.

    Args:
        path: the checkpoint folder.
        manifest: the parsed manifest (step, job spec, metadata).
        dense: model state dict.
        optimizer: dense optimizer state dict (for ``optimizer.load_state_dict``).
        base_tables: table name -> flat numpy state of the chain's full
            checkpoint (this one's own tables when it is full).
        chain: the checkpoint folders from the full one to ``path``.
        deltas: per delta link of ``chain`` (oldest first): table -> delta.

    ``tables`` is this checkpoint's state of every table (a delta's chain
    replayed); ``restore_tables`` loads it straight into live tables instead.
    """

    path: Path
    manifest: dict[str, Any]
    dense: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    base_tables: dict[str, State]
    chain: list[Path] = field(default_factory=list)
    deltas: list[dict[str, State]] = field(default_factory=list)

    def extra(self, name: str) -> dict[str, torch.Tensor] | None:
        """The tensors of extra state ``name`` (``StagedCheckpoint.write_extra``;
        verified with the other files), ``None`` when this checkpoint has none."""
        if name not in self.manifest.get("extras", []):
            return None
        return read_extra(self.path, name)

    @functools.cached_property
    def tables(self) -> dict[str, State]:
        """Table name -> flat numpy state at this checkpoint (for
        ``load_state_dict``, serving or inspection). For a delta the chain is
        replayed into a scratch table built from the job stored in the manifest."""
        if not self.deltas:
            return self.base_tables
        from estuary.config import job_from_dict
        from estuary.embedding import EmbeddingTable

        job_data = self.manifest.get("metadata", {}).get("job")
        if job_data is None:
            raise CheckpointError(
                f"{self.path / MANIFEST}: a delta checkpoint without its job in the metadata; "
                "load it into tables with restore_tables()"
            )
        job = job_from_dict(job_data)
        states = {}
        for name in self.base_tables:
            scratch = EmbeddingTable(job.table_spec(name), seed=0, name=name)
            self.restore_tables({name: scratch})
            states[name] = scratch.state_dict()
        return states

    @property
    def kind(self) -> CheckpointKind:
        """Full or delta (a version 1 checkpoint is full)."""
        return kind_of(self.manifest)

    @property
    def link(self) -> ChainLink:
        """This checkpoint as the parent of the next delta."""
        return ChainLink.from_manifest(self.path, self.manifest)

    def optimizer_changes(self, job: JobSpec) -> tuple[str | None, list[str]]:
        """What restoring into ``job`` cannot carry over, as messages: the dense
        optimizer when its name changed (else None), and one message per change of
        sparse optimizer naming its tables. Compares with the job stored in the
        checkpoint; a checkpoint without one (or whose job no longer loads)
        reports nothing."""
        from estuary.config import ConfigError, job_from_dict

        stored = self.manifest.get("metadata", {}).get("job")
        if stored is None:
            return None, []
        try:
            old = job_from_dict(stored)
        except ConfigError:
            return None, []
        dense = None
        was, now = old.train.dense_optimizer.name, job.train.dense_optimizer.name
        if was != now:
            dense = (
                f"{self.path}: dense optimizer {was} in the checkpoint, {now} in this job; "
                f"its state starts fresh"
            )
        changed: dict[tuple[str, str], list[str]] = {}
        for name in sorted(self.base_tables):
            try:
                table_was = old.table_spec(name).optimizer.name
                table_now = job.table_spec(name).optimizer.name
            except ConfigError:
                continue
            if table_was != table_now:
                changed.setdefault((table_was, table_now), []).append(name)
        tables = [
            f"{self.path}: {len(names)} table(s) ({', '.join(names)}): optimizer {was_} in "
            f"the checkpoint, {now_} in this job; their optimizer state starts fresh"
            for (was_, now_), names in changed.items()
        ]
        return dense, tables

    def restore_dense(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> None:
        """Load the dense model (and the dense optimizer, when the checkpoint has its
        state) into ``model`` / ``optimizer``.

        Raises:
            CheckpointError: the model's parameters differ from the checkpoint's
                (names or shapes, listed), or the optimizer's groups do not match
                (a job changed since the checkpoint was written).
        """
        own = model.state_dict()
        problems = [f"{k}: missing from the checkpoint" for k in own if k not in self.dense]
        problems += [f"{k}: not in this model" for k in self.dense if k not in own]
        problems += [
            f"{k}: shape {list(self.dense[k].shape)} in the checkpoint, "
            f"{list(own[k].shape)} in this model"
            for k in own
            if k in self.dense and self.dense[k].shape != own[k].shape
        ]
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise CheckpointError(
                f"{self.path / 'dense.safetensors'}: the dense model does not match this "
                f"job's model (was model.* changed since?): {'; '.join(problems[:5])}{more}"
            )
        model.load_state_dict(self.dense)
        if optimizer is not None and self.optimizer is not None:
            try:
                optimizer.load_state_dict(self.optimizer)
            except (ValueError, KeyError) as exc:
                raise CheckpointError(
                    f"{self.path / 'optimizer.safetensors'}: the dense optimizer state does "
                    f"not fit this job's optimizer (was train.dense_optimizer changed?): {exc}"
                ) from exc

    def restore_tables(self, tables: Mapping[str, RestorableTable]) -> None:
        """Load each table's state: the full link, then every delta in order.
        Works for any shard count (tables reshard by id while loading).

        Raises:
            CheckpointError: a table is missing from the checkpoint, or its rows do
                not fit the table (another dim), naming the file.
        """
        missing = sorted(set(tables) - set(self.base_tables))
        if missing:
            raise CheckpointError(f"{self.path}: checkpoint has no table for {missing}")
        for name, table in tables.items():
            try:
                table.load_state_dict(self.base_tables[name])
            except ValueError as exc:
                base = self.chain[0] if self.chain else self.path
                raise CheckpointError(f"{table_file(base, name)}: {exc}") from exc
            for folder, delta in zip(self.chain[1:], self.deltas, strict=True):
                try:
                    table.apply_delta(delta[name])
                except ValueError as exc:
                    raise CheckpointError(f"{table_file(folder, name)}: {exc}") from exc


def _table_versions(tables: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, dict[str, int]]:
    """Per table: chain lineage, version (and ``base`` for a delta), for the manifest."""
    out: dict[str, dict[str, int]] = {}
    for name, state in tables.items():
        if LINEAGE in state and VERSION in state:
            out[name] = {"lineage": int(state[LINEAGE][0]), "version": int(state[VERSION][0])}
            if BASE in state:
                out[name]["base"] = int(state[BASE][0])
    return out


def save_checkpoint(
    root: Path,
    *,
    step: int,
    model: torch.nn.Module,
    tables: Mapping[str, Mapping[str, np.ndarray]],
    optimizer: torch.optim.Optimizer | None = None,
    metadata: Mapping[str, Any] | None = None,
    parent: ChainLink | None = None,
    extras: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
) -> Path:
    """Write a checkpoint under ``root`` atomically; returns its folder.

    ``tables`` maps table name -> the table's ``state_dict()`` (a full checkpoint)
    or, with ``parent``, its ``delta_state_dict()`` taken since ``parent`` was
    written or loaded (a delta; ``ValueError`` otherwise). ``metadata`` (job
    spec, data progress, metrics) goes into the manifest and must be JSON-able;
    ``extras``: name -> tensors of other training state (``Checkpoint.extra``).
    """
    if parent is not None and not parent.accepts(tables):
        raise ValueError(f"tables: not delta_state_dict()s taken against {parent.path}")
    staged = stage_checkpoint(root, step=step, parent=parent)
    staged.write_dense(model.state_dict(), None if optimizer is None else optimizer.state_dict())
    staged.write_tables(tables)
    for name, tensors in (extras or {}).items():
        staged.write_extra(name, tensors)
    return staged.commit(versions=_table_versions(tables), metadata=metadata)


def table_part_file(folder: Path, name: str, part: int) -> Path:
    """Where part ``part`` of table ``name`` lies (a table held by several parameter
    servers, each writing its own part: ``manifest["table_parts"][name]`` parts)."""
    return folder / "tables" / f"{name}.part-{part}.safetensors"


def table_versions(chains: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, dict[str, int]]:
    """Per table: chain lineage, version (and ``base`` for a delta), for the manifest,
    from each table's chain keys (``delta.*``)."""
    return _table_versions(chains)


@dataclass
class StagedCheckpoint:
    """A checkpoint being written: files go into a temp folder beside the final
    one (``write_dense``, ``write_tables``, or ``add_files`` for files others
    wrote there, e.g. parameter servers' table parts); ``commit`` writes the
    manifest, flushes and renames it into place, then points ``latest`` at it.

    Made by ``stage_checkpoint``; ``final`` is where it will lie once committed.
    """

    root: Path
    step: int
    name: str
    tmp: Path
    final: Path
    replaced: list[Path]
    parent: ChainLink | None
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    tables: set[str] = field(default_factory=set)
    parts: dict[str, int] = field(default_factory=dict)
    optimizer_meta: dict[str, Any] | None = None
    extras: set[str] = field(default_factory=set)

    def _record(self, path: Path, info: dict[str, Any]) -> None:
        self.files[str(path.relative_to(self.tmp))] = info

    def write_dense(
        self, model_state: Mapping[str, torch.Tensor], optimizer_state: dict[str, Any] | None
    ) -> None:
        """The dense model and (optional) its optimizer's state dict."""
        state = {k: v.detach().contiguous().cpu() for k, v in model_state.items()}
        path = self.tmp / "dense.safetensors"
        save_torch(state, str(path))
        _fsync_file(path)
        self._record(path, {"bytes": path.stat().st_size, "sha256": _sha256(path)})
        if optimizer_state is not None:
            opt_tensors, self.optimizer_meta = _optimizer_to_flat(optimizer_state)
            path = self.tmp / "optimizer.safetensors"
            save_torch(opt_tensors, str(path))
            _fsync_file(path)
            self._record(path, {"bytes": path.stat().st_size, "sha256": _sha256(path)})

    def write_extra(self, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Other training state (``extra/<name>.safetensors``, always whole)."""
        folder = self.tmp / "extra"
        folder.mkdir(exist_ok=True)
        path = folder / f"{name}.safetensors"
        save_torch({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))
        _fsync_file(path)
        self._record(path, {"bytes": path.stat().st_size, "sha256": _sha256(path)})
        self.extras.add(name)

    def write_tables(self, tables: Mapping[str, Mapping[str, np.ndarray]]) -> None:
        """Whole tables (``state_dict`` or ``delta_state_dict`` arrays), one file each."""
        for name, state in tables.items():
            path = table_file(self.tmp, name)
            self._record(path, write_state(path, state))
            self.tables.add(name)

    def part_paths(self, name: str, parts: int) -> list[Path]:
        """Where ``parts`` writers each put their part of table ``name``."""
        if parts == 1:
            return [table_file(self.tmp, name)]
        return [table_part_file(self.tmp, name, p) for p in range(parts)]

    def add_files(self, name: str, parts: int, files: Mapping[str, Mapping[str, Any]]) -> None:
        """Table ``name``'s files written into ``tmp`` by others (``part_paths``):
        absolute path -> ``{"bytes", "sha256"}``."""
        expected = {str(p) for p in self.part_paths(name, parts)}
        if set(files) != expected:
            raise ValueError(
                f"table {name!r}: expected files {sorted(expected)}, got {sorted(files)}"
            )
        for path, info in files.items():
            self._record(Path(path), dict(info))
        self.tables.add(name)
        if parts > 1:
            self.parts[name] = parts

    def commit(
        self,
        *,
        versions: Mapping[str, Mapping[str, int]],
        metadata: Mapping[str, Any] | None = None,
    ) -> Path:
        """Write the manifest, flush, rename into place, point ``latest`` here, drop
        the checkpoint this one replaces (same step); returns the final folder."""
        kind = CheckpointKind.FULL if self.parent is None else CheckpointKind.DELTA
        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "kind": kind.value,
            "parent": None if self.parent is None else self.parent.path.name,
            "chain": [self.name] if self.parent is None else [*self.parent.chain, self.name],
            "step": self.step,
            "tables": sorted(self.tables),
            "table_versions": dict(versions),
            **({"table_parts": dict(sorted(self.parts.items()))} if self.parts else {}),
            "optimizer": self.optimizer_meta,
            **({"extras": sorted(self.extras)} if self.extras else {}),
            "metadata": dict(metadata or {}),
            "files": dict(sorted(self.files.items())),
        }
        root, tmp = self.root, self.tmp
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        _fsync_file(tmp / MANIFEST)
        _fsync_dir(tmp / "tables")
        if self.extras:
            _fsync_dir(tmp / "extra")
        _fsync_dir(tmp)
        os.replace(tmp, self.final)
        _fsync_dir(root)
        latest_tmp = root / f"{LATEST}.tmp-{os.getpid()}"
        latest_tmp.write_text(self.name + "\n")
        _fsync_file(latest_tmp)
        os.replace(latest_tmp, root / LATEST)
        _fsync_dir(root)
        for old in self.replaced:
            if not _needed_by_others(root, old):
                shutil.rmtree(old, ignore_errors=True)
        return self.final

    def abandon(self) -> None:
        """Delete the temp folder (a write that will not be committed)."""
        shutil.rmtree(self.tmp, ignore_errors=True)


def stage_checkpoint(root: Path, *, step: int, parent: ChainLink | None) -> StagedCheckpoint:
    """Start writing the checkpoint of ``step`` under ``root`` (a delta of ``parent``
    when given): names it and makes its temp folder."""
    root.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(step)
    if parent is not None and (
        parent.path.parent.resolve() != root.resolve() or name == parent.path.name
    ):
        raise ValueError(f"a delta's parent must be another checkpoint in {root}: {parent.path}")
    # A checkpoint of a step already saved (a run resumed after its end, or a final
    # save on a mid-run checkpoint's step) goes to a new folder: the old one is
    # deleted only once ``latest`` names the new one, so a crash never leaves
    # ``latest`` without its folder.
    replaced = [f for f in list_checkpoints(root) if checkpoint_order(f.name)[0] == step]
    if replaced:  # the suffix grows with each save of the step (list order = save order)
        name = f"{name}-{max(checkpoint_order(f.name)[1] for f in replaced) + 1}"
    tmp = root / f"{name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / "tables").mkdir(parents=True)
    return StagedCheckpoint(root, step, name, tmp, root / name, replaced, parent)


def _needed_by_others(root: Path, folder: Path) -> bool:
    """Whether another checkpoint under ``root`` is a delta built on ``folder``
    (or may be: a manifest that cannot be read counts as needing it)."""
    for other in list_checkpoints(root):
        if other == folder:
            continue
        try:
            if folder.name in chain_of(other, read_manifest(other)):
                return True
        except CheckpointError:
            return True
    return False


def _verify_files(folder: Path, manifest: Mapping[str, Any], *, tables: bool = True) -> None:
    # ``tables=False``: table files are checked for presence and size only (their
    # checksums cost a read of every byte).
    for rel, info in manifest["files"].items():
        file = folder / rel
        if not file.is_file():
            raise CheckpointError(f"{file}: listed in the manifest but missing")
        if file.stat().st_size != info["bytes"]:
            raise CheckpointError(
                f"{file}: {file.stat().st_size} bytes, manifest says {info['bytes']} (truncated?)"
            )
        if not tables and Path(rel).parts[0] == "tables":
            continue
        if _sha256(file) != info["sha256"]:
            raise CheckpointError(f"{file}: checksum mismatch (corrupt)")


def _parent_of(folder: Path, manifest: Mapping[str, Any]) -> Path:
    name = manifest.get("parent")
    if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
        raise CheckpointError(f"{folder / MANIFEST}: a delta needs a parent folder name")
    parent = folder.parent / name
    if not (parent / MANIFEST).is_file():
        raise CheckpointError(
            f"{parent / MANIFEST}: missing, but {folder.name} is a delta built on it "
            "(deleted, or a partial write?)"
        )
    return parent


def _check_link(
    parent: Path, parent_manifest: Mapping[str, Any], child: Path, manifest: Mapping[str, Any]
) -> None:
    """Raise unless ``child`` is a delta of exactly the state saved in ``parent``."""
    chain = chain_of(child, manifest)
    if chain_of(parent, parent_manifest) != chain[:-1]:
        raise CheckpointError(
            f"{parent / MANIFEST}: chain {chain_of(parent, parent_manifest)} is not the "
            f"start of {child.name}'s {chain} (was {parent.name} rewritten?)"
        )
    if sorted(parent_manifest["tables"]) != sorted(manifest["tables"]):
        raise CheckpointError(f"{child / MANIFEST}: tables differ from its parent's")
    have = parent_manifest.get("table_versions", {})
    for name, info in manifest.get("table_versions", {}).items():
        saved = have.get(name, {})
        if (info.get("lineage"), info.get("base")) != (saved.get("lineage"), saved.get("version")):
            raise CheckpointError(
                f"{table_file(child, name)}: a delta on version {info.get('base')} of chain "
                f"{info.get('lineage')}, but {parent.name} saved version {saved.get('version')} "
                f"of chain {saved.get('lineage')} (was {parent.name} rewritten?)"
            )


def _read_tensors(file: Path) -> State:
    try:
        return read_state(file)
    except (OSError, ValueError, RuntimeError) as exc:  # safetensors header errors
        raise CheckpointError(f"{file}: unreadable tensor file ({exc})") from exc


def read_extra(folder: Path, name: str) -> dict[str, torch.Tensor]:
    """The tensors of extra state ``name`` of the checkpoint in ``folder`` (one
    its manifest lists: ``Checkpoint.extra``).

    Raises:
        CheckpointError: the file is missing or unreadable.
    """
    return _read_dense(folder, f"extra/{name}.safetensors")


def _read_dense(folder: Path, name: str) -> dict[str, torch.Tensor]:
    try:
        return load_torch(str(folder / name))
    except (OSError, ValueError, RuntimeError) as exc:  # safetensors header errors
        raise CheckpointError(f"{folder}: unreadable dense tensor file ({exc})") from exc


def _load_tables(folder: Path, manifest: Mapping[str, Any]) -> dict[str, State]:
    """Every table of the checkpoint in ``folder``; a table written in parts (one per
    parameter server) is merged into one state."""
    parts = manifest.get("table_parts", {})
    out: dict[str, State] = {}
    for name in manifest["tables"]:
        count = int(parts.get(name, 1))
        if count == 1:
            out[name] = _read_tensors(table_file(folder, name))
            continue
        states = [_read_tensors(table_part_file(folder, name, p)) for p in range(count)]
        try:
            out[name] = merge_server_parts(states, name)
        except ValueError as exc:
            raise CheckpointError(f"{table_part_file(folder, name, 0)}: {exc}") from exc
    return out


def load_checkpoint(path: Path, *, tables: bool = True) -> Checkpoint:
    """Load and verify a checkpoint (see ``resolve_checkpoint`` for ``path``);
    for a delta, its whole chain. Raises ``CheckpointError`` naming the first
    missing, partial or corrupt file before any state is returned.

    ``tables=False`` reads the manifest, dense model and optimizer only (a trainer
    whose tables live elsewhere, e.g. rank > 0 of a multi-trainer run): table
    files are checked for presence and size, not read, and ``base_tables`` is
    empty."""
    folder = resolve_checkpoint(path)
    manifest = read_manifest(folder)
    _verify_files(folder, manifest, tables=tables)
    links = [(folder, manifest)]  # target first, walking back to the full one
    while kind_of(links[-1][1]) is CheckpointKind.DELTA:
        child, child_manifest = links[-1]
        if len(chain_of(child, child_manifest)) < 2:
            raise CheckpointError(f"{child / MANIFEST}: a delta whose chain has no parent")
        parent = _parent_of(child, child_manifest)
        parent_manifest = read_manifest(parent)
        _check_link(parent, parent_manifest, child, child_manifest)
        _verify_files(parent, parent_manifest, tables=tables)
        links.append((parent, parent_manifest))
    links.reverse()  # full first
    dense = _read_dense(folder, "dense.safetensors")
    optimizer = None
    if manifest.get("optimizer") is not None:
        flat = _read_dense(folder, "optimizer.safetensors")
        optimizer = _optimizer_from_flat(flat, manifest["optimizer"])
    chain = [f for f, _ in links]
    if not tables:
        return Checkpoint(folder, manifest, dense, optimizer, {}, chain, [])
    base_folder, base_manifest = links[0]
    base = _load_tables(base_folder, base_manifest)
    deltas = [_load_tables(f, m) for f, m in links[1:]]
    return Checkpoint(folder, manifest, dense, optimizer, base, chain, deltas)


@dataclass(frozen=True)
class Link:
    """One checkpoint folder alone, as a follower of a run reads it (``load_link``).

    Args:
        path: the checkpoint folder.
        manifest: its manifest.
        dense: its dense model state dict (always whole).
        tables: its own table files: all rows of a full checkpoint, the changed
            rows of a delta (``delta_state_dict``, to apply on its parent's state).
    """

    path: Path
    manifest: dict[str, Any]
    dense: dict[str, torch.Tensor]
    tables: dict[str, State]

    @property
    def chain(self) -> list[str]:
        """Folder names from the chain's full checkpoint to this one."""
        return chain_of(self.path, self.manifest)


def load_link(folder: Path) -> Link:
    """Read and verify one checkpoint folder's files, without its chain: what a
    reader that already holds the parent's state (a server following a run)
    needs to apply a delta. ``CheckpointError`` names a missing or corrupt file."""
    manifest = read_manifest(folder)
    _verify_files(folder, manifest)
    dense = _read_dense(folder, "dense.safetensors")
    return Link(folder, manifest, dense, _load_tables(folder, manifest))


def restore_dense_warned(
    ckpt: Checkpoint,
    job: JobSpec,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    tables: bool = False,
) -> None:
    """``ckpt.restore_dense`` for a trainer of ``job``: the dense optimizer's state is
    restored only when the job still names the same optimizer (else a
    ``CheckpointWarning``, and it starts fresh with the job's settings). With
    ``tables``, also warns of tables whose sparse optimizer changed (the
    trainer that restores them)."""
    dense, changed_tables = ckpt.optimizer_changes(job)
    for message in [*([dense] if dense else []), *(changed_tables if tables else [])]:
        warnings.warn(message, CheckpointWarning, stacklevel=3)
    ckpt.restore_dense(model, None if dense is not None else optimizer)
