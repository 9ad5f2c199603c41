"""Client side of asynchronous checkpoints: snapshot tables held by parameter
servers at one step, then let every server write its own part of the files.

::

    snap = ServerSnapshot(tables, delta=True)    every server copies its tables (the
                                                 only stall); chains: per table, the
                                                 merged chain keys (server 0's)
    snap.write(paths)                            each server writes its parts
    ...training goes on...
    files = snap.wait()                          table -> {path: {bytes, sha256}}

A table split across P servers (``ShardedTable``) gets P part files; one on one
server (``RemoteTable``) one file, as a table a trainer writes itself. Should one
server's part of a delta have to be full (``delta.full``: it evicted more ids
than it holds rows) and another's not, the others are asked for their whole
state too (unmarked), so every part of the table is full and the merged table
loads as a full delta.
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
from estuary.ps.sharded import ShardedTable
from estuary.ps.types import PSError

__all__ = ["ServerSnapshot", "held_by_servers"]

_KEYS = {"lineage": LINEAGE, "version": VERSION, "base": BASE, "full": FULL}


def held_by_servers(table: object) -> bool:
    """Whether ``table`` lives on parameter servers (its snapshot can be taken there)."""
    return isinstance(table, RemoteTable | ShardedTable)


def _parts(table: RemoteTable | ShardedTable) -> list[RemoteTable]:
    return list(table.parts) if isinstance(table, ShardedTable) else [table]


class ServerSnapshot:
    """Tables held by parameter servers, snapshotted at one step.

    Args:
        tables: name -> ``RemoteTable`` / ``ShardedTable`` (every step they pushed
            is applied first).
        delta: take deltas (rows changed since the last mark) instead of states.

    Attributes:
        chains: per table its chain keys (``delta.lineage``, ``delta.version``, and
            for a delta ``delta.base``, ``delta.full``) as int64 (1,) arrays.
        parts: per table, how many servers hold (and will write) a part of it.
    """

    def __init__(self, tables: Mapping[str, RemoteTable | ShardedTable], *, delta: bool) -> None:
        self.parts = {name: len(_parts(t)) for name, t in tables.items()}
        # Per server (its client): the tables' parts it holds, by name, and part index.
        self._servers: dict[int, tuple[PSClient, list[tuple[str, int, RemoteTable]]]] = {}
        for name, table in tables.items():
            for index, part in enumerate(_parts(table)):
                entry = self._servers.setdefault(id(part.client), (part.client, []))
                entry[1].append((name, index, part))
        self._tokens: dict[int, int] = {}
        self._owner: dict[str, str] = {}
        self._pool = ThreadPoolExecutor(
            max(1, len(self._servers)), thread_name_prefix="estuary-snap"
        )
        replies = self._each(
            lambda client, held: client.call(
                "snapshot",
                {
                    "tables": [name for name, _, _ in held],
                    "after": [part.pushed for _, _, part in held],
                    "delta": delta,
                },
            )[0]
        )
        per_part: dict[str, dict[int, dict[str, int]]] = {}
        for key, reply in replies.items():
            self._tokens[key] = int(reply["token"])
            for name, index, _ in self._servers[key][1]:
                per_part.setdefault(name, {})[index] = dict(reply["chains"][name])
        self._upgrade_mixed(per_part)
        self.chains: dict[str, dict[str, np.ndarray]] = {}
        for name, by_index in per_part.items():
            versions = {c["version"] for c in by_index.values()}
            if len(versions) > 1:
                self.drop()
                raise PSError(
                    f"table {name!r}: its servers' checkpoint chains are at versions "
                    f"{sorted(versions)}; they advance together unless a server was replaced"
                )
            self.chains[name] = {_KEYS[k]: np.array([v], np.int64) for k, v in by_index[0].items()}

    def _each(self, fn: Callable[[PSClient, list[tuple[str, int, RemoteTable]]], Any]) -> dict:
        futures = {
            key: self._pool.submit(fn, client, held)
            for key, (client, held) in self._servers.items()
        }
        return {key: f.result() for key, f in futures.items()}

    def _upgrade_mixed(self, per_part: dict[str, dict[int, dict[str, int]]]) -> None:
        """Tables whose parts are partly full deltas: make every part full."""
        mixed = {
            name
            for name, by_index in per_part.items()
            if len({c.get("full", 0) for c in by_index.values()}) > 1
        }
        if not mixed:
            return

        def upgrade(client: PSClient, held: list[tuple[str, int, RemoteTable]]) -> None:
            names = [n for n, i, _ in held if n in mixed and not per_part[n][i].get("full")]
            if names:
                token = self._tokens[id(client)]
                client.call("snapshot_full", {"token": token, "tables": names})

        self._each(upgrade)
        for name in mixed:
            for chain in per_part[name].values():
                chain["full"] = 1

    def write(self, paths: Callable[[str, int], list[Path]]) -> None:
        """Have every server start writing its parts: ``paths(name, parts)`` lists
        where the parts of table ``name`` go, in part order."""
        where = {name: paths(name, count) for name, count in self.parts.items()}
        self._owner = {str(path): name for name, listed in where.items() for path in listed}
        self._each(
            lambda client, held: client.call(
                "snapshot_write",
                {
                    "token": self._tokens[id(client)],
                    "files": {name: str(where[name][index]) for name, index, _ in held},
                },
            )
        )

    def wait(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Block until every server wrote its parts; per table, path -> ``bytes``,
        ``sha256``."""
        replies = self._each(
            lambda client, held: client.call("snapshot_wait", {"token": self._tokens[id(client)]})[
                0
            ]["files"]
        )
        out: dict[str, dict[str, dict[str, Any]]] = {name: {} for name in self.parts}
        for files in replies.values():
            for path, info in files.items():
                out[self._owner[path]][path] = dict(info)
        self._pool.shutdown(wait=False)
        return out

    def drop(self) -> None:
        """Forget the snapshot on every server (a checkpoint that will not be written)."""
        for key, (client, _) in self._servers.items():
            token = self._tokens.get(key)
            if token is not None:
                with contextlib.suppress(PSError):  # a server gone: nothing held any more
                    client.call("snapshot_drop", {"token": token})
        self._pool.shutdown(wait=False)
