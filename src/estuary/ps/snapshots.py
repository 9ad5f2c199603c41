"""Client side of asynchronous checkpoints: snapshot tables held by parameter
servers at one step, then let every server write its own part of the files.

::

    snap = ServerSnapshot(tables, delta=True, paths=...)
                                                every server captures its tables
                                                right after the step each part last
                                                pushed is applied (the caller does
                                                not wait for it), then writes its
                                                parts to ``paths`` (or later:
                                                ``snap.write(paths)``)
    ...training goes on...
    files, chains = snap.wait()                 table -> {path: {bytes, sha256}};
                                                table -> its merged chain keys

A table split across P servers (``ShardedTable``) gets P part files; one on one
server (``RemoteTable``) one file, as a table a trainer writes itself. Should one
server's part of a delta be full (``delta.full``: it evicted more ids than it
holds rows) and another's not, the parts cannot be merged into one delta:
``wait`` raises ``MixedSnapshotError`` (the caller writes its next checkpoint
full; blocking checkpoints take the others' whole states instead).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from estuary.embedding.delta import BASE, FULL, LINEAGE, VERSION
from estuary.ps.client import PSClient, RemoteTable
from estuary.ps.sharded import ShardedTable, routing_metadata
from estuary.ps.types import PSError

__all__ = ["MixedSnapshotError", "ServerSnapshot", "held_by_servers"]

_KEYS = {"lineage": LINEAGE, "version": VERSION, "base": BASE, "full": FULL}
Held = list[tuple[str, int, RemoteTable]]  # (table, part index, the part) on one server


class MixedSnapshotError(PSError):
    """A table's parts disagree on being full deltas (or on their chain version)."""


def held_by_servers(table: object) -> bool:
    """Whether ``table`` lives on parameter servers (its snapshot can be taken there)."""
    return isinstance(table, RemoteTable | ShardedTable)


def _parts(table: RemoteTable | ShardedTable) -> list[RemoteTable]:
    return list(table.parts) if isinstance(table, ShardedTable) else [table]


class ServerSnapshot:
    """Tables held by parameter servers, snapshotted at one step.

    Args:
        tables: name -> ``RemoteTable`` / ``ShardedTable``; each part is captured
            at the last step it pushed (``pushed``).
        delta: take deltas (rows changed since the last mark) instead of states.
        paths: ``paths(name, parts)``: where the parts of table ``name`` go, in
            part order; the servers write them once captured (else ``write``).

    ``parts``: per table, how many servers hold (and will write) a part of it;
    ``routing``: the servers' slot map at the capture (``routing_metadata``).
    """

    def __init__(
        self,
        tables: Mapping[str, RemoteTable | ShardedTable],
        *,
        delta: bool,
        paths: Callable[[str, int], list[Path]] | None = None,
    ) -> None:
        self._tokens: dict[int, int] = {}
        self._owner: dict[str, str] = {}
        # Registered on every server at one slot map (no migration between):
        # a step's captures then all come before a migration or all after.
        # The parts are read under the holds: a split may have added a server.
        sharded = [t.client for t in tables.values() if isinstance(t, ShardedTable)]
        with contextlib.ExitStack() as holds:
            for client in {id(c): c for c in sharded}.values():
                holds.enter_context(client.holding())
            self._register(tables, delta, paths)
            # The map the parts were captured at (a checkpoint's ``ps_routing``).
            self.routing = routing_metadata(tables.values())

    def _register(
        self,
        tables: Mapping[str, RemoteTable | ShardedTable],
        delta: bool,
        paths: Callable[[str, int], list[Path]] | None,
    ) -> None:
        self.parts = {name: len(_parts(t)) for name, t in tables.items()}
        self._servers: dict[int, tuple[PSClient, Held]] = {}
        for name, table in tables.items():
            for index, part in enumerate(_parts(table)):
                entry = self._servers.setdefault(id(part.client), (part.client, []))
                entry[1].append((name, index, part))
        self._pool = ThreadPoolExecutor(len(self._servers) or 1, thread_name_prefix="estuary-snap")
        where = self._where(paths) if paths is not None else None

        def ask(client: PSClient, held: Held) -> Any:
            fields: dict[str, Any] = {
                "tables": [name for name, _, _ in held],
                "at": [part.pushed for _, _, part in held],
                "delta": delta,
            }
            if where is not None:
                fields["files"] = {name: str(where[name][index]) for name, index, _ in held}
            return client.call("snapshot", fields)[0]

        replies = self._each(ask)
        self._tokens = {key: int(reply["token"]) for key, reply in replies.items()}

    def _each(self, fn: Callable[[PSClient, Held], Any]) -> dict[int, Any]:
        futures = {
            key: self._pool.submit(fn, client, held)
            for key, (client, held) in self._servers.items()
        }
        return {key: f.result() for key, f in futures.items()}

    def _where(self, paths: Callable[[str, int], list[Path]]) -> dict[str, list[Path]]:
        where = {name: paths(name, count) for name, count in self.parts.items()}
        self._owner = {str(path): name for name, listed in where.items() for path in listed}
        return where

    def write(self, paths: Callable[[str, int], list[Path]]) -> None:
        """Have every server write its parts once captured: ``paths(name, parts)``
        lists where the parts of table ``name`` go, in part order (or pass
        ``paths`` to the constructor: one request instead of two)."""
        where = self._where(paths)
        self._each(
            lambda client, held: client.call(
                "snapshot_write",
                {
                    "token": self._tokens[id(client)],
                    "files": {name: str(where[name][index]) for name, index, _ in held},
                },
            )
        )

    def wait(self) -> tuple[dict[str, dict[str, dict[str, Any]]], dict[str, dict[str, Any]]]:
        """Block until every server wrote its parts. Returns per table its files
        (path -> ``bytes``, ``sha256``) and its chain keys (server 0's part's, as
        int64 (1,) arrays: ``delta.lineage``, ``delta.version``, ...).

        Raises:
            MixedSnapshotError: a table's parts are not all full deltas or all not,
                or are at different chain versions.
        """
        replies = self._each(
            lambda client, held: client.call("snapshot_wait", {"token": self._tokens[id(client)]})[
                0
            ]
        )
        self._pool.shutdown(wait=False)
        files: dict[str, dict[str, dict[str, Any]]] = {name: {} for name in self.parts}
        per_part: dict[str, dict[int, dict[str, int]]] = {}
        for key, reply in replies.items():
            for path, info in reply["files"].items():
                files[self._owner[path]][path] = dict(info)
            for name, index, _ in self._servers[key][1]:
                per_part.setdefault(name, {})[index] = dict(reply["chains"][name])
        chains: dict[str, dict[str, Any]] = {}
        for name, by_index in per_part.items():
            kinds = {(c["version"], c.get("full", 0)) for c in by_index.values()}
            if len(kinds) > 1:
                raise MixedSnapshotError(
                    f"table {name!r}: its parts are (chain version, full) {sorted(kinds)}: "
                    "they do not merge into one checkpoint"
                )
            chains[name] = {_KEYS[k]: np.array([v], np.int64) for k, v in by_index[0].items()}
        return files, chains

    def drop(self) -> None:
        """Forget the snapshot on every server (a checkpoint that will not be written)."""
        for key, (client, _) in self._servers.items():
            token = self._tokens.get(key)
            if token is not None:
                with contextlib.suppress(PSError):  # a server gone: nothing held any more
                    client.call("snapshot_drop", {"token": token})
        self._pool.shutdown(wait=False)
