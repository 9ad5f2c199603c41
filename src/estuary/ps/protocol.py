"""The parameter server's wire format: one JSON header frame, then one raw frame
per array. Nothing on the wire is ever unpickled.

::

    frame 0   UTF-8 JSON object, at most MAX_HEADER_BYTES, e.g.
              {"op": "push", "table": "C1", "step": 3, "rank": 0, "lr_scale": 1.0,
               "arrays": [{"name": "ids",   "dtype": "<i8", "shape": [N]},
                          {"name": "grads", "dtype": "<f4", "shape": [N, D]}]}
    frame 1.. each array's bytes, C order, in the header's order

Frames are ``multiprocessing.connection`` messages (length-prefixed); the
connection proved it holds the ``authkey`` (an HMAC challenge) when it opened.
Replies have the same shape with ``"ok": true`` or ``"ok": false, "kind": ...,
"error": "..."``. Cost: the receiving side copies each array twice (socket ->
buffer -> array), ~1 ms for 16 MB.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping
from multiprocessing import BufferTooShort
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from estuary.ps.types import ProtocolError

# 2: lookup_many, push_many; 3: lr_scale(s) on push(_many); 4: state_dict mark,
# snapshot ops; 5: slot-map routing version and migration ops (estuary.ps.migration);
# 6: chain and join ops, set_routing/routing members (servers added or retired);
# 7: stats_many
PROTOCOL_VERSION = 7
MAX_HEADER_BYTES = 1 << 20
MAX_ARRAY_BYTES = 1 << 34  # 16 GiB per message: a bound, not an expectation
# Little-endian (or byte-order-free) numeric dtypes only, by their ``dtype.str``.
ALLOWED_DTYPES = frozenset(
    ["|b1", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f2", "<f4", "<f8"]
)

Header = dict[str, Any]
Arrays = dict[str, np.ndarray]


def _as_wire_array(name: str, value: np.ndarray) -> np.ndarray:
    array = np.ascontiguousarray(value)
    if array.dtype.str not in ALLOWED_DTYPES:
        array = array.astype(array.dtype.newbyteorder("<"))
        if array.dtype.str not in ALLOWED_DTYPES:
            raise ProtocolError(f"array {name!r}: dtype {value.dtype} cannot be sent")
    return array


def send_message(
    conn: Connection, header: Mapping[str, Any], arrays: Mapping[str, np.ndarray] | None = None
) -> None:
    """Send ``header`` (JSON-able) and ``arrays`` (name -> array) as one message."""
    wire = {name: _as_wire_array(name, value) for name, value in (arrays or {}).items()}
    meta = [{"name": k, "dtype": a.dtype.str, "shape": list(a.shape)} for k, a in wire.items()]
    conn.send_bytes(json.dumps({**header, "arrays": meta}).encode())
    for array in wire.values():
        conn.send_bytes(array.reshape(-1).view(np.uint8).data)


def _array_meta(meta: Any) -> tuple[str, np.dtype[Any], tuple[int, ...]]:
    if not isinstance(meta, dict):
        raise ProtocolError(f"array entry must be an object, got {type(meta).__name__}")
    name, dtype, shape = meta.get("name"), meta.get("dtype"), meta.get("shape")
    if not isinstance(name, str):
        raise ProtocolError("array entry needs a string 'name'")
    if dtype not in ALLOWED_DTYPES:
        raise ProtocolError(f"array {name!r}: dtype {dtype!r} is not allowed")
    if (
        not isinstance(shape, list)
        or len(shape) > 8
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
    ):
        raise ProtocolError(f"array {name!r}: shape must be a list of <= 8 ints >= 0")
    return name, np.dtype(dtype), tuple(shape)


def recv_message(
    conn: Connection, *, max_array_bytes: int = MAX_ARRAY_BYTES
) -> tuple[Header, Arrays]:
    """Receive one message -> (header without ``arrays``, name -> fresh writable array).

    Raises:
        ProtocolError: the message broke the format (the connection must be closed:
            later frames can no longer be told apart).
        EOFError, OSError: the peer closed the connection.
    """
    raw = conn.recv_bytes(MAX_HEADER_BYTES)
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise ProtocolError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header must be a JSON object")
    metas = header.pop("arrays", [])
    if not isinstance(metas, list):
        raise ProtocolError("'arrays' must be a list")
    parsed = [_array_meta(m) for m in metas]
    total = sum(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize for _, dtype, shape in parsed)
    if total > max_array_bytes:
        raise ProtocolError(f"arrays total {total} bytes, more than {max_array_bytes}")
    arrays: Arrays = {}
    for name, dtype, shape in parsed:
        array = np.empty(shape, dtype)
        try:
            size = conn.recv_bytes_into(array.reshape(-1).view(np.uint8))
        except BufferTooShort:
            raise ProtocolError(f"array {name!r}: more bytes than its shape {shape}") from None
        if size != array.nbytes:
            raise ProtocolError(f"array {name!r}: {size} bytes for shape {shape} {dtype}")
        arrays[name] = array
    return header, arrays


def set_nodelay(conn: Connection) -> None:
    """Turn off Nagle's algorithm on a TCP connection (a header frame followed by a
    small array frame would otherwise wait ~40 ms for a delayed ACK); no-op for
    other families."""
    try:
        sock = socket.socket(fileno=conn.fileno())
    except OSError:
        return
    try:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        sock.detach()  # the fd stays owned by ``conn``


def wake_reader(conn: Connection) -> None:
    """Shut ``conn``'s socket down so a thread blocked reading it sees EOF (closing
    the fd alone does not wake it). The caller still closes ``conn``."""
    try:
        sock = socket.socket(fileno=conn.fileno())
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.detach()
