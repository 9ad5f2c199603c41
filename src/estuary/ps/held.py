"""Server side of asynchronous checkpoints: table snapshots a parameter server
holds and writes to files itself (``snapshot`` ops; see ``estuary.ps.snapshots``
for the client side).

::

    snapshot(tables, after, delta)  -> token, chain keys per table
        each table: wait for step ``after``, then under the table's exclusive
        lock copy its rows (``EmbeddingTable.snapshot``: a memcpy of the rows in
        use): training stalls only for the copy; the writer gathers the state
    snapshot_full(token, tables)    replace held deltas by whole states (unmarked)
    snapshot_write(token, files)    a thread writes each held table to its file
    snapshot_wait(token)            -> per file: bytes, sha256 (once flushed)
    snapshot_drop(token)            forget it
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from estuary.embedding.delta import BASE, CHAIN_PREFIX, FULL, LINEAGE, VERSION
from estuary.embedding.files import write_state
from estuary.ps.types import PSError, PSTimeoutError

__all__ = ["HeldSnapshots", "ReadyState", "Snapshot", "chain_header"]

State = dict[str, np.ndarray]


def chain_header(state: Mapping[str, np.ndarray]) -> dict[str, int]:
    """A state's chain keys as plain ints (``lineage``, ``version``, and for a delta
    ``base``, ``full``), for a reply header."""
    keys = {LINEAGE: "lineage", VERSION: "version", BASE: "base", FULL: "full"}
    return {short: int(state[key][0]) for key, short in keys.items() if key in state}


class Snapshot(Protocol):
    """A table state taken at one moment: ``chain`` now, the arrays later."""

    @property
    def chain(self) -> State: ...

    def materialize(self) -> State: ...


@dataclass(frozen=True)
class ReadyState:
    """A state already gathered, as a ``Snapshot``."""

    state: State

    @property
    def chain(self) -> State:
        return {k: v for k, v in self.state.items() if k.startswith(CHAIN_PREFIX)}

    def materialize(self) -> State:
        return self.state


@dataclass
class _Held:
    states: dict[str, Snapshot]
    done: threading.Event = field(default_factory=threading.Event)
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    error: BaseException | None = None
    writing: bool = False


class HeldSnapshots:
    """The snapshots one server holds, by token; thread-safe."""

    def __init__(self) -> None:
        self._held: dict[int, _Held] = {}
        self._tokens = itertools.count(1)
        self._lock = threading.Lock()

    def hold(self, states: dict[str, Snapshot]) -> int:
        """Keep ``states`` (table -> its snapshot); returns its token."""
        with self._lock:
            token = next(self._tokens)
            self._held[token] = _Held(states)
        return token

    def get(self, token: int) -> _Held:
        with self._lock:
            held = self._held.get(token)
        if held is None:
            raise PSError(f"no snapshot {token} on this server (dropped, or already written)")
        return held

    def replace(self, token: int, name: str, state: State) -> None:
        """Put a whole ``state`` of table ``name`` in place of its held delta,
        keeping the delta's chain keys, marked full."""
        held = self.get(token)
        if name not in held.states or held.writing:
            raise PSError(f"snapshot {token}: table {name!r} not held, or already writing")
        chain = held.states[name].chain
        rows = {k: v for k, v in state.items() if not k.startswith(CHAIN_PREFIX)}
        held.states[name] = ReadyState({**rows, **chain, FULL: np.array([1], np.int64)})

    def write(self, token: int, files: Mapping[str, str]) -> None:
        """Start writing each held table to ``files[table]`` (a path this server
        can write: a shared file system) on a background thread."""
        held = self.get(token)
        if set(files) != set(held.states):
            raise PSError(
                f"snapshot {token}: files for {sorted(files)}, but it holds {sorted(held.states)}"
            )
        held.writing = True

        def run() -> None:
            try:
                for name, path in files.items():
                    state = held.states[name].materialize()
                    held.files[path] = write_state(Path(path), state)
            except BaseException as exc:  # reported by wait()
                held.error = exc
            finally:
                held.states = {}  # the memory goes as soon as the files are written
                held.done.set()

        threading.Thread(target=run, name=f"estuary-ps-snapshot-{token}", daemon=True).start()

    def wait(self, token: int, timeout_s: float) -> dict[str, dict[str, Any]]:
        """Block until snapshot ``token``'s files are written; returns per path its
        ``bytes`` and ``sha256``, and forgets the snapshot."""
        held = self.get(token)
        if not held.writing:
            raise PSError(f"snapshot {token}: not being written (snapshot_write first)")
        # Blocking wait: this server's writer thread flushes the files.
        if not held.done.wait(timeout_s):
            raise PSTimeoutError(f"snapshot {token}: files not written within {timeout_s:g} s")
        self.drop(token)
        if held.error is not None:
            raise PSError(f"snapshot {token}: writing failed: {held.error}")
        return held.files

    def drop(self, token: int) -> None:
        with self._lock:
            self._held.pop(token, None)
