"""Trainer side of the parameter server: ``PSClient`` (connections) and
``RemoteTable`` (an ``EmbeddingStore`` whose rows live on the server).

Shapes: ``N`` ids in a call, ``D`` the table's dim.

Steps: a ``RemoteTable`` numbers its train lookups and its gradient pushes
1, 2, 3, ... (both counters start at 0 when the table object is made). The
lookup of step s may wait at the server for the staleness bound; push t
carries (t, rank) so the server applies each step exactly once. Eval lookups,
``state_dict``, ``delta_state_dict`` and ``stats`` wait until every step this
table pushed has been applied (read your writes).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import fields
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection
from typing import Any

import numpy as np

from estuary.embedding.hashing import as_ids
from estuary.embedding.types import Float32Array, Int64Array, TableStats
from estuary.ps.protocol import Arrays, Header, recv_message, send_message, set_nodelay
from estuary.ps.server import Address
from estuary.ps.types import ProtocolError, PSConnectionError, PSError, PSTimeoutError

_ERRORS: dict[str, type[PSError]] = {"timeout": PSTimeoutError, "protocol": ProtocolError}
_STATS_FIELDS = {f.name for f in fields(TableStats)}


class PSClient:
    """Connections to one parameter server; safe to share between threads.

    Args:
        address: the server's address (``ParameterServer.address``).
        authkey: the server's secret.
        timeout_s: longest wait for any reply; keep it above the server's
            ``wait_timeout_s`` so a staleness wait fails at the server first, with
            the better message.
        connect_timeout_s: how long a new connection retries while the server is
            not listening yet (it may still be starting).

    Each concurrent call gets its own connection from a small pool, so a lookup
    blocked at the staleness barrier never holds up the push that would release it.
    """

    def __init__(
        self,
        address: Address,
        authkey: bytes,
        *,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 0.0,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._authkey = authkey
        self._lock = threading.Lock()
        self._idle: list[Connection] = []
        self._closed = False

    def _connect(self) -> Connection:
        deadline = time.monotonic() + self.connect_timeout_s
        while True:
            try:
                conn = Client(self.address, authkey=self._authkey)
                break
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                if time.monotonic() >= deadline:
                    raise PSConnectionError(
                        f"cannot reach the parameter server at {self.address!r}: {exc}"
                    ) from exc
                time.sleep(0.05)  # not listening yet: the server may still be starting
            except (OSError, EOFError, AuthenticationError) as exc:
                raise PSConnectionError(
                    f"cannot reach the parameter server at {self.address!r}: {exc}"
                ) from exc
        set_nodelay(conn)
        return conn

    def call(
        self,
        op: str,
        fields: Mapping[str, Any] | None = None,
        arrays: Mapping[str, Any] | None = None,
    ) -> tuple[Header, Arrays]:
        """One request -> (reply header, reply arrays).

        Raises:
            PSError: the server refused or failed it (``PSTimeoutError`` for waits).
            PSConnectionError: the server is gone.
            PSTimeoutError: no reply within ``timeout_s``.
        """
        with self._lock:
            if self._closed:
                raise PSConnectionError("the parameter server client is closed")
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = self._connect()
        try:
            send_message(conn, {"op": op, **(fields or {})}, arrays)
            # Blocking wait: the server's reply (may include a staleness wait).
            if not conn.poll(self.timeout_s):
                raise PSTimeoutError(
                    f"parameter server at {self.address!r}: no reply to {op!r} "
                    f"within {self.timeout_s:g} s"
                )
            header, out = recv_message(conn)
        except PSError:
            conn.close()
            raise
        except (EOFError, OSError) as exc:
            conn.close()
            raise PSConnectionError(
                f"parameter server at {self.address!r} closed the connection during {op!r}"
                f" ({type(exc).__name__}: {exc}); is the server process still running?"
            ) from exc
        # After a protocol error the server hangs up: do not pool that connection.
        reusable = header.get("ok") or header.get("kind") != "protocol"
        with self._lock:
            if self._closed or not reusable:
                conn.close()
            else:
                self._idle.append(conn)
        if not header.get("ok"):
            error = _ERRORS.get(str(header.get("kind")), PSError)
            raise error(f"parameter server {op!r} failed: {header.get('error')}")
        return header, out

    def hello(self) -> Header:
        """Server facts: ``tables`` (name -> dim), ``world_size``, ``staleness``."""
        return self.call("hello")[0]

    def table(self, name: str, *, rank: int = 0, grad_scale: float = 1.0) -> RemoteTable:
        """A ``RemoteTable`` for ``name`` (see ``RemoteTable`` for the arguments)."""
        dims = self.hello()["tables"]
        if name not in dims:
            raise PSError(f"unknown table {name!r}; the server hosts {sorted(dims)}")
        return RemoteTable(self, name, int(dims[name]), rank=rank, grad_scale=grad_scale)

    def tables(self, *, rank: int = 0, grad_scale: float = 1.0) -> dict[str, RemoteTable]:
        """Every hosted table as a ``RemoteTable``, by name."""
        dims = self.hello()["tables"]
        return {
            name: RemoteTable(self, name, int(dim), rank=rank, grad_scale=grad_scale)
            for name, dim in dims.items()
        }

    def server_stats(self) -> dict[str, dict[str, int]]:
        """Per table: ``applied`` (last applied step), ``duplicates`` (pushes
        ignored), ``pending_steps``, ``waits`` (requests that waited for a step),
        ``max_behind`` (most updates a training lookup missed: the staleness seen)."""
        return dict(self.call("server_stats")[0]["tables"])

    def shutdown(self) -> None:
        """Ask the server to stop (it answers, then closes every connection)."""
        self.call("shutdown")

    def close(self) -> None:
        """Close the pooled connections (calls in flight close theirs when done)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class RemoteTable:
    """A table hosted by a parameter server. Implements ``EmbeddingStore`` and
    the ``state_dict`` API of ``EmbeddingTable``; thread-safe.

    Args:
        client: the server's client.
        name: table name.
        dim: D.
        rank: this trainer's rank (tags every push).
        grad_scale: pushed gradients are multiplied by this (``1 / W`` makes the
            server's sum over W ranks the mean, matching DDP's dense averaging).
    """

    def __init__(
        self, client: PSClient, name: str, dim: int, *, rank: int = 0, grad_scale: float = 1.0
    ) -> None:
        self.client = client
        self.name = name
        self.rank = rank
        self.grad_scale = grad_scale
        self._dim = dim
        self._lock = threading.Lock()
        self._lookup_step = 0  # train lookups so far
        self._push_step = 0  # pushes so far
        self.pushed = 0  # the last step whose push the server acknowledged

    def __repr__(self) -> str:
        return f"RemoteTable({self.name!r}, dim={self._dim}, rank={self.rank})"

    @property
    def dim(self) -> int:
        """Embedding width D."""
        return self._dim

    def __len__(self) -> int:
        """Ids holding their own row at the server."""
        return self.stats().rows

    def lookup(self, ids: Int64Array, *, train: bool, step: int | None = None) -> Float32Array:
        """Rows of ``ids`` int64 (N,) -> fresh float32 (N, D).

        A train lookup is step ``step`` (default: the next step of this table) and
        may wait for the staleness bound; an eval lookup waits until this table's
        pushes have been applied.
        """
        fields: dict[str, Any] = {"table": self.name, "train": train}
        if train:
            with self._lock:
                if step is None:
                    self._lookup_step += 1
                    step = self._lookup_step
            fields["step"] = step
        else:
            fields["after"] = self.pushed
        _, out = self.client.call("lookup", fields, {"ids": as_ids(ids)})
        return out["rows"]

    def apply_gradients(self, ids: Int64Array, grads: Float32Array) -> None:
        """Push ``grads`` float32 (N, D) for ``ids`` int64 (N,) as this table's next step."""
        with self._lock:  # pushes of one table go out in step order
            self.push(self._push_step + 1, ids, grads)
            self._push_step += 1

    def push(self, step: int, ids: Int64Array, grads: Float32Array) -> bool:
        """Push this rank's gradients of ``step``; the server applies the step once
        every rank has pushed it. Returns ``False`` if the server already had this
        (step, rank) (a retry): nothing changed."""
        ids = as_ids(ids)
        grads = np.ascontiguousarray(grads, dtype=np.float32)
        if grads.shape != (ids.size, self._dim):
            raise ValueError(f"grads must have shape ({ids.size}, {self._dim}), got {grads.shape}")
        if self.grad_scale != 1.0:
            grads = grads * np.float32(self.grad_scale)
        header, _ = self.client.call(
            "push",
            {"table": self.name, "step": step, "rank": self.rank},
            {"ids": ids, "grads": grads},
        )
        self.pushed = max(self.pushed, step)
        return not header["duplicate"]

    def wait_applied(self, step: int | None = None) -> int:
        """Block until ``step`` (default: the last one pushed here) is applied at the
        server; returns the server's last applied step."""
        target = self.pushed if step is None else step
        return int(self.client.call("wait", {"table": self.name, "step": target})[0]["applied"])

    def stats(self) -> TableStats:
        """The server-side table's counters."""
        header, _ = self.client.call("stats", {"table": self.name})
        return TableStats(**{k: int(v) for k, v in header["stats"].items() if k in _STATS_FIELDS})

    def state_dict(self) -> dict[str, np.ndarray]:
        """The table's state (``EmbeddingTable.state_dict`` layout), after every step
        this table pushed has been applied."""
        _, out = self.client.call("state_dict", {"table": self.name, "after": self.pushed})
        return out

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Replace the server-side table's state (see ``EmbeddingTable.load_state_dict``).
        Call it while no trainer is training."""
        self.client.call("load_state_dict", {"table": self.name}, dict(state))

    def delta_state_dict(self) -> dict[str, np.ndarray]:
        """Rows changed and ids evicted since the last mark (``EmbeddingTable.
        delta_state_dict``), after every step this table pushed has been applied."""
        _, out = self.client.call("delta_state_dict", {"table": self.name, "after": self.pushed})
        return out

    def apply_delta(self, delta: Mapping[str, np.ndarray]) -> None:
        """Apply a delta on top of the server-side table's state (see
        ``EmbeddingTable.apply_delta``; a wrong base raises ``PSError``). Call it
        while no trainer is training."""
        self.client.call("apply_delta", {"table": self.name}, dict(delta))

    def remove(self, ids: Int64Array) -> int:
        """Drop the rows of ``ids`` int64 (N,); returns how many existed."""
        header, _ = self.client.call("remove", {"table": self.name}, {"ids": as_ids(ids)})
        return int(header["removed"])
