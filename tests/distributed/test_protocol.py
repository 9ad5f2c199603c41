"""The wire format: JSON header + raw array frames, nothing unpickled."""

from __future__ import annotations

import json
from multiprocessing import Pipe

import numpy as np
import pytest

from estuary.ps import ProtocolError
from estuary.ps.protocol import recv_message, send_message


def test_arrays_and_header_round_trip_exactly() -> None:
    a, b = Pipe()
    arrays = {
        "ids": np.array([0, -1, 2**62, -(2**63)], np.int64),
        "grads": np.arange(12, dtype=np.float32).reshape(4, 3),
        "empty": np.empty((0, 3), np.float32),
        "flags": np.array([True, False]),
        "strided": np.arange(10, dtype=np.float64)[::2],  # non-contiguous is sent contiguous
    }
    send_message(a, {"op": "push", "step": 3, "table": "t"}, arrays)
    header, got = recv_message(b)
    assert header == {"op": "push", "step": 3, "table": "t"}
    assert list(got) == list(arrays)
    for name, value in arrays.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape
        np.testing.assert_array_equal(got[name], value)
        assert got[name].flags.writeable and got[name].flags.c_contiguous


def test_object_arrays_cannot_be_sent() -> None:
    a, _ = Pipe()
    with pytest.raises(ProtocolError, match="cannot be sent"):
        send_message(a, {"op": "x"}, {"bad": np.array([object()])})


@pytest.mark.parametrize(
    ("header", "match"),
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (json.dumps({"arrays": {"a": 1}}).encode(), "must be a list"),
        (json.dumps({"arrays": [{"name": "a", "dtype": "|O", "shape": [1]}]}).encode(), "dtype"),
        (json.dumps({"arrays": [{"name": "a", "dtype": "<f4", "shape": [-1]}]}).encode(), "shape"),
        (
            json.dumps({"arrays": [{"name": "a", "dtype": "<f4", "shape": [1 << 40]}]}).encode(),
            "more than",
        ),
    ],
)
def test_malformed_headers_are_protocol_errors(header: bytes, match: str) -> None:
    a, b = Pipe()
    a.send_bytes(header)
    with pytest.raises(ProtocolError, match=match):
        recv_message(b)


def test_array_frame_of_the_wrong_size_is_a_protocol_error() -> None:
    a, b = Pipe()
    a.send_bytes(json.dumps({"arrays": [{"name": "a", "dtype": "<i8", "shape": [2]}]}).encode())
    a.send_bytes(b"\x00" * 8)  # one int64, not two
    with pytest.raises(ProtocolError, match="8 bytes for shape"):
        recv_message(b)
