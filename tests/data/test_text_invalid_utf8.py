"""A delimited line with the wrong field count *and* invalid UTF-8 is one bad
row (pyarrow's invalid-row handler cannot decode its text; the reader cleans
such lines and parses the block again), never a failed file."""

from __future__ import annotations

from pathlib import Path

import pytest

from estuary.config.spec import SourceSpec
from estuary.data.badrows import BadRow
from estuary.data.formats import ReadRequest, get_format


def read(
    path: Path, fmt: str, columns: list[str]
) -> tuple[list[list[bytes]], list[int], list[BadRow]]:
    source = SourceSpec(path=path.name, format=fmt)
    request = ReadRequest(
        path=path, display=path.name, source=source, where="w", columns=columns, block_size_bytes=64
    )
    rows: list[list[bytes]] = []
    lines: list[int] = []
    invalid: list[BadRow] = []
    for chunk in get_format(fmt).read(request):
        cols = [chunk.columns[c].to_pylist() for c in columns]
        rows += [list(values) for values in zip(*cols, strict=True)]
        lines += chunk.line_numbers.tolist()
        invalid += chunk.invalid
    return rows, lines, invalid


@pytest.mark.parametrize(("fmt", "sep"), [("csv", b","), ("tsv", b"\t")])
def test_wrong_field_count_with_invalid_utf8_is_one_counted_bad_row(
    tmp_path: Path, fmt: str, sep: bytes
) -> None:
    path = tmp_path / f"bad.{fmt}"
    lines = [b"label,I1,C1", b"1,2,a", b"\xff\xfe", b"1,3,b", b"0,4,\xffok", b"1,\xff", b"0,5,c"]
    path.write_bytes(b"\n".join(line.replace(b",", sep) for line in lines) + b"\n")
    rows, numbers, invalid = read(path, fmt, ["label", "I1", "C1"])
    # Good rows kept, invalid UTF-8 in a good row's value kept as its bytes.
    assert rows == [
        [b"1", b"2", b"a"],
        [b"1", b"3", b"b"],
        [b"0", b"4", b"\xffok"],
        [b"0", b"5", b"c"],
    ]
    assert numbers == [2, 4, 5, 7]
    assert invalid == [
        BadRow(path.name, 3, "expected 3 fields, found 1"),
        BadRow(path.name, 6, "expected 3 fields, found 2"),
    ]
