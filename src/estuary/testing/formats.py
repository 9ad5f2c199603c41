"""The conformance suite every format reader passes; a new format's tests
subclass one of three levels and say how to write a file in the format:

- ``FormatConformance``: every reader (Parquet too, where a "line" is a row);
- ``TextConformance``: line-based formats (compression, blank lines, CRLF);
- ``DelimitedConformance``: delimited text (rows with the wrong field count).

    from estuary.testing.formats import DelimitedConformance

    class TestPsv(DelimitedConformance):
        format_name = "psv"   # the registered format
        sep, header = "|", True

Files use 4 columns (``COLUMNS``)::

    label  n   c1  c2        (header-less formats get them through SourceSpec.columns)
"""

from __future__ import annotations

import gzip
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import pytest

from estuary.config.errors import ConfigError
from estuary.config.spec import SourceSpec
from estuary.data.badrows import BadRow
from estuary.data.errors import DataFileError
from estuary.data.formats import RawChunk, ReadRequest, available_formats, get_format
from estuary.data.formats.values import to_text

__all__ = [
    "COLUMNS",
    "DelimitedConformance",
    "FormatConformance",
    "TextConformance",
    "is_raw_column",
    "make_rows",
    "read_all",
    "write_text",
]


def write_text(path: Path, text: str | bytes, compression: str | None = None) -> Path:
    """Write ``text`` to ``path``, gzip- or zstd-compressed if asked."""
    data = text.encode() if isinstance(text, str) else text
    if compression == "gzip":
        data = gzip.compress(data)
    elif compression == "zstd":
        sink = pa.BufferOutputStream()
        with pa.CompressedOutputStream(sink, "zstd") as out:
            out.write(data)
        data = sink.getvalue().to_pybytes()
    path.write_bytes(data)
    return path


COLUMNS = ["label", "n", "c1", "c2"]


def make_rows(n: int) -> list[list[str]]:
    return [[str(i % 2), str(i), f"a{i}", "" if i % 3 == 0 else f"b{i}"] for i in range(n)]


def read_all(
    chunks: Sequence[RawChunk], columns: Sequence[str] = COLUMNS
) -> tuple[list[list[str]], list[int], list[BadRow]]:
    """(rows as text, line numbers, rejected rows) over all chunks; null reads as ""."""
    rows: list[list[str]] = []
    lines: list[int] = []
    invalid: list[BadRow] = []
    for chunk in chunks:
        for c in columns:
            assert is_raw_column(chunk.columns[c]), (c, chunk.columns[c].type)
            assert len(chunk.columns[c]) == chunk.num_rows
        cols = [to_text(chunk.columns[c]).to_pylist() for c in columns]
        rows += [[(v or b"").decode() for v in values] for values in zip(*cols, strict=True)]
        lines += chunk.line_numbers.tolist()
        invalid += chunk.invalid
        assert chunk.line_numbers.dtype == np.int64
    return rows, lines, invalid


def is_raw_column(values: pa.Array) -> bool:
    """One of the RawChunk column kinds: binary text, a dictionary of it, int64."""
    kind = values.type
    if pa.types.is_dictionary(kind):
        return kind.value_type == pa.binary()
    return kind in (pa.binary(), pa.int64())


class FormatConformance(ABC):
    """Shared tests for every reader; subclasses set the format and how to write it."""

    format_name: ClassVar[str]
    first_line: ClassVar[int] = 1  # line (or row) number of the first data row
    source_columns: ClassVar[list[str] | None] = None  # names for header-less formats

    @abstractmethod
    def write(self, path: Path, rows: Sequence[list[str]], compression: str | None = None) -> Path:
        """Write ``rows`` (text values of COLUMNS, "" = missing) in the format."""

    def read(
        self,
        path: Path,
        columns: Sequence[str] = COLUMNS,
        *,
        compression: str = "auto",
        source_columns: list[str] | None = None,
        **kw: Any,
    ) -> list[RawChunk]:
        source = SourceSpec(
            path=str(path),
            format=self.format_name,
            columns=source_columns or self.source_columns,
            compression=compression,  # type: ignore[arg-type]
        )
        request = ReadRequest(
            path=path,
            display=path.name,
            source=source,
            where="data.sources[0]",
            columns=columns,
            **kw,
        )
        return list(get_format(self.format_name).read(request))

    def test_is_registered(self) -> None:
        assert self.format_name in available_formats()
        assert get_format(self.format_name).name == self.format_name

    @pytest.mark.parametrize("threads", [1, 3])
    def test_reads_every_row_with_its_line_number(self, tmp_path: Path, threads: int) -> None:
        rows = make_rows(50)
        path = self.write(tmp_path / "f.txt", rows)
        # Tiny blocks: many block boundaries, parsed out of order on 3 threads.
        chunks = self.read(path, block_size_bytes=40, threads=threads)
        assert len(chunks) > 5
        got, lines, invalid = read_all(chunks)
        assert got == rows
        assert lines == list(range(self.first_line, self.first_line + 50))
        assert invalid == []

    def test_returns_only_requested_columns_in_order(self, tmp_path: Path) -> None:
        path = self.write(tmp_path / "f.txt", make_rows(3))
        (chunk,) = self.read(path, columns=["c2", "label"])
        assert list(chunk.columns) == ["c2", "label"]
        assert to_text(chunk.columns["label"]).to_pylist() == [b"0", b"1", b"0"]

    def test_empty_file_has_no_rows(self, tmp_path: Path) -> None:
        path = write_text(tmp_path / "empty.txt", "")
        assert read_all(self.read(path))[0] == []

    def test_unknown_column_is_a_config_error(self, tmp_path: Path) -> None:
        path = self.write(tmp_path / "f.txt", make_rows(2))
        with pytest.raises(ConfigError, match=r"data\.schema: column 'nope' is not in f\.txt"):
            self.read(path, columns=["label", "nope"])

    def test_missing_file_names_it(self, tmp_path: Path) -> None:
        with pytest.raises(DataFileError, match=r"gone\.txt: file not found"):
            self.read(tmp_path / "gone.txt")


class TextConformance(FormatConformance):
    """Line-based formats: one row per line, compressed streams, blank lines."""

    header_line: ClassVar[str | None] = None  # written first, if the format has one

    @abstractmethod
    def format_line(self, row: list[str]) -> str:
        """One row as one line of the format (no newline)."""

    @property
    def first_line(self) -> int:  # type: ignore[override]
        return 2 if self.header_line is not None else 1

    def write_lines(self, path: Path, lines: Sequence[str], compression: str | None = None) -> Path:
        """Write data lines (already formatted), adding the header row if the format has one."""
        head = [self.header_line] if self.header_line is not None else []
        return write_text(path, "".join(line + "\n" for line in head + list(lines)), compression)

    def write(self, path: Path, rows: Sequence[list[str]], compression: str | None = None) -> Path:
        return self.write_lines(path, [self.format_line(r) for r in rows], compression)

    def test_blank_lines_are_skipped_but_counted(self, tmp_path: Path) -> None:
        rows = make_rows(4)
        lines = [self.format_line(r) for r in rows]
        text = [lines[0], "", lines[1], "\r", "", lines[2], lines[3], ""]
        path = self.write_lines(tmp_path / "f.txt", text)
        got, numbers, invalid = read_all(self.read(path, block_size_bytes=16))
        assert got == rows
        base = self.first_line
        assert numbers == [base, base + 2, base + 5, base + 6]
        assert invalid == []

    @pytest.mark.parametrize(
        ("suffix", "compression", "setting"),
        [
            (".txt", None, "auto"),
            (".gz", "gzip", "auto"),
            (".zst", "zstd", "auto"),
            (".data", "gzip", "gzip"),
            (".data", "zstd", "zstd"),
            (".gz", None, "none"),
        ],
    )
    def test_reads_plain_gzip_and_zstd(
        self, tmp_path: Path, suffix: str, compression: str | None, setting: str
    ) -> None:
        rows = make_rows(30)
        path = self.write(tmp_path / f"f{suffix}", rows, compression)
        got, _, _ = read_all(self.read(path, compression=setting, block_size_bytes=50))
        assert got == rows

    def test_truncated_gzip_names_the_file(self, tmp_path: Path) -> None:
        rows = make_rows(3000)
        path = self.write(tmp_path / "cut.gz", rows, "gzip")
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        with pytest.raises(DataFileError, match=r"cut\.gz: truncated or corrupt gzip stream"):
            self.read(path)

    def test_empty_gzip_has_no_rows(self, tmp_path: Path) -> None:
        gz = write_text(tmp_path / "empty.gz", "", "gzip")
        assert read_all(self.read(gz))[0] == []

    def test_crlf_and_missing_final_newline(self, tmp_path: Path) -> None:
        rows = make_rows(5)
        head = [self.header_line] if self.header_line is not None else []
        text = "\r\n".join(head + [self.format_line(r) for r in rows])  # no final newline
        path = write_text(tmp_path / "crlf.txt", text)
        got, numbers, _ = read_all(self.read(path, block_size_bytes=20))
        assert got == rows
        assert numbers == list(range(self.first_line, self.first_line + 5))


class DelimitedConformance(TextConformance):
    """Delimited text: a row with the wrong number of fields is rejected by the reader."""

    sep: ClassVar[str]
    header: ClassVar[bool]

    @property
    def header_line(self) -> str | None:  # type: ignore[override]
        return self.sep.join(COLUMNS) if self.header else None

    def format_line(self, row: list[str]) -> str:
        return self.sep.join(row)

    def test_wrong_field_count_is_reported_with_its_line(self, tmp_path: Path) -> None:
        rows = make_rows(6)
        lines = [self.sep.join(r) for r in rows]
        lines.insert(2, self.sep.join(["1", "2", "x"]))
        lines.insert(5, "")
        lines.insert(6, self.sep.join(["1", "2", "x", "y", "z"]))
        path = self.write_lines(tmp_path / "bad.txt", lines)
        for threads in (1, 2):
            got, numbers, invalid = read_all(self.read(path, block_size_bytes=24, threads=threads))
            assert got == rows  # the good rows around the bad ones are all kept
            base = self.first_line
            assert invalid == [
                BadRow("bad.txt", base + 2, "expected 4 fields, found 3"),
                BadRow("bad.txt", base + 6, "expected 4 fields, found 5"),
            ]
            assert numbers == [base, base + 1, base + 3, base + 4, base + 7, base + 8]
