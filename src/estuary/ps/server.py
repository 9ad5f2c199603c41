"""The parameter server: hosts ``EmbeddingTable``s and serves trainers.

Shapes: ``N`` ids in a request, ``D`` a table's dim.

::

    trainer threads --(one connection each, pooled by PSClient)--> ParameterServer
        lookup(table, ids, train, step)   waits for the staleness bound, then gathers
        push(table, step, rank, ids, grads, lr_scale)
                                          StepAggregator: all W ranks -> one step
                                          (at their common lr scale)
        lookup_many / push_many           the same for every table of a step, one request
        state_dict / load_state_dict / delta_state_dict / apply_delta
        stats / remove / wait / shutdown
        stats_many                        many tables' stats in one request (the
                                          time-series sample reads every table)
        snapshot / snapshot_write / snapshot_wait / snapshot_drop
                                          asynchronous checkpoints: the server copies a
                                          table's state right after a given step is
                                          applied, then writes it itself
                                          (``estuary.ps.held``)

One thread per connection. Tables run their numba kernels with the GIL released
and lock per shard, so lookups of different connections run side by side;
a table's optimizer steps are serialised by its ``StepAggregator``.

Operations are found by name in ``ParameterServer._ops`` (no if/elif on ``op``).
This module serves in-process (``start()``, ``serving``); ``estuary.ps.process``
runs a server in its own process (``ServerProcess``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import numpy as np

from estuary.embedding.table import EmbeddingTable
from estuary.ps.aggregation import StepAggregator
from estuary.ps.held import HeldSnapshots, Snapshot
from estuary.ps.migration import slot_filter
from estuary.ps.protocol import (
    PROTOCOL_VERSION,
    Arrays,
    Header,
    recv_message,
    send_message,
    set_nodelay,
    wake_reader,
)
from estuary.ps.routing import RoutingGate, StaleRoutingError
from estuary.ps.types import Address, ProtocolError, PSError, PSTimeoutError, ServerConfig

logger = logging.getLogger(__name__)

Handler = Callable[[Header, Arrays], tuple[Header, Arrays]]

# Reply ``kind`` of each error type (the client raises the matching class).
_ERROR_KINDS: dict[type[BaseException], str] = {
    PSTimeoutError: "timeout",
    ProtocolError: "protocol",
    StaleRoutingError: "stale_routing",
}


def default_address() -> tuple[Address, str | None]:
    """An address for a server on this machine: an AF_UNIX socket in a fresh temp
    folder where available (no TCP stack, no port to pick), else loopback TCP on a
    free port. Returns (address, folder to remove afterwards or None)."""
    if hasattr(socket, "AF_UNIX"):
        folder = tempfile.mkdtemp(prefix="estuary-ps-")
        return os.path.join(folder, "ps.sock"), folder
    return ("127.0.0.1", 0), None


class ParameterServer:
    """Hosts the tables of ``config`` and serves requests until shut down.

    Args:
        config: tables, world size, staleness bound, timeouts.
        address: ``None`` (``default_address()``), an AF_UNIX path, or a
            ``(host, port)`` pair for TCP (port 0 picks a free one). Bind to
            loopback unless trainers run on other machines.
        authkey: secret every client must prove when it connects (default: 32
            random bytes; read it from ``authkey``).

    ``serve_forever()`` blocks; ``start()`` runs it on a background thread.
    """

    def __init__(
        self, config: ServerConfig, *, address: Address | None = None, authkey: bytes | None = None
    ) -> None:
        config.validate()
        self.config = config
        self.authkey = authkey or os.urandom(32)
        self.tables = {
            name: EmbeddingTable(hosted.spec, seed=hosted.seed, name=name)
            for name, hosted in config.tables.items()
        }
        self.steps = {
            name: StepAggregator(
                name,
                table.dim,
                config.world_size,
                table.apply_gradients,
                max_pending_steps=config.max_pending_steps,
            )
            for name, table in self.tables.items()
        }
        self._folder: str | None = None
        if address is None:
            address, self._folder = default_address()
        self._listener = Listener(address, authkey=self.authkey)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[Connection] = set()
        self._thread: threading.Thread | None = None
        self._ops: dict[str, Handler] = {
            "hello": self._op_hello,
            "lookup": self._op_lookup,
            "push": self._op_push,
            "lookup_many": self._op_lookup_many,
            "push_many": self._op_push_many,
            "wait": self._op_wait,
            "stats": self._op_stats,
            "stats_many": self._op_stats_many,
            "server_stats": self._op_server_stats,
            "state_dict": self._op_state_dict,
            "load_state_dict": self._op_load_state_dict,
            "delta_state_dict": self._op_delta_state_dict,
            "apply_delta": self._op_apply_delta,
            "remove": self._op_remove,
            "set_admission_counting": self._op_set_admission_counting,
            "shutdown": self._op_shutdown,
            "snapshot": self._op_snapshot,
            "snapshot_write": self._op_snapshot_write,
            "snapshot_wait": self._op_snapshot_wait,
            "snapshot_drop": self._op_snapshot_drop,
            "routing": self._op_routing,
            "set_routing": self._op_set_routing,
            "fence": self._op_fence,
            "lift": self._op_lift,
            "export_slots": self._op_export_slots,
            "import_rows": self._op_import_rows,
            "drop_ids": self._op_drop_ids,
            "slot_loads": self._op_slot_loads,
            "hold_routing": self._op_hold_routing,
            "lock_moves": self._op_lock_moves,
            "release_routing": self._op_release_routing,
            "chain": self._op_chain,
            "join": self._op_join,
        }
        self.held = HeldSnapshots()
        self.routing = RoutingGate()

    @property
    def address(self) -> Address:
        """Where clients connect (the bound port for TCP port 0)."""
        address = self._listener.address
        return address if isinstance(address, str) else (str(address[0]), int(address[1]))

    # -- lifecycle ---------------------------------------------------------------

    def serve_forever(self) -> None:
        """Accept connections (one thread each) until ``shutdown``/``close``."""
        try:
            while not self._stop.is_set():
                try:
                    conn = self._listener.accept()  # Blocking wait: next trainer connection.
                except (AuthenticationError, EOFError, OSError) as exc:
                    if not self._stop.is_set():
                        logger.warning("parameter server: rejected a connection: %s", exc)
                    continue
                if self._stop.is_set():
                    conn.close()
                    break
                set_nodelay(conn)
                with self._lock:
                    self._conns.add(conn)
                threading.Thread(
                    target=self._serve_connection, args=(conn,), name="estuary-ps-conn", daemon=True
                ).start()
        finally:
            self._listener.close()
            with self._lock:
                for conn in self._conns:
                    wake_reader(conn)
            if self._folder is not None:
                shutil.rmtree(self._folder, ignore_errors=True)

    def start(self) -> ParameterServer:
        """Serve on a background thread (in-process use, tests); returns self."""
        self._thread = threading.Thread(target=self.serve_forever, name="estuary-ps", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop accepting, drop every connection, free the address."""
        self._begin_shutdown()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _begin_shutdown(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        # accept() does not wake when the listener closes: connect once to wake it.
        with contextlib.suppress(OSError, EOFError, AuthenticationError):
            Client(self._listener.address, authkey=self.authkey).close()

    def _serve_connection(self, conn: Connection) -> None:
        try:
            while not self._stop.is_set():
                try:
                    header, arrays = recv_message(conn)
                except (EOFError, OSError):
                    return  # the client went away
                except ProtocolError as exc:
                    # Frames can no longer be told apart: answer once, then hang up.
                    self._send_error(conn, exc)
                    return
                op = header.get("op")
                reply, out = self.handle(header, arrays)
                try:
                    send_message(conn, reply, out)
                except (EOFError, OSError):
                    return
                if op == "shutdown" and reply["ok"]:
                    self._begin_shutdown()
                    return
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def handle(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        """One request, whatever carried it -> (reply header with ``ok``, arrays);
        an error becomes an error reply (``ok: false``, ``kind``, ``error``), never
        an exception: it goes back to the caller and the server serves on."""
        op = header.get("op")
        handler = self._ops.get(op) if isinstance(op, str) else None
        try:
            if handler is None:
                raise PSError(f"unknown op {op!r}; known: {sorted(self._ops)}")
            reply, out = handler(header, arrays)
        except Exception as exc:  # reported to the caller, never kills the server
            if not isinstance(exc, PSError | ValueError | KeyError | TypeError):
                logger.exception("parameter server: %s failed", op)
            return _error_reply(exc), {}
        return {"ok": True, **reply}, out

    @staticmethod
    def _send_error(conn: Connection, exc: BaseException) -> None:
        with contextlib.suppress(EOFError, OSError):
            send_message(conn, _error_reply(exc))

    # -- request fields ----------------------------------------------------------

    def _table(self, header: Header) -> tuple[EmbeddingTable, StepAggregator]:
        return self._named_table(header.get("table"))

    def _named_table(self, name: Any) -> tuple[EmbeddingTable, StepAggregator]:
        if not isinstance(name, str) or name not in self.tables:
            raise PSError(f"unknown table {name!r}; this server hosts {sorted(self.tables)}")
        return self.tables[name], self.steps[name]

    @staticmethod
    def _int(header: Header, key: str, default: int | None = None) -> int:
        value = header.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise PSError(f"field {key!r} must be an int, got {value!r}")
        return value

    @staticmethod
    def _ints(header: Header, key: str, count: int) -> list[int]:
        values = header.get(key)
        if (
            not isinstance(values, list)
            or len(values) != count
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in values)
        ):
            raise PSError(f"field {key!r} must be a list of {count} ints, got {values!r}")
        return values

    @staticmethod
    def _flag(header: Header, key: str, default: bool) -> bool:
        value = header.get(key, default)
        if not isinstance(value, bool):
            raise PSError(f"field {key!r} must be true or false, got {value!r}")
        return value

    @staticmethod
    def _float(header: Header, key: str, default: float) -> float:
        value = header.get(key, default)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise PSError(f"field {key!r} must be a number, got {value!r}")
        return float(value)

    @staticmethod
    def _floats(header: Header, key: str, count: int, default: float) -> list[float]:
        values = header.get(key, [default] * count)
        if (
            not isinstance(values, list)
            or len(values) != count
            or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
        ):
            raise PSError(f"field {key!r} must be a list of {count} numbers, got {values!r}")
        return [float(v) for v in values]

    def _batch(self, header: Header, arrays: Arrays) -> list[_Part]:
        """A batched request's tables, each with its slice of the ``ids`` array
        (``counts[i]`` ids per table, concatenated in ``tables`` order)."""
        names = header.get("tables")
        if not isinstance(names, list) or not names:
            raise PSError(f"field 'tables' must be a non-empty list of names, got {names!r}")
        counts = self._ints(header, "counts", len(names))
        ids = self._array(arrays, "ids", np.int64, 1)
        if any(n < 0 for n in counts) or sum(counts) != ids.size:
            raise PSError(f"field 'counts' {counts} does not split the {ids.size} ids")
        parts: list[_Part] = []
        start = 0
        for name, count in zip(names, counts, strict=True):
            table, steps = self._named_table(name)
            parts.append(_Part(name, table, steps, ids[start : start + count]))
            start += count
        return parts

    @staticmethod
    def _array(arrays: Arrays, key: str, dtype: type, ndim: int) -> np.ndarray:
        array = arrays.get(key)
        if array is None or array.dtype != dtype or array.ndim != ndim:
            got = "nothing" if array is None else f"{array.dtype} with {array.ndim} dims"
            raise PSError(f"array {key!r} must be {np.dtype(dtype)} with {ndim} dims, got {got}")
        return array

    def _version(self, header: Header) -> int | None:
        return None if header.get("routing") is None else self._int(header, "routing")

    def _admit(self, tables: list[str], steps: list[int] | None, header: Header) -> None:
        """The routing gate (``estuary.ps.routing``): waits at a migration fence,
        refuses a request routed with another slot map version."""
        self.routing.admit(tables, steps, self._version(header), self.config.wait_timeout_s)

    # -- operations ----------------------------------------------------------------

    def _op_hello(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        return {
            "protocol": PROTOCOL_VERSION,
            "tables": {name: table.dim for name, table in self.tables.items()},
            "shards": {name: table.spec.shards for name, table in self.tables.items()},
            "world_size": self.config.world_size,
            "staleness": self.config.staleness,
        }, {}

    def _before_lookup(
        self, steps: StepAggregator, *, train: bool, step: int | None, after: int
    ) -> None:
        """The read barrier of one table's lookup: a train lookup of ``step`` waits
        for step ``step - 1 - staleness``; any lookup for step ``after``."""
        need = after
        if train and step is not None and self.config.staleness is not None:
            need = max(need, step - 1 - self.config.staleness)
        if need > 0:
            # Blocking wait: the staleness barrier (other ranks' pushes release it).
            steps.wait_applied(need, self.config.wait_timeout_s)
        if train and step is not None:
            steps.note_lookup(step)

    def _op_lookup(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        table, steps = self._table(header)
        ids = self._array(arrays, "ids", np.int64, 1)
        train = bool(header.get("train", False))
        step = self._int(header, "step") if header.get("step") is not None else None
        self._admit([table.name], [step] if train and step is not None else None, header)
        self._before_lookup(steps, train=train, step=step, after=self._int(header, "after", 0))
        return {}, {"rows": table.lookup(ids, train=train)}

    def _op_lookup_many(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        # Every field is checked before any table is touched (a train lookup inserts).
        parts = self._batch(header, arrays)
        train = bool(header.get("train", False))
        count = len(parts)
        steps = self._ints(header, "steps", count) if header.get("steps") is not None else None
        after = self._ints(header, "after", count) if header.get("after") is not None else None
        self._admit([p.name for p in parts], steps if train else None, header)
        if train:
            for part in parts:
                self.routing.note(part.ids)
        rows = np.empty(sum(p.ids.size * p.table.dim for p in parts), np.float32)
        start = 0
        for i, part in enumerate(parts):
            size = part.ids.size * part.table.dim
            with _naming(part.name):
                self._before_lookup(
                    part.steps,
                    train=train,
                    step=None if steps is None else steps[i],
                    after=0 if after is None else after[i],
                )
                # Straight into the reply: table by table, (N_i, D_i) each.
                out = rows[start : start + size].reshape(part.ids.size, part.table.dim)
                part.table.lookup(part.ids, train=train, out=out)
            start += size
        return {}, {"rows": rows}

    def _op_push(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        _, steps = self._table(header)
        ids = self._array(arrays, "ids", np.int64, 1)
        grads = self._array(arrays, "grads", np.float32, 2)
        accepted = steps.push(
            self._int(header, "step"),
            self._int(header, "rank"),
            ids,
            grads,
            lr_scale=self._float(header, "lr_scale", 1.0),
        )
        return {"duplicate": not accepted, "applied": steps.applied}, {}

    def _op_push_many(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        parts = self._batch(header, arrays)
        self.routing.check(self._version(header))
        steps = self._ints(header, "steps", len(parts))
        ranks = self._ints(header, "ranks", len(parts))
        scales = self._floats(header, "lr_scales", len(parts), 1.0)
        grads = self._array(arrays, "grads", np.float32, 1)  # table by table, (N_i, D_i) each
        need = sum(p.ids.size * p.table.dim for p in parts)
        if grads.size != need:
            raise PSError(f"array 'grads' has {grads.size} values; the tables' ids need {need}")
        for part, step, rank in zip(parts, steps, ranks, strict=True):
            if step < 1 or not 0 <= rank < self.config.world_size:
                raise PSError(
                    f"table {part.name!r}: step {step} (must be >= 1) or rank {rank} "
                    f"(must be in [0, {self.config.world_size})) is out of range"
                )
        # Tables are pushed in order; should table i fail, earlier tables were
        # pushed, and a retry of the request is safe (their pushes are duplicates).
        duplicate, applied = [], []
        start = 0
        for part, step, rank, scale in zip(parts, steps, ranks, scales, strict=True):
            size = part.ids.size * part.table.dim
            part_grads = grads[start : start + size].reshape(part.ids.size, part.table.dim)
            start += size
            with _naming(part.name):
                accepted = part.steps.push(step, rank, part.ids, part_grads, lr_scale=scale)
            duplicate.append(not accepted)
            applied.append(part.steps.applied)
        return {"duplicate": duplicate, "applied": applied}, {}

    def _op_wait(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        _, steps = self._table(header)
        steps.wait_applied(self._int(header, "step"), self.config.wait_timeout_s)
        return {"applied": steps.applied}, {}

    def _op_stats(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        table, steps = self._table(header)
        return _stats_reply(table, steps), {}

    def _op_stats_many(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        # Every name is checked before any table is read: an unknown one fails the request.
        names = header.get("tables")
        if not isinstance(names, list) or not names:
            raise PSError(f"field 'tables' must be a non-empty list of names, got {names!r}")
        parts = [(name, *self._named_table(name)) for name in names]
        return {"tables": [_stats_reply(table, steps) for _, table, steps in parts]}, {}

    def _op_server_stats(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        return {"tables": {name: _step_counters(s) for name, s in self.steps.items()}}, {}

    def _op_state_dict(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        table, steps = self._table(header)
        steps.wait_applied(self._int(header, "after", 0), self.config.wait_timeout_s)
        with steps.exclusive():  # no step lands halfway through the snapshot
            state = table.state_dict(mark_clean=bool(header.get("mark", True)))
        return {"applied": steps.applied}, state

    def _op_load_state_dict(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        table, steps = self._table(header)
        with steps.exclusive():
            table.load_state_dict(arrays)
        return {"rows": len(table)}, {}

    def _op_delta_state_dict(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        table, steps = self._table(header)
        steps.wait_applied(self._int(header, "after", 0), self.config.wait_timeout_s)
        with steps.exclusive():  # no step lands halfway through the delta
            delta = table.delta_state_dict()
        return {"applied": steps.applied}, delta

    def _op_snapshot(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        names = header.get("tables")
        if not isinstance(names, list) or not names:
            raise PSError("'tables' must be a non-empty list of table names")
        parts = [(name, *self._named_table(name)) for name in names]
        steps_at = self._ints(header, "at", len(parts))
        delta = bool(header.get("delta", False))
        token = self.held.expect(list(names))
        for (name, table, steps), at in zip(parts, steps_at, strict=True):

            def take(table: EmbeddingTable = table) -> Snapshot:
                return table.snapshot(delta=delta)

            def hook(name: str = name, take: Any = take) -> None:
                self.held.capture(token, name, take)

            with _naming(name):
                if not steps.after_step(at, hook):
                    self.held.drop(token)
                    raise PSError(f"snapshot at step {at}: step {steps.applied} is applied already")

        def capture_applied() -> None:  # the tables whose step was applied already
            for (_, _, steps), at in zip(parts, steps_at, strict=True):
                steps.run_after(at)

        threading.Thread(target=capture_applied, name="estuary-ps-capture", daemon=True).start()
        files = header.get("files")
        if files is not None:  # write as soon as captured (one request instead of two)
            self._op_snapshot_write({"token": token, "files": files}, {})
        return {"token": token}, {}

    def _op_snapshot_write(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        files = header.get("files")
        if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
            raise PSError("'files' must map table names to file paths")
        self.held.write(self._int(header, "token"), files, self.config.wait_timeout_s)
        return {}, {}

    def _op_snapshot_wait(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        files, chains = self.held.wait(self._int(header, "token"), self.config.wait_timeout_s)
        return {"files": files, "chains": chains}, {}

    def _op_snapshot_drop(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        self.held.drop(self._int(header, "token"))
        return {}, {}

    def _op_apply_delta(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        table, steps = self._table(header)
        with steps.exclusive():
            table.apply_delta(arrays)  # ValueError (wrong base or chain) goes back to the caller
        return {"rows": len(table)}, {}

    def _op_remove(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        table, steps = self._table(header)
        ids = self._array(arrays, "ids", np.int64, 1)
        with steps.exclusive():
            removed = table.remove(ids)
        return {"removed": removed}, {}

    def _op_set_admission_counting(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        table, _ = self._table(header)
        table.set_admission_counting(bool(header.get("enabled", True)))
        return {}, {}

    def _op_shutdown(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        return {}, {}  # the connection thread stops the server after replying

    # -- slot map and migrations (estuary.ps.migration) ----------------------------

    def _op_routing(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        gate = self.routing
        owners = {} if gate.owners is None else {"owners": gate.owners}
        header = {"version": gate.version, "servers": gate.servers, "fenced": gate.fenced}
        if gate.members is not None:
            header["members"] = gate.members
        return header, owners

    def _op_slot_loads(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        # Turns counting on (``count``: the map's slot count); returns the loads so far.
        if header.get("count") is not None:
            self.routing.count_slots(self._int(header, "count"))
        loads = self.routing.take_loads()
        return {"counting": loads is not None}, {} if loads is None else {"loads": loads}

    def _op_set_routing(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        owners = self._array(arrays, "owners", np.int64, 1)
        servers = self._int(header, "servers")
        members = header.get("members")
        if members is not None and not (
            isinstance(members, list)
            and len(members) == servers
            and all(isinstance(m, dict) and {"address", "authkey"} <= m.keys() for m in members)
        ):
            raise PSError(
                f"field 'members' must list {servers} servers as {{address, authkey}}, "
                f"got {members!r}"
            )
        self.routing.set_map(owners, servers, self._int(header, "version"), members)
        return {}, {}

    def _op_fence(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        at = header.get("at")
        if at is not None and not (
            isinstance(at, dict) and all(isinstance(v, int) for v in at.values())
        ):
            raise PSError(f"field 'at' must map table names to steps, got {at!r}")
        return {"fence": self.routing.fence(list(self.tables), at)}, {}

    def _op_lock_moves(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        self.routing.lock_moves(self.config.wait_timeout_s)
        return {}, {}

    def _op_hold_routing(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        self.routing.hold(self.config.wait_timeout_s)
        return {}, {}

    def _op_release_routing(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        self.routing.release()
        return {}, {}

    def _op_chain(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        # Each table's checkpoint chain: [lineage, version] (for a server joining).
        return {"chain": {name: t.chain_keys() for name, t in self.tables.items()}}, {}

    def _op_join(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        # A server added mid-run (a split): its tables start after step
        # ``applied[t]`` on the chain ``chain[t]`` of the servers it joins.
        applied, chain = header.get("applied"), header.get("chain")
        if not isinstance(applied, dict) or not isinstance(chain, dict):
            raise PSError(f"join needs 'applied' and 'chain' per table, got {header!r}")
        for name, table in self.tables.items():
            if name not in applied or name not in chain:
                raise PSError(f"join: no step or chain given for table {name!r}")
            with _naming(name):
                self.steps[name].start_at(int(applied[name]))
                lineage, version = chain[name]
                table.adopt_chain(int(lineage), int(version))
        self.routing.start_at({n: int(s) for n, s in applied.items()})
        return {}, {}

    @staticmethod
    def _captured(steps: StepAggregator) -> None:
        # Snapshots registered for the step applied last are captured before the
        # rows move (they belong to the state before the migration).
        steps.run_after(steps.applied)

    def _op_lift(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        self.routing.lift()
        return {}, {}

    def _op_export_slots(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        table, steps = self._table(header)
        slots = self._array(arrays, "slots", np.int64, 1)
        select = slot_filter(slots, self._int(header, "slot_count"))
        self._captured(steps)
        with steps.exclusive():  # no step lands halfway through the copy
            state = table.export_rows(select)
        return {}, state

    def _op_import_rows(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        table, steps = self._table(header)
        self._captured(steps)
        with steps.exclusive():
            rows = table.import_rows(arrays)
        return {"rows": rows}, {}

    def _op_drop_ids(self, header: Header, arrays: Arrays) -> tuple[Header, Arrays]:
        table, steps = self._table(header)
        ids = self._array(arrays, "ids", np.int64, 1)
        pending = self._array(arrays, "pending", np.int64, 1)
        self._captured(steps)
        with steps.exclusive():
            removed = table.remove(ids)
            forgot = table.forget_pending(pending)
            # Between steps still: the shards the drop left mostly empty give
            # their memory back (a split's source keeps about half its rows);
            # not on a server leaving the job (``compact: false``, a merge).
            below = self.config.compact_below if self._flag(header, "compact", True) else 0.0
            t0 = time.perf_counter()
            done = table.compact(below=below)
            compact_ms = (time.perf_counter() - t0) * 1e3
        freed = sum(d.freed_bytes for d in done)
        reply = {"removed": removed, "pending": forgot, "freed_bytes": freed}
        return {**reply, "compact_ms": compact_ms}, {}


def _error_reply(exc: BaseException) -> Header:
    kind = next((k for t, k in _ERROR_KINDS.items() if isinstance(exc, t)), "error")
    text = str(exc) if isinstance(exc, PSError) else f"{type(exc).__name__}: {exc}"
    return {"ok": False, "kind": kind, "error": text}


@dataclass(frozen=True)
class _Part:
    """One table of a batched request: its name, table, aggregator and ids (N_i,)."""

    name: str
    table: EmbeddingTable
    steps: StepAggregator
    ids: np.ndarray


@contextlib.contextmanager
def _naming(table: str) -> Iterator[None]:
    """Errors raised in the block name ``table`` (a batched request serves many)."""
    try:
        yield
    except PSError as exc:
        if f"table {table!r}" in str(exc):
            raise
        raise type(exc)(f"table {table!r}: {exc}") from exc
    except Exception as exc:
        if not isinstance(exc, ValueError | KeyError | TypeError):
            logger.exception("parameter server: table %r failed", table)
        raise PSError(f"table {table!r}: {type(exc).__name__}: {exc}") from exc


def _stats_reply(table: EmbeddingTable, steps: StepAggregator) -> Header:
    # vars, not dataclasses.asdict: the fields are ints, and asdict's deep copy
    # cost ~16 us a table (0.4 ms of a 26-table stats_many).
    return {"stats": dict(vars(table.stats())), **_step_counters(steps)}


def _step_counters(steps: StepAggregator) -> dict[str, int]:
    return {
        "applied": steps.applied,
        "duplicates": steps.duplicates,
        "pending_steps": steps.pending_steps,
        "waits": steps.waits,
        "max_behind": steps.max_behind,
    }


@contextlib.contextmanager
def serving(config: ServerConfig, **kwargs: Any) -> Iterator[ParameterServer]:
    """An in-process server on a background thread for the ``with`` block (tests)."""
    server = ParameterServer(config, **kwargs).start()
    try:
        yield server
    finally:
        server.close()
