"""Server side of asynchronous checkpoints: table snapshots a parameter server
takes at a given step and writes to files itself (``snapshot`` ops; see
``estuary.ps.snapshots`` for the client side).

::

    snapshot(tables, at, delta)  -> token, at once
        each table: its state (or delta) is captured right after step ``at`` is
        applied and before ``at + 1`` is (``StepAggregator.after_step``; at once
        if ``at`` is applied already): a copy of the rows in use
        (``EmbeddingTable.snapshot``), taken on the thread that applies the step,
        so the trainer that asked does not wait for it
    snapshot_write(token, files)  a thread waits for every capture, then gathers
                                  and writes each table to its file
    snapshot_wait(token)          -> per file: bytes, sha256 (once flushed), and
                                  per table its chain keys
    snapshot_drop(token)          forget it
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
    tables: set[str]
    states: dict[str, Snapshot] = field(default_factory=dict)
    captured: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    chains: dict[str, dict[str, int]] = field(default_factory=dict)
    error: BaseException | None = None
    writing: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class HeldSnapshots:
    """The snapshots one server holds, by token; thread-safe."""

    def __init__(self) -> None:
        self._held: dict[int, _Held] = {}
        self._tokens = itertools.count(1)
        self._lock = threading.Lock()

    def expect(self, tables: list[str]) -> int:
        """A new snapshot of ``tables``, captured later (``capture``); its token."""
        with self._lock:
            token = next(self._tokens)
            self._held[token] = _Held(set(tables))
        return token

    def capture(self, token: int, name: str, take: Any) -> None:
        """Table ``name``'s part of snapshot ``token``: ``take()`` -> its ``Snapshot``
        (called now, on the thread that applied the step)."""
        with self._lock:
            held = self._held.get(token)
        if held is None:  # dropped meanwhile
            return
        try:
            snapshot: Snapshot = take()
        except BaseException as exc:
            held.error = exc
            held.captured.set()
            raise
        with held.lock:
            held.states[name] = snapshot
            held.chains[name] = chain_header(snapshot.chain)
            if set(held.states) == held.tables:
                held.captured.set()

    def get(self, token: int) -> _Held:
        with self._lock:
            held = self._held.get(token)
        if held is None:
            raise PSError(f"no snapshot {token} on this server (dropped, or already written)")
        return held

    def write(self, token: int, files: Mapping[str, str], timeout_s: float) -> None:
        """Once every table is captured, write each to ``files[table]`` (a path this
        server can write: a shared file system), on a background thread."""
        held = self.get(token)
        if set(files) != held.tables:
            raise PSError(
                f"snapshot {token}: files for {sorted(files)}, but it holds {sorted(held.tables)}"
            )
        held.writing = True

        def run() -> None:
            try:
                # Blocking wait: the steps to capture are applied (other ranks push).
                if not held.captured.wait(timeout_s):
                    missing = sorted(held.tables - set(held.states))
                    raise PSTimeoutError(
                        f"snapshot {token}: tables {missing} not captured within {timeout_s:g} s"
                    )
                if held.error is not None:
                    raise held.error
                for name, path in files.items():
                    state = held.states[name].materialize()
                    held.files[path] = write_state(Path(path), state)
            except BaseException as exc:  # reported by wait()
                held.error = exc
            finally:
                held.states = {}  # the memory goes as soon as the files are written
                held.done.set()

        threading.Thread(target=run, name=f"estuary-ps-snapshot-{token}", daemon=True).start()

    def wait(self, token: int, timeout_s: float) -> tuple[dict[str, Any], dict[str, Any]]:
        """Block until snapshot ``token``'s files are written; returns (per path its
        ``bytes`` and ``sha256``, per table its chain keys) and forgets it."""
        held = self.get(token)
        if not held.writing:
            raise PSError(f"snapshot {token}: not being written (snapshot_write first)")
        # Blocking wait: this server's writer thread flushes the files.
        if not held.done.wait(timeout_s):
            raise PSTimeoutError(f"snapshot {token}: files not written within {timeout_s:g} s")
        self.drop(token)
        if held.error is not None:
            raise PSError(f"snapshot {token}: writing failed: {held.error}")
        return held.files, held.chains

    def drop(self, token: int) -> None:
        with self._lock:
            self._held.pop(token, None)
