"""Trainer side of the parameter server: ``PSClient`` (connections) and
``RemoteTable`` (an ``EmbeddingStore`` whose rows live on the server).

Shapes: ``N`` ids in a call, ``D`` the table's dim.

Steps: a ``RemoteTable`` numbers its train lookups and its gradient pushes
1, 2, 3, ... (both counters start at 0 when the table object is made). The
lookup of step s may wait at the server for the staleness bound; push t
carries (t, rank) so the server applies each step exactly once. Eval lookups,
``state_dict`` and ``delta_state_dict`` wait until every step this table pushed
has been applied (read your writes); ``stats`` and ``stats_many`` read the
counters as they are (a time-series sample must not wait on a step).

Batching: ``PSClient`` is the ``MultiTableStore`` of its tables. ``lookup_many``
and ``apply_gradients_many`` send every table's ids (gradients) of a step in ONE
request (``lookup_many`` / ``push_many`` ops) instead of one per table; each
table keeps its own step counter, staleness wait and exactly-once push, so the
rows and tables are the same as with per-table calls. ``stats_many`` reads
every table's counters in one request (``stats_many`` op).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import fields
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection
from typing import Any, Protocol, TypeVar

import numpy as np

from estuary.embedding.hashing import as_ids
from estuary.embedding.storage import rows_out
from estuary.embedding.types import EmbeddingStore, Float32Array, Int64Array, TableStats
from estuary.ps.protocol import (
    PROTOCOL_VERSION,
    Arrays,
    Header,
    recv_message,
    send_message,
    set_nodelay,
)
from estuary.ps.routing import StaleRoutingError
from estuary.ps.types import Address, ProtocolError, PSConnectionError, PSError, PSTimeoutError

_ERRORS: dict[str, type[PSError]] = {
    "timeout": PSTimeoutError,
    "protocol": ProtocolError,
    "stale_routing": StaleRoutingError,
}
_STATS_FIELDS = {f.name for f in fields(TableStats)}
T = TypeVar("T")


def member_identity(member: Mapping[str, Any]) -> Hashable:
    """Which server a slot map's ``members`` entry (``estuary.ps.migration``)
    names: its Ray actor (``actor`` and ``namespace``: the actor data plane) when
    it has one, else its address (a JSON header turns a (host, port) tuple into
    a list)."""
    actor = member.get("actor")
    if actor:
        return ("actor", member.get("namespace"), str(actor))
    address = member["address"]
    if isinstance(address, list | tuple):
        return (str(address[0]), int(address[1]))
    return str(address)


def connect_member(member: Mapping[str, Any], timeout_s: float) -> PSClient:
    """A socket client of the server a ``members`` entry names (its address and
    key): how a ``ShardedPSClient`` reaches a server that joined the job."""
    if member.get("actor"):
        raise PSError(
            f"server {member['actor']!r} joined as a Ray actor (the actor data plane); "
            "this client reaches servers over sockets"
        )
    address = member["address"]
    if isinstance(address, list):
        address = (str(address[0]), int(address[1]))
    return PSClient(address, bytes.fromhex(member["authkey"]), timeout_s=timeout_s)


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
        header, out = self._send(op, fields, arrays)
        if not header.get("ok"):
            error = _ERRORS.get(str(header.get("kind")), PSError)
            raise error(f"parameter server {op!r} failed: {header.get('error')}")
        return header, out

    def _send(
        self,
        op: str,
        fields: Mapping[str, Any] | None,
        arrays: Mapping[str, Any] | None,
    ) -> tuple[Header, Arrays]:
        """The transport: one request -> the reply (``ok`` or an error reply)."""
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
        return header, out

    @property
    def authkey(self) -> bytes:
        """The key this client authenticates with (handed to the job's other
        clients when a server joins, ``estuary.ps.migration``)."""
        return self._authkey

    def member(self) -> dict[str, Any]:
        """This server as a slot map's ``members`` name it after a split or merge
        (``estuary.ps.migration``): its address and key (hex), so any client of
        the job can connect (``ShardedPSClient.adopt``).

        Raises:
            PSError: the client has no key to hand on.
        """
        if not self._authkey:
            raise PSError(
                f"split/merge: the client of {self.address!r} has no socket address and key "
                "to hand to the job's other clients"
            )
        return {"address": self.address, "authkey": self._authkey.hex()}

    @property
    def identity(self) -> Hashable:
        """Which server this is, as ``member_identity`` reads a ``members``
        entry: its address."""
        return member_identity({"address": self.address})

    def hello(self) -> Header:
        """Server facts: ``tables`` (name -> dim), ``world_size``, ``staleness``.

        Raises:
            PSError: the server speaks another protocol version (another Estuary).
        """
        header = self.call("hello")[0]
        if header.get("protocol") != PROTOCOL_VERSION:
            raise PSError(
                f"parameter server speaks protocol {header.get('protocol')!r}, this client "
                f"{PROTOCOL_VERSION}: run the same Estuary version on both sides"
            )
        return header

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

    def lookup_many(
        self,
        stores: Sequence[EmbeddingStore],
        ids: Sequence[Int64Array],
        *,
        train: bool,
        out: Sequence[Float32Array] | None = None,
        steps: Sequence[int] | None = None,
        routing: int | None = None,
    ) -> list[Float32Array]:
        """Every table's ``lookup`` in one request -> per table float32 (N_i, D_i).

        Args:
            stores: ``RemoteTable``s of this client, each at most once.
            ids: per table, int64 (N_i,).
            train: as ``RemoteTable.lookup``; each train lookup is its table's
                next step (or ``steps[i]``) and may wait for the staleness bound.
            out: per table, a writeable C-contiguous float32 (N_i, D_i) the rows
                are copied into (and returned).
            routing: the slot map version the ids were routed with (a
                ``ShardedPSClient``'s; ``None``: unchecked).

        Raises:
            PSError: as the per-table lookups, naming the table that failed
                (``StaleRoutingError``: the server holds another slot map).
        """
        tables = self._own(stores, "lookup_many")
        id_arrays = [as_ids(i) for i in ids]
        if len(id_arrays) != len(tables) or (out is not None and len(out) != len(tables)):
            raise ValueError(
                f"lookup_many: need ids (and out) for each of the {len(tables)} tables"
            )
        if not tables:
            return []
        dest: list[Float32Array | None] = [None] * len(tables)
        if out is not None:  # checked before the request: a bad buffer costs no step
            dest = [
                rows_out(o, a.size, t.dim) for o, t, a in zip(out, tables, id_arrays, strict=True)
            ]
        fields: dict[str, Any] = {
            "tables": [t.name for t in tables],
            "train": train,
            "counts": [a.size for a in id_arrays],
        }
        if train:
            fields["steps"] = (
                [t._next_lookup_step() for t in tables]
                if steps is None
                else [int(s) for s in steps]
            )
        else:
            fields["after"] = [t.pushed for t in tables]
        if routing is not None:
            fields["routing"] = routing
        _, reply = self.call("lookup_many", fields, {"ids": _concat_ids(id_arrays)})
        flat = reply["rows"]  # float32 (sum of N_i D_i,): table by table
        sizes = [a.size * t.dim for t, a in zip(tables, id_arrays, strict=True)]
        if flat.ndim != 1 or flat.size != sum(sizes) or flat.dtype != np.float32:
            raise ProtocolError(
                f"lookup_many: reply 'rows' is {flat.dtype} {flat.shape}, "
                f"expected float32 ({sum(sizes)},)"
            )
        result: list[Float32Array] = []
        start = 0
        for table, ids_t, size, into in zip(tables, id_arrays, sizes, dest, strict=True):
            rows = flat[start : start + size].reshape(ids_t.size, table.dim)  # a view
            start += size
            if into is not None:
                np.copyto(into, rows)
                rows = into
            result.append(rows)
        return result

    def apply_gradients_many(
        self,
        stores: Sequence[EmbeddingStore],
        ids: Sequence[Int64Array],
        grads: Sequence[Float32Array],
        lr_scales: Sequence[float] | None = None,
    ) -> None:
        """Every table's ``apply_gradients`` (its next push) in one request.

        ``stores``: ``RemoteTable``s of this client, each at most once; ``ids[i]``
        int64 (N_i,), ``grads[i]`` float32 (N_i, D_i), ``lr_scales[i]`` the step's
        learning-rate scale (``None``: all 1)."""
        tables = self._own(stores, "apply_gradients_many")
        push_next_steps(tables, lambda steps: self.push_many(tables, steps, ids, grads, lr_scales))

    def push_many(
        self,
        stores: Sequence[EmbeddingStore],
        steps: Sequence[int],
        ids: Sequence[Int64Array],
        grads: Sequence[Float32Array],
        lr_scales: Sequence[float] | None = None,
        routing: int | None = None,
    ) -> list[bool]:
        """Each table's ``push(steps[i], ids[i], grads[i], lr_scale=lr_scales[i])``
        in one request (``lr_scales`` ``None``: all 1); per table ``False`` where
        the server already had that (step, rank) (a retry). ``routing``: as
        ``lookup_many``'s.

        Tables are pushed in order; if table i fails (its error names it), tables
        before it were pushed: retrying the whole call is safe (they are
        duplicates, ignored)."""
        tables = self._own(stores, "push_many")
        id_arrays = [as_ids(i) for i in ids]
        scales = [1.0] * len(tables) if lr_scales is None else [float(s) for s in lr_scales]
        if not len(id_arrays) == len(grads) == len(steps) == len(scales) == len(tables):
            raise ValueError(
                f"push_many: need steps, ids, grads (and lr scales) for each of "
                f"{len(tables)} tables"
            )
        if not tables:
            return []
        flat = np.empty(
            sum(a.size * t.dim for t, a in zip(tables, id_arrays, strict=True)), np.float32
        )
        start = 0
        for table, ids_t, grads_t in zip(tables, id_arrays, grads, strict=True):
            grads_t = checked_grads(table, ids_t, grads_t)
            into = flat[start : start + grads_t.size].reshape(grads_t.shape)
            np.multiply(grads_t, np.float32(table.grad_scale), out=into)  # one pass: copy + scale
            start += grads_t.size
        fields: dict[str, Any] = {
            "tables": [t.name for t in tables],
            "steps": [int(s) for s in steps],
            "ranks": [t.rank for t in tables],
            "lr_scales": scales,
            "counts": [a.size for a in id_arrays],
        }
        if routing is not None:
            fields["routing"] = routing
        header, _ = self.call("push_many", fields, {"ids": _concat_ids(id_arrays), "grads": flat})
        for table, step in zip(tables, steps, strict=True):
            table.pushed = max(table.pushed, int(step))
        return [not duplicate for duplicate in header["duplicate"]]

    def stats_many(self, stores: Sequence[EmbeddingStore]) -> list[TableStats]:
        """Every table's ``stats()`` in one request -> per table its counters.

        ``stores``: ``RemoteTable``s of this client, each at most once.

        Raises:
            PSError: the server hosts no table of that name (the error names it).
        """
        tables = self._own(stores, "stats_many")
        if not tables:
            return []
        header, _ = self.call("stats_many", {"tables": [t.name for t in tables]})
        replies = header["tables"]
        if not isinstance(replies, list) or len(replies) != len(tables):
            raise ProtocolError(
                f"stats_many: reply 'tables' is {replies!r}, expected {len(tables)} entries"
            )
        return [table_stats(reply["stats"]) for reply in replies]

    def _own(self, stores: Sequence[EmbeddingStore], op: str) -> list[RemoteTable]:
        return owned_tables(self, stores, op, RemoteTable)

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
        # Two locks: a push in flight must not hold up the next step's lookup.
        self._lookup_lock = threading.Lock()
        self._push_lock = threading.Lock()
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

    @property
    def multi_store(self) -> PSClient:
        """The ``MultiTableStore`` that batches this table's calls with other tables
        of the same server (``shared_multi_store``)."""
        return self.client

    def _next_lookup_step(self) -> int:
        with self._lookup_lock:
            self._lookup_step += 1
            return self._lookup_step

    def lookup(
        self,
        ids: Int64Array,
        *,
        train: bool,
        step: int | None = None,
        out: Float32Array | None = None,
    ) -> Float32Array:
        """Rows of ``ids`` int64 (N,) -> float32 (N, D): ``out`` if given (the reply
        is copied into it), else fresh.

        A train lookup is step ``step`` (default: the next step of this table) and
        may wait for the staleness bound; an eval lookup waits until this table's
        pushes have been applied.
        """
        ids = as_ids(ids)
        dest = None if out is None else rows_out(out, ids.size, self._dim)
        fields: dict[str, Any] = {"table": self.name, "train": train}
        if train:
            fields["step"] = self._next_lookup_step() if step is None else step
        else:
            fields["after"] = self.pushed
        _, reply = self.client.call("lookup", fields, {"ids": ids})
        if dest is None:
            return reply["rows"]
        np.copyto(dest, reply["rows"])
        return dest

    def apply_gradients(
        self, ids: Int64Array, grads: Float32Array, *, lr_scale: float = 1.0
    ) -> None:
        """Push ``grads`` float32 (N, D) for ``ids`` int64 (N,) as this table's next
        step, to be applied at the learning rate times ``lr_scale``."""
        with self._push_lock:  # pushes of one table go out in step order
            self.push(self._push_step + 1, ids, grads, lr_scale=lr_scale)
            self._push_step += 1

    def push(
        self, step: int, ids: Int64Array, grads: Float32Array, *, lr_scale: float = 1.0
    ) -> bool:
        """Push this rank's gradients of ``step``; the server applies the step once
        every rank has pushed it, at the learning rate times ``lr_scale`` (every
        rank must push the step with the same scale: the server fails the table
        otherwise). Returns ``False`` if the server already had this (step, rank)
        (a retry): nothing changed."""
        ids = as_ids(ids)
        grads = np.ascontiguousarray(grads, dtype=np.float32)
        if grads.shape != (ids.size, self._dim):
            raise ValueError(f"grads must have shape ({ids.size}, {self._dim}), got {grads.shape}")
        if self.grad_scale != 1.0:
            grads = grads * np.float32(self.grad_scale)
        header, _ = self.client.call(
            "push",
            {"table": self.name, "step": step, "rank": self.rank, "lr_scale": float(lr_scale)},
            {"ids": ids, "grads": grads},
        )
        self.pushed = max(self.pushed, step)
        return not header["duplicate"]

    def note_pushed(self, step: int) -> None:
        """Another client (an embedding worker) pushed this rank's ``step`` of the
        table: reads and snapshots from here wait for it too."""
        self.pushed = max(self.pushed, int(step))

    def wait_applied(self, step: int | None = None) -> int:
        """Block until ``step`` (default: the last one pushed here) is applied at the
        server; returns the server's last applied step."""
        target = self.pushed if step is None else step
        return int(self.client.call("wait", {"table": self.name, "step": target})[0]["applied"])

    def stats(self) -> TableStats:
        """The server-side table's counters."""
        header, _ = self.client.call("stats", {"table": self.name})
        return table_stats(header["stats"])

    def state_dict(self, *, mark_clean: bool = True) -> dict[str, np.ndarray]:
        """The table's state (``EmbeddingTable.state_dict`` layout), after every step
        this table pushed has been applied; ``mark_clean`` as for ``EmbeddingTable``."""
        _, out = self.client.call(
            "state_dict", {"table": self.name, "after": self.pushed, "mark": mark_clean}
        )
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

    def set_admission_counting(self, enabled: bool) -> None:
        """Whether train lookups count sightings of ids not admitted yet (the
        trainer turns it off after the first epoch; idempotent, so every rank may
        call it)."""
        self.client.call("set_admission_counting", {"table": self.name, "enabled": enabled})


class _Pushed(Protocol):
    """A table whose pushes a client numbers (``RemoteTable``, ``ShardedTable``)."""

    _push_lock: threading.Lock
    _push_step: int


def push_next_steps(tables: Sequence[_Pushed], push: Callable[[list[int]], object]) -> None:
    """``push(steps)`` with each table's next push step, then count the pushes.

    Pushes of one table go out in step order: every table's push lock is held
    meanwhile, taken in a fixed order (no deadlock between callers)."""
    with contextlib.ExitStack() as stack:
        for table in sorted(tables, key=id):
            stack.enter_context(table._push_lock)
        push([t._push_step + 1 for t in tables])
        for table in tables:
            table._push_step += 1


def owned_tables(
    client: object, stores: Sequence[EmbeddingStore], op: str, kind: type[T]
) -> list[T]:
    """``stores`` as tables of ``client`` (each a ``kind`` whose ``client`` is it,
    none twice), for a batched call ``op``; ``ValueError`` otherwise."""
    tables: list[T] = []
    for store in stores:
        if not isinstance(store, kind) or getattr(store, "client", None) is not client:
            raise ValueError(f"{op}: {store!r} is not a table of this parameter server client")
        if any(store is seen for seen in tables):
            raise ValueError(f"{op}: {store!r} is listed twice")
        tables.append(store)
    return tables


def table_stats(fields: Mapping[str, Any]) -> TableStats:
    """A reply's ``stats`` fields as ``TableStats`` (fields this side does not
    know, from a newer server, are left out)."""
    return TableStats(**{k: int(v) for k, v in fields.items() if k in _STATS_FIELDS})


def checked_grads(table: EmbeddingStore, ids: Int64Array, grads: Any) -> Float32Array:
    """``grads`` as float32, checked to be (N, D) for ``ids`` (N,) of ``table``."""
    grads = np.asarray(grads, dtype=np.float32)
    if grads.shape != (ids.size, table.dim):
        name = getattr(table, "name", table)
        raise ValueError(
            f"table {name!r}: grads must have shape ({ids.size}, {table.dim}), got {grads.shape}"
        )
    return grads


def _concat_ids(arrays: Sequence[Int64Array]) -> Int64Array:
    return np.concatenate(arrays) if arrays else np.empty(0, np.int64)
