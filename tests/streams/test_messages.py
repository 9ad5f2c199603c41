"""Messages -> RawChunk: one message is one good row or one bad row, never less.

No server needed: messages are built in memory.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from estuary.config.errors import ConfigError
from estuary.data.decode import RowDecoder
from estuary.data.formats.criteo_tsv import CRITEO_COLUMNS
from estuary.data.streams import MessageParser, StreamMessage
from estuary.testing.streams import COLUMNS, SCHEMA


def messages(payloads: list[bytes], first: int = 101) -> list[StreamMessage]:
    """Messages with offsets first, first + 1, ..."""
    return [StreamMessage(first + i, p, 1_700_000_000_000 + i) for i, p in enumerate(payloads)]


def ids(parser: MessageParser, payloads: list[bytes]) -> list[bytes]:
    return parser.parse(messages(payloads), 0).raw.columns["row_id"].to_pylist()


def encode(fmt: str, i: int) -> bytes:
    """Row ``i`` (row_id, label, I1, C1) in message format ``fmt``."""
    fields = [str(i), str(i % 2), str(i % 10), f"c{i % 7}"]
    if fmt == "jsonl":
        return json.dumps(dict(zip(COLUMNS, fields, strict=True))).encode()
    return ("," if fmt == "csv" else "\t").join(fields).encode()


def parser_for(fmt: str) -> MessageParser:
    names = None if fmt == "jsonl" else COLUMNS
    return MessageParser(fmt, COLUMNS, names, source="clicks")


def test_criteo_messages_use_the_criteo_columns_by_default() -> None:
    fields = ["1", *map(str, range(13)), *(f"{c:08x}" for c in range(26))]
    parser = MessageParser("criteo_tsv", ["label", "I5", "C26"], source="clicks")
    chunk = parser.parse(messages(["\t".join(fields).encode()]), 0)
    assert [chunk.raw.columns[c].to_pylist() for c in ("label", "I5", "C26")] == [
        [b"1"],
        [b"4"],
        [b"00000019"],
    ]
    assert len(CRITEO_COLUMNS) == len(fields)


def test_csv_messages_are_quoted_csv_without_a_header() -> None:
    parser = parser_for("csv")
    assert ids(parser, [b'"1,5",0,3,c', b"2,1,4,d"]) == [b"1,5", b"2"]


@pytest.mark.parametrize("fmt", ["csv", "tsv", "jsonl"])
def test_rows_keep_message_order_and_map_to_offsets(fmt: str) -> None:
    parser = parser_for(fmt)
    chunk = parser.parse(messages([encode(fmt, i) for i in range(5)]), 0)
    # csv/tsv give the text (b"3"); jsonl numbers stay int64 (see formats.values).
    assert [int(v) for v in chunk.raw.columns["row_id"].to_pylist()] == list(range(5))
    assert chunk.row_offsets() == [101, 102, 103, 104, 105]
    assert chunk.position == 105
    np.testing.assert_array_equal(chunk.timestamps_ms, 1_700_000_000_000 + np.arange(5))


def test_jsonl_bad_messages_are_bad_rows_and_missing_keys_are_missing_values() -> None:
    parser = parser_for("jsonl")
    payloads = [
        b'{"row_id": 1, "label": 0}',  # I1, C1 missing: fine
        b'{"row_id": 2, "label": ',  # not JSON
        b"[1, 2]",  # not an object
        b'{"row_id": 4, "label": 1, "C1": [1]}',  # an array under a column
        b'{"row_id": 5, "label": 1}',
    ]
    chunk = parser.parse(messages(payloads), 0)
    assert chunk.raw.columns["row_id"].to_pylist() == [1, 5]
    bad = chunk.bad_rows(chunk.raw.invalid)
    assert [str(b).partition(": ")[0] for b in bad] == [
        "source 'clicks' offset 102",
        "source 'clicks' offset 103",
        "source 'clicks' offset 104",
    ]
    assert "not valid JSON" in bad[0].reason and "not a JSON object" in bad[1].reason


def test_a_bad_message_never_takes_good_ones_down() -> None:
    parser = parser_for("csv")
    payloads = [encode("csv", 0), b'1,0,"unterminated,c', encode("csv", 2), b"3,1\n4,0,1,c"]
    chunk = parser.parse(messages(payloads), 0)
    assert chunk.raw.columns["row_id"].to_pylist() == [b"0", b"2"]
    assert [b.line for b in chunk.raw.invalid] == [2, 4]
    assert "line break" in chunk.raw.invalid[1].reason


def test_messages_without_a_payload_and_empty_ones_are_bad_rows() -> None:
    parser = parser_for("tsv")
    msgs = [
        StreamMessage("5-0", b"", problem="entry has no 'data' field"),
        StreamMessage("6-0", b"  \r\n"),
    ]
    chunk = parser.parse(msgs, "4-0")
    assert chunk.num_rows == 0 and chunk.raw.rows_read == 2
    assert [str(b) for b in chunk.bad_rows(chunk.raw.invalid)] == [
        "source 'clicks' offset 5-0: entry has no 'data' field",
        "source 'clicks' offset 6-0: empty message",
    ]
    decoded = RowDecoder(SCHEMA).decode(chunk.raw, max_examples=5)
    assert (decoded.rows_read, decoded.bad_count) == (2, 2)


def test_no_messages_is_an_empty_chunk_at_the_given_position() -> None:
    chunk = parser_for("csv").parse([], "17-3")
    assert (chunk.num_messages, chunk.num_rows, chunk.position) == (0, 0, "17-3")


def test_parser_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"^s\.format: format 'xml' is unknown"):
        MessageParser("xml", COLUMNS, source="x", where="s")
    with pytest.raises(ConfigError, match=r"^s\.columns: format 'csv' needs column names"):
        MessageParser("csv", COLUMNS, source="x", where="s")
    with pytest.raises(ConfigError, match=r"column 'C9' is not in the messages of 'x'"):
        MessageParser("csv", ["C9"], COLUMNS, source="x", where="s")


_GOOD = st.integers(0, 10**9).map(lambda i: ("good", i))
_JUNK = st.binary(max_size=24).map(lambda b: ("junk", b))
_TEXT_JUNK = st.text(alphabet=',\t"{}[]:01x \r\n\\', max_size=16).map(
    lambda t: ("junk", t.encode())
)


@settings(max_examples=150, deadline=None)
@given(
    fmt=st.sampled_from(["csv", "tsv", "jsonl"]),
    items=st.lists(st.one_of(_GOOD, _JUNK, _TEXT_JUNK), max_size=30),
)
def test_every_message_is_exactly_one_row_or_one_bad_row(
    fmt: str, items: list[tuple[str, object]]
) -> None:
    payloads = [encode(fmt, v) if kind == "good" else v for kind, v in items]  # type: ignore[arg-type]
    chunk = parser_for(fmt).parse(messages(payloads, first=1), 0)  # type: ignore[arg-type]
    good = chunk.raw.line_numbers.tolist()
    bad = [b.line for b in chunk.raw.invalid]
    assert sorted(good + bad) == list(range(1, len(items) + 1))  # each once
    assert good == sorted(good) and bad == sorted(bad)
    row_of = dict(zip(good, chunk.raw.columns["row_id"].to_pylist(), strict=True))
    for number, (kind, value) in enumerate(items, start=1):
        if kind == "good":  # never lost, and read as itself
            assert row_of[number] in (value, str(value).encode())
