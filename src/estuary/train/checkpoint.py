"""Atomic, code-free checkpoints: safetensors files + a JSON manifest; full or delta.

Layout of one checkpoint (a folder)::

    step-000123/
        manifest.json          format, kind, chain, step, job spec, every file's size + sha256
        dense.safetensors      model.state_dict()
        optimizer.safetensors  dense optimizer tensors (its scalars are in the manifest)
        tables/<name>.safetensors   one per embedding table (ids, rows, optimizer state)

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
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors.numpy import load_file as load_numpy
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import load_file as load_torch
from safetensors.torch import save_file as save_torch

from estuary.embedding.delta import BASE, LINEAGE, VERSION

FORMAT = "estuary-checkpoint"
FORMAT_VERSION = 2  # 2 added kind/parent/chain (deltas); 1 (full only) still loads
READABLE_VERSIONS = (1, 2)
LATEST = "latest"
MANIFEST = "manifest.json"

State = dict[str, np.ndarray]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial or corrupt; the message names the file."""


class CheckpointKind(StrEnum):
    """What a checkpoint's table files hold."""

    FULL = "full"  # every row: loads on its own
    DELTA = "delta"  # changes since ``parent``: loads after its chain


class RestorableTable(Protocol):
    """A table a checkpoint can restore (``EmbeddingTable``, ``RemoteTable``)."""

    def load_state_dict(self, state: State) -> None: ...

    def apply_delta(self, delta: State) -> None: ...


@dataclass(frozen=True)
class ChainLink:
    """A written or loaded checkpoint, as the parent of the next delta.

    Args:
        path: the checkpoint folder.
        chain: folder names from the chain's full checkpoint to this one.
        versions: table -> (lineage, version) of its state here (only tables
            whose state carried ``delta.lineage``/``delta.version``).
    """

    path: Path
    chain: tuple[str, ...]
    versions: dict[str, tuple[int, int]]

    @classmethod
    def from_manifest(cls, path: Path, manifest: Mapping[str, Any]) -> ChainLink:
        """The link of the checkpoint in ``path`` with this (parsed) manifest."""
        versions = {
            name: (int(v["lineage"]), int(v["version"]))
            for name, v in manifest.get("table_versions", {}).items()
        }
        return cls(path, tuple(_chain_of(path, manifest)), versions)

    def accepts(self, deltas: Mapping[str, Mapping[str, np.ndarray]]) -> bool:
        """Whether ``deltas`` (table -> ``delta_state_dict()``) apply on top of this
        checkpoint: same tables, each taken against the version saved here. False
        when something marked a table in between (an extra ``state_dict()``, a
        failed write), so the caller writes a full checkpoint instead."""
        if set(deltas) != set(self.versions):
            return False
        return all(
            BASE in d
            and LINEAGE in d
            and (int(d[LINEAGE][0]), int(d[BASE][0])) == self.versions[name]
            for name, d in deltas.items()
        )


@dataclass(frozen=True)
class CheckpointPlan:
    """What the next checkpoint is (``plan_checkpoint``'s decision).

    Args:
        kind: full or delta.
        parent: the checkpoint a delta is taken against (``None`` for full).
        reason: why, for logs.
    """

    kind: CheckpointKind
    parent: ChainLink | None = None
    reason: str = ""


def checkpoint_name(step: int) -> str:
    """The folder name of the checkpoint at ``step``."""
    return f"step-{step:09d}"


def plan_checkpoint(
    last: ChainLink | None, *, root: Path, step: int, full_every: int
) -> CheckpointPlan:
    """Full or delta: a delta of ``last`` (the checkpoint the tables were last
    saved to or restored from) while its chain is shorter than ``full_every``,
    it lies in ``root`` with its whole chain, and the new one would not replace it."""
    full = CheckpointKind.FULL
    if full_every <= 1:
        return CheckpointPlan(full, reason="output.checkpoint_full_every is 1")
    if last is None:
        return CheckpointPlan(full, reason="no previous checkpoint of these tables")
    if len(last.chain) >= full_every:
        return CheckpointPlan(full, reason=f"chain reached {full_every} checkpoints")
    if last.path.parent.resolve() != Path(root).resolve():
        return CheckpointPlan(full, reason=f"previous checkpoint is not in {root}")
    if last.path.name == checkpoint_name(step):
        return CheckpointPlan(full, reason="it would replace its own parent")
    if not all((last.path.parent / name / MANIFEST).is_file() for name in last.chain):
        return CheckpointPlan(full, reason="part of the previous chain was deleted")
    return CheckpointPlan(CheckpointKind.DELTA, last, "")


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
        return _kind_of(self.manifest)

    @property
    def link(self) -> ChainLink:
        """This checkpoint as the parent of the next delta."""
        return ChainLink.from_manifest(self.path, self.manifest)

    def restore_tables(self, tables: Mapping[str, RestorableTable]) -> None:
        """Load each table's state: the full link, then every delta in order.
        Works for any shard count (tables reshard by id while loading)."""
        for name, table in tables.items():
            table.load_state_dict(self.base_tables[name])
            for folder, delta in zip(self.chain[1:], self.deltas, strict=True):
                try:
                    table.apply_delta(delta[name])
                except ValueError as exc:
                    raise CheckpointError(f"{_table_file(folder, name)}: {exc}") from exc


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


def _table_file(folder: Path, name: str) -> Path:
    return folder / "tables" / f"{name}.safetensors"


def _kind_of(manifest: Mapping[str, Any]) -> CheckpointKind:
    return CheckpointKind(manifest.get("kind", CheckpointKind.FULL.value))


def _chain_of(folder: Path, manifest: Mapping[str, Any]) -> list[str]:
    chain = manifest.get("chain", [folder.name])  # version 1: always full
    if not isinstance(chain, list) or not chain or not all(isinstance(n, str) for n in chain):
        raise CheckpointError(f"{folder / MANIFEST}: 'chain' must be a non-empty list of names")
    return chain


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
) -> Path:
    """Write a checkpoint under ``root`` atomically; returns its folder.

    ``tables`` maps table name -> the table's ``state_dict()`` (a full checkpoint)
    or, with ``parent``, its ``delta_state_dict()`` taken since ``parent`` was
    written or loaded (a delta; ``ValueError`` otherwise). ``metadata`` (job
    spec, data progress, metrics) goes into the manifest and must be JSON-able.
    """
    root.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(step)
    if parent is not None:
        if parent.path.parent.resolve() != root.resolve() or name == parent.path.name:
            raise ValueError(
                f"a delta's parent must be another checkpoint in {root}: {parent.path}"
            )
        if not parent.accepts(tables):
            raise ValueError(f"tables: not delta_state_dict()s taken against {parent.path}")
    versions = _table_versions(tables)
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
        path = _table_file(tmp, table_name)
        save_numpy({k: np.ascontiguousarray(v) for k, v in table_state.items()}, str(path))
        files.append(path)

    kind = CheckpointKind.FULL if parent is None else CheckpointKind.DELTA
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "kind": kind.value,
        "parent": None if parent is None else parent.path.name,
        "chain": [name] if parent is None else [*parent.chain, name],
        "step": step,
        "tables": sorted(tables),
        "table_versions": versions,
        "optimizer": optimizer_meta,
        "metadata": dict(metadata or {}),
        "files": {
            str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
            for p in files
        },
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    for p in [*files, tmp / MANIFEST]:
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
        if (candidate / MANIFEST).is_file():
            return candidate
        latest = candidate / LATEST
        if latest.is_file():
            return candidate / latest.read_text().strip()
    raise CheckpointError(f"{path}: no checkpoint here (no {MANIFEST} and no '{LATEST}' file)")


def list_checkpoints(root: Path) -> list[Path]:
    """Complete-looking checkpoint folders under ``root``, oldest first."""
    if not root.is_dir():
        return []
    return sorted(
        p
        for p in root.iterdir()
        if p.is_dir() and ".tmp-" not in p.name and p.name.startswith("step-")
    )


def prune_checkpoints(root: Path, *, keep: int, newest: Path | None = None) -> list[Path]:
    """Delete old checkpoints: all but the ``keep`` newest (and ``newest``), except
    the full checkpoints and deltas a kept one is built on; also the partial
    ``*.tmp-*`` folders of killed writers. Returns the folders deleted.

    A kept checkpoint whose manifest cannot be read may depend on anything: then
    no complete checkpoint is deleted.
    """
    folders = list_checkpoints(root)
    kept = {*folders[-keep:], *([newest] if newest is not None else [])} if keep > 0 else set()
    needed = {p.name for p in kept}
    for folder in kept:
        try:
            needed.update(_chain_of(folder, _read_manifest(folder)))
        except CheckpointError:
            needed.update(p.name for p in folders)
    gone = [p for p in folders if p.name not in needed]
    for old in gone:
        shutil.rmtree(old, ignore_errors=True)
    for partial in root.glob("step-*.tmp-*"):  # left by a run killed mid-write
        shutil.rmtree(partial, ignore_errors=True)
    return gone


def _read_manifest(folder: Path) -> dict[str, Any]:
    manifest_path = folder / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{manifest_path}: missing (partial checkpoint?)") from exc
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{manifest_path}: not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path}: not an {FORMAT} manifest")
    if manifest.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{manifest_path}: format version {manifest.get('version')} is not supported "
            f"(this Estuary reads {', '.join(map(str, READABLE_VERSIONS))})"
        )
    missing = [k for k in ("step", "tables", "files") if k not in manifest]
    if missing:
        raise CheckpointError(f"{manifest_path}: no {', '.join(missing)} (partial checkpoint?)")
    try:
        _kind_of(manifest)
    except ValueError as exc:
        raise CheckpointError(f"{manifest_path}: unknown kind {manifest.get('kind')!r}") from exc
    return manifest


def read_link(folder: Path) -> ChainLink:
    """The checkpoint in ``folder`` as the parent of the next delta (reads only
    its manifest; ``load_checkpoint`` verifies the files)."""
    return ChainLink.from_manifest(folder, _read_manifest(folder))


def _verify_files(folder: Path, manifest: Mapping[str, Any]) -> None:
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
    chain = _chain_of(child, manifest)
    if _chain_of(parent, parent_manifest) != chain[:-1]:
        raise CheckpointError(
            f"{parent / MANIFEST}: chain {_chain_of(parent, parent_manifest)} is not the "
            f"start of {child.name}'s {chain} (was {parent.name} rewritten?)"
        )
    if sorted(parent_manifest["tables"]) != sorted(manifest["tables"]):
        raise CheckpointError(f"{child / MANIFEST}: tables differ from its parent's")
    have = parent_manifest.get("table_versions", {})
    for name, info in manifest.get("table_versions", {}).items():
        saved = have.get(name, {})
        if (info.get("lineage"), info.get("base")) != (saved.get("lineage"), saved.get("version")):
            raise CheckpointError(
                f"{_table_file(child, name)}: a delta on version {info.get('base')} of chain "
                f"{info.get('lineage')}, but {parent.name} saved version {saved.get('version')} "
                f"of chain {saved.get('lineage')} (was {parent.name} rewritten?)"
            )


def _read_tensors(file: Path) -> State:
    try:
        return load_numpy(str(file))
    except (OSError, ValueError, RuntimeError) as exc:  # safetensors header errors
        raise CheckpointError(f"{file}: unreadable tensor file ({exc})") from exc


def _load_tables(folder: Path, names: list[str]) -> dict[str, State]:
    return {name: _read_tensors(_table_file(folder, name)) for name in names}


def load_checkpoint(path: Path) -> Checkpoint:
    """Load and verify a checkpoint (see ``resolve_checkpoint`` for ``path``);
    for a delta, its whole chain. Raises ``CheckpointError`` naming the first
    missing, partial or corrupt file before any state is returned."""
    folder = resolve_checkpoint(path)
    manifest = _read_manifest(folder)
    _verify_files(folder, manifest)
    links = [(folder, manifest)]  # target first, walking back to the full one
    while _kind_of(links[-1][1]) is CheckpointKind.DELTA:
        child, child_manifest = links[-1]
        if len(_chain_of(child, child_manifest)) < 2:
            raise CheckpointError(f"{child / MANIFEST}: a delta whose chain has no parent")
        parent = _parent_of(child, child_manifest)
        parent_manifest = _read_manifest(parent)
        _check_link(parent, parent_manifest, child, child_manifest)
        _verify_files(parent, parent_manifest)
        links.append((parent, parent_manifest))
    links.reverse()  # full first
    try:
        dense = load_torch(str(folder / "dense.safetensors"))
        optimizer = None
        if manifest.get("optimizer") is not None:
            optimizer = _optimizer_from_flat(
                load_torch(str(folder / "optimizer.safetensors")), manifest["optimizer"]
            )
    except (OSError, ValueError, RuntimeError) as exc:  # safetensors header errors
        raise CheckpointError(f"{folder}: unreadable dense tensor file ({exc})") from exc
    base_folder, base_manifest = links[0]
    tables = _load_tables(base_folder, base_manifest["tables"])
    deltas = [_load_tables(f, m["tables"]) for f, m in links[1:]]
    chain = [f for f, _ in links]
    return Checkpoint(folder, manifest, dense, optimizer, tables, chain, deltas)
