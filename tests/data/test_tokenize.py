"""The numba tokenizer (``formats.tokenize``) reads unquoted blocks exactly as
pyarrow does (``text._BlockParser._parse``), and the decoder gives the same rows,
ids and bad-row reasons whether it reads a text block's spans in place or the
same columns as Arrow arrays."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from estuary.config.spec import SchemaSpec, SourceSpec
from estuary.data.decode import RowDecoder
from estuary.data.errors import DataFileError
from estuary.data.formats import RawChunk, ReadRequest
from estuary.data.formats.text import Dialect, _BlockParser, count_lines
from estuary.data.formats.tokenize import TextColumns, split_block
from estuary.data.hashing import feature_seed, hash_bytes

NAMES = ["label", "n", "c1", "c2"]
VALUES = [b"", b"0", b"1", b"-2.5", b"1e400", b"nan", b"x", b"\xff", b"\xc3\xa9", b" ", b"ab"]


def parser(delimiter: str, quote: str | bool, columns: list[str]) -> _BlockParser:
    source = SourceSpec(path="f", format="criteo_tsv")
    request = ReadRequest(path=Path("f"), display="f", source=source, where="w", columns=columns)
    return _BlockParser(request, Dialect(delimiter, quote, header=False), NAMES)  # type: ignore[arg-type]


def as_rows(chunk: RawChunk) -> tuple[dict[str, list[bytes]], list[int], list[object]]:
    columns = {
        c: [b"" if v is None else v for v in chunk.columns[c].to_pylist()] for c in chunk.columns
    }
    return columns, chunk.line_numbers.tolist(), list(chunk.invalid)


lines = st.one_of(
    st.just([]),  # an empty line
    st.lists(st.sampled_from(VALUES), min_size=1, max_size=6),  # 4 fields most often below
    st.lists(st.sampled_from(VALUES), min_size=4, max_size=4),
)


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(lines, min_size=1, max_size=8),
    crlf=st.booleans(),
    final_newline=st.booleans(),
    delimiter=st.sampled_from(["\t", ","]),
    columns=st.sampled_from([NAMES, ["c2", "label"], ["n"]]),
)
def test_tokenizer_reads_blocks_like_pyarrow(
    rows: list[list[bytes]], crlf: bool, final_newline: bool, delimiter: str, columns: list[str]
) -> None:
    end = b"\r\n" if crlf else b"\n"
    block = end.join(delimiter.encode().join(fields) for fields in rows)
    block += end if final_newline or not block else b""
    parse = parser(delimiter, False if delimiter == "\t" else '"', columns)
    lines_in_block = count_lines(block)
    fast = parse._split(block, 7, lines_in_block)
    assert fast is not None
    assert isinstance(fast.columns, TextColumns)
    assert as_rows(fast) == as_rows(parse._parse(block, 7, lines_in_block))


@pytest.mark.parametrize(
    "block",
    [b"1\t2\ta\tb\n1\t2\ta\tb\r", b"\xef\xbb\xbf1\t2\ta\tb\n"],
    ids=["final-cr", "bom"],
)
def test_inputs_pyarrow_reads_differently_fall_back_to_it(block: bytes) -> None:
    slots = np.arange(4, dtype=np.int64)
    assert split_block(block, "\t", slots, NAMES, count_lines(block)) is None
    parse = parser("\t", False, NAMES)
    assert as_rows(parse(block, 1, count_lines(block))) == as_rows(
        parse._parse(block, 1, count_lines(block))
    )


def test_a_bare_cr_inside_a_block_is_still_refused() -> None:
    block = b"1\t2\ta\tb\r1\t2\ta\tb\n"
    assert split_block(block, "\t", np.arange(4, dtype=np.int64), NAMES, 1) is None
    with pytest.raises(DataFileError, match="spans several lines"):
        parser("\t", False, NAMES)(block, 1, 1)


def test_quoted_blocks_go_to_pyarrow_and_unquoted_ones_to_the_tokenizer() -> None:
    parse = parser(",", '"', NAMES)
    assert isinstance(parse(b'1,2,"a,b",c\n', 1, 1).columns, dict)
    assert isinstance(parse(b"1,2,a,c\n", 1, 1).columns, TextColumns)


def test_text_columns_are_a_mapping_of_binary_arrays() -> None:
    block = b"1\t2\tab\t\n0\t\t\xff\tz\n"
    split = split_block(block, "\t", np.array([1, -1, 0, -1]), ["c1", "label"], 2)
    assert split is not None
    columns = split.columns
    assert list(columns) == ["c1", "label"] and len(columns) == 2
    assert columns["c1"].type == pa.binary()
    assert columns["c1"].to_pylist() == [b"ab", b"\xff"]
    assert columns["label"].to_pylist() == [b"1", b"0"]
    assert columns["c1"] is columns["c1"]  # built once
    with pytest.raises(KeyError):
        columns["n"]


def test_decoding_spans_in_place_matches_decoding_arrays() -> None:
    schema = SchemaSpec(
        label="label", dense=["n"], sparse=["c1", "c2"], transforms={"c2": "hour_of_day"}
    )
    decoder = RowDecoder(schema)
    rows = [
        b"1\t3\tab\t14102100",
        b"0\t\t\t14102113",
        b"2\t3\tx\t14102100",  # bad label
        b"1\tnan\tx\t14102100",  # not finite
        b"1\t1e400\tx\t14102100",  # overflows float64: not finite
        b"0\t123456789012345678901234\tq\t14102100",  # > 17 digits: the exact slow path
        b"1\t4\tx\tbad",  # the transform rejects it
        b"0\t0.5\t\xff\t",
    ]
    block = b"\n".join(rows) + b"\n"
    parse = parser("\t", False, decoder.columns)
    chunk = parse(block, 1, len(rows))
    assert isinstance(chunk.columns, TextColumns)
    arrays = RawChunk(
        chunk.file, {c: chunk.columns[c] for c in chunk.columns}, chunk.line_numbers, []
    )
    fast, slow = decoder.decode(chunk, 10), decoder.decode(arrays, 10)
    np.testing.assert_array_equal(fast.labels, slow.labels)
    np.testing.assert_array_equal(fast.dense, slow.dense)
    np.testing.assert_array_equal(fast.ids, slow.ids)
    assert fast.bad_examples == slow.bad_examples
    assert [bad.line for bad in fast.bad_examples] == [3, 4, 5, 7]
    assert fast.ids[:, 0].tolist() == [
        hash_bytes(value, feature_seed("c1")) for value in [b"ab", b"", b"q", b"\xff"]
    ]
    assert fast.dense[2, 0] == np.float32(np.log1p(123456789012345678901234.0))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.sampled_from([b"", b"\n", b"\r\n", b"x"]))
def test_count_lines_counts_newlines_like_bytes_count(body: bytes, tail: bytes) -> None:
    block = body + tail
    assert count_lines(block) == block.count(b"\n") + (0 if block.endswith(b"\n") else 1)
