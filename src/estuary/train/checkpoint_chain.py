"""Checkpoints on disk and how they chain: manifest format, links, planning, retention.

Does no tensor I/O (imports no torch, no safetensors): ``estuary.train.checkpoint``
writes and loads the files. Chains on disk::

    step-4 (full) <- step-8 (delta) <- step-12 (delta)   step-16 (full) <- ...
    manifest "chain" of step-12: ["step-000000004", "step-000000008", "step-000000012"]

``plan_checkpoint`` decides whether the next checkpoint is full or a delta of the
last one (a ``CheckpointPlan``); ``prune_checkpoints`` deletes old ones but never
a link a kept checkpoint is built on; ``read_manifest`` parses and validates a
manifest, raising ``CheckpointError`` naming the file.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np

from estuary.embedding.delta import BASE, LINEAGE

FORMAT = "estuary-checkpoint"
FORMAT_VERSION = 2  # 2 added kind/parent/chain (deltas); 1 (full only) still loads
READABLE_VERSIONS = (1, 2)
LATEST = "latest"
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial or corrupt; the message names the file."""


class CheckpointWarning(UserWarning):
    """A restore that works but does not carry everything over (an optimizer
    changed since the checkpoint was written: its state starts fresh)."""


class CheckpointKind(StrEnum):
    """What a checkpoint's table files hold."""

    FULL = "full"  # every row: loads on its own
    DELTA = "delta"  # changes since ``parent``: loads after its chain


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
        return cls(path, tuple(chain_of(path, manifest)), versions)

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
    """The folder name of the checkpoint at ``step`` (a second checkpoint of the
    same step, which replaces the first, gets ``-2``, ``-3``, ... appended)."""
    return f"step-{step:09d}"


def checkpoint_order(name: str) -> tuple[int, int]:
    """(step, save) of a checkpoint folder name: ``step-000000123`` is (123, 1),
    ``step-000000123-2`` (123, 2); (-1, 0) for a name of another form."""
    parts = name.split("-")
    if len(parts) in (2, 3) and parts[0] == "step" and all(p.isdigit() for p in parts[1:]):
        return int(parts[1]), int(parts[2]) if len(parts) == 3 else 1
    return -1, 0


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
    if checkpoint_order(last.path.name)[0] == step:
        return CheckpointPlan(full, reason="it would replace its own parent")
    if not all((last.path.parent / name / MANIFEST).is_file() for name in last.chain):
        return CheckpointPlan(full, reason="part of the previous chain was deleted")
    return CheckpointPlan(CheckpointKind.DELTA, last, "")


def table_file(folder: Path, name: str) -> Path:
    """Where table ``name``'s tensors lie in the checkpoint ``folder``."""
    return folder / "tables" / f"{name}.safetensors"


def kind_of(manifest: Mapping[str, Any]) -> CheckpointKind:
    """Full or delta (a version 1 manifest has no ``kind``: full)."""
    return CheckpointKind(manifest.get("kind", CheckpointKind.FULL.value))


def chain_of(folder: Path, manifest: Mapping[str, Any]) -> list[str]:
    """Folder names from the chain's full checkpoint to ``folder`` (its manifest's
    ``chain``); ``CheckpointError`` when malformed."""
    chain = manifest.get("chain", [folder.name])  # version 1: always full
    if not isinstance(chain, list) or not chain or not all(isinstance(n, str) for n in chain):
        raise CheckpointError(f"{folder / MANIFEST}: 'chain' must be a non-empty list of names")
    return chain


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
    """Complete-looking checkpoint folders under ``root``, oldest first (by step,
    then by save of the step)."""
    if not root.is_dir():
        return []
    return sorted(
        (
            p
            for p in root.iterdir()
            if p.is_dir() and ".tmp-" not in p.name and p.name.startswith("step-")
        ),
        key=lambda p: (*checkpoint_order(p.name), p.name),
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
            needed.update(chain_of(folder, read_manifest(folder)))
        except CheckpointError:
            needed.update(p.name for p in folders)
    gone = [p for p in folders if p.name not in needed]
    for old in gone:
        shutil.rmtree(old, ignore_errors=True)
    for partial in root.glob("step-*.tmp-*"):  # left by a run killed mid-write
        shutil.rmtree(partial, ignore_errors=True)
    return gone


def read_manifest(folder: Path) -> dict[str, Any]:
    """The parsed manifest of the checkpoint in ``folder``, checked for format,
    version, kind and required keys (not the files: ``load_checkpoint`` does)."""
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
        kind_of(manifest)
    except ValueError as exc:
        raise CheckpointError(f"{manifest_path}: unknown kind {manifest.get('kind')!r}") from exc
    return manifest


def read_link(folder: Path) -> ChainLink:
    """The checkpoint in ``folder`` as the parent of the next delta (reads only
    its manifest; ``load_checkpoint`` verifies the files)."""
    return ChainLink.from_manifest(folder, read_manifest(folder))
