"""Conformance suite every text format reader passes, plus format-specific cases.

Each subclass of ``FormatConformance`` says how to write a file in its format;
the shared tests then check rows, physical line numbers, rejected rows,
compression and failure messages. Files here use 4 columns::

    label  n   c1  c2        (criteo_tsv gets them through SourceSpec.columns)
"""

from __future__ import annotations

import gzip
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from estuary.config.errors import ConfigError
from estuary.config.spec import SourceSpec
from estuary.data.badrows import BadRow
from estuary.data.errors import DataFileError
from estuary.data.formats import RawChunk, ReadRequest, available_formats, get_format

from .ctr_datagen import CRITEO_COLUMNS, criteo_rows, join_rows, write_text

COLUMNS = ["label", "n", "c1", "c2"]


def make_rows(n: int) -> list[list[str]]:
    return [[str(i % 2), str(i), f"a{i}", "" if i % 3 == 0 else f"b{i}"] for i in range(n)]


def read_all(
    chunks: Sequence[RawChunk], columns: Sequence[str] = COLUMNS
) -> tuple[list[list[str]], list[int], list[BadRow]]:
    """(rows as text, line numbers, rejected rows) over all chunks."""
    rows: list[list[str]] = []
    lines: list[int] = []
    invalid: list[BadRow] = []
    for chunk in chunks:
        cols = [chunk.columns[c].to_pylist() for c in columns]
        rows += [[v.decode() for v in values] for values in zip(*cols, strict=True)]
        lines += chunk.line_numbers.tolist()
        invalid += chunk.invalid
        assert chunk.line_numbers.dtype == np.int64
    return rows, lines, invalid


class FormatConformance:
    """Shared tests; subclasses set the format and how lines are written."""

    format_name: ClassVar[str]
    sep: ClassVar[str]
    header: ClassVar[bool]

    @property
    def first_line(self) -> int:
        return 2 if self.header else 1

    source_columns: ClassVar[list[str] | None] = None  # names for header-less formats

    def write_lines(self, path: Path, lines: Sequence[str], compression: str | None = None) -> Path:
        """Write data lines (already joined), adding the header row if the format has one."""
        head = [self.sep.join(COLUMNS)] if self.header else []
        return write_text(path, "".join(line + "\n" for line in head + list(lines)), compression)

    def write(self, path: Path, rows: Sequence[list[str]], compression: str | None = None) -> Path:
        return self.write_lines(path, [self.sep.join(r) for r in rows], compression)

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
            format=self.format_name,  # type: ignore[arg-type]
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
        assert chunk.columns["label"].to_pylist() == [b"0", b"1", b"0"]

    def test_blank_lines_are_skipped_but_counted(self, tmp_path: Path) -> None:
        rows = make_rows(4)
        lines = [self.sep.join(r) for r in rows]
        text = [lines[0], "", lines[1], "\r", "", lines[2], lines[3], ""]
        path = self.write_lines(tmp_path / "f.txt", text)
        got, numbers, invalid = read_all(self.read(path, block_size_bytes=16))
        assert got == rows
        base = self.first_line
        assert numbers == [base, base + 2, base + 5, base + 6]
        assert invalid == []

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

    def test_empty_file_has_no_rows(self, tmp_path: Path) -> None:
        path = write_text(tmp_path / "empty.txt", "")
        assert read_all(self.read(path))[0] == []
        gz = write_text(tmp_path / "empty.gz", "", "gzip")
        assert read_all(self.read(gz))[0] == []

    def test_crlf_and_missing_final_newline(self, tmp_path: Path) -> None:
        rows = make_rows(5)
        head = [self.sep.join(COLUMNS)] if self.header else []
        text = "\r\n".join(head + [self.sep.join(r) for r in rows])  # no final newline
        path = write_text(tmp_path / "crlf.txt", text)
        got, numbers, _ = read_all(self.read(path, block_size_bytes=20))
        assert got == rows
        assert numbers == list(range(self.first_line, self.first_line + 5))

    def test_unknown_column_is_a_config_error(self, tmp_path: Path) -> None:
        path = self.write(tmp_path / "f.txt", make_rows(2))
        with pytest.raises(ConfigError, match=r"data\.schema: column 'nope' is not in f\.txt"):
            self.read(path, columns=["label", "nope"])

    def test_missing_file_names_it(self, tmp_path: Path) -> None:
        with pytest.raises(DataFileError, match=r"gone\.txt: file not found"):
            self.read(tmp_path / "gone.txt")


class TestCriteoTsv(FormatConformance):
    format_name = "criteo_tsv"
    sep = "\t"
    header = False

    source_columns = COLUMNS

    def test_default_columns_are_label_i1_i13_c1_c26(self, tmp_path: Path) -> None:
        rows = criteo_rows(20)
        path = write_text(tmp_path / "day0.tsv", join_rows(rows, "\t"))
        request = ReadRequest(
            path=path,
            display="day0.tsv",
            source=SourceSpec(path=str(path)),
            where="data.sources[0]",
            columns=CRITEO_COLUMNS,
        )
        got, _, _ = read_all(list(get_format("criteo_tsv").read(request)), CRITEO_COLUMNS)
        assert got == rows


class TestCsv(FormatConformance):
    format_name = "csv"
    sep = ","
    header = True

    def test_quoted_values_may_hold_the_delimiter(self, tmp_path: Path) -> None:
        path = write_text(tmp_path / "q.csv", 'label,n,c1,c2\n1,2,"a,b",""\n')
        got, _, _ = read_all(self.read(path))
        assert got == [["1", "2", "a,b", ""]]

    def test_a_quoted_newline_is_refused_not_misnumbered(self, tmp_path: Path) -> None:
        path = write_text(tmp_path / "q.csv", 'label,n,c1,c2\n1,2,"a\nb",c\n0,1,x,y\n')
        with pytest.raises(DataFileError, match=r"q\.csv: a row spans several lines"):
            self.read(path)

    def test_header_with_bom_and_header_only_file(self, tmp_path: Path) -> None:
        path = write_text(tmp_path / "bom.csv", b"\xef\xbb\xbflabel,n,c1,c2\n1,2,3,4\n")
        assert read_all(self.read(path))[0] == [["1", "2", "3", "4"]]
        only = write_text(tmp_path / "head.csv", "label,n,c1,c2\n")
        assert read_all(self.read(only))[0] == []

    def test_columns_setting_is_refused_for_header_formats(self, tmp_path: Path) -> None:
        path = self.write(tmp_path / "f.csv", make_rows(1))
        with pytest.raises(ConfigError, match=r"data\.sources\[0\]\.columns: not used"):
            self.read(path, columns=["label"], source_columns=["a"])

    def test_duplicate_header_names_are_refused(self, tmp_path: Path) -> None:
        path = write_text(tmp_path / "d.csv", "label,a,a\n1,2,3\n")
        with pytest.raises(DataFileError, match=r"d\.csv:1: duplicate column names \['a'\]"):
            self.read(path, columns=["label"])


class TestTsv(FormatConformance):
    format_name = "tsv"
    sep = "\t"
    header = True


def test_registry_lists_the_text_formats_and_refuses_others() -> None:
    assert {"criteo_tsv", "csv", "tsv"} <= set(available_formats())
    with pytest.raises(ConfigError, match="format 'parquet' is not implemented yet"):
        get_format("parquet", "data.sources[0].format")
    with pytest.raises(ConfigError, match=r"data\.sources\[1\]\.format: format 'xls' is unknown"):
        get_format("xls", "data.sources[1].format")


def test_gzip_of_many_members_reads_as_one_stream(tmp_path: Path) -> None:
    rows = make_rows(10)
    path = tmp_path / "multi.gz"
    path.write_bytes(
        gzip.compress(join_rows(rows[:4], "\t").encode())
        + gzip.compress(join_rows(rows[4:], "\t").encode())
    )
    source = SourceSpec(path=str(path), columns=COLUMNS)
    request = ReadRequest(path=path, display="multi.gz", source=source, where="w", columns=COLUMNS)
    assert read_all(list(get_format("criteo_tsv").read(request)))[0] == rows


LINE_KINDS = st.sampled_from(["good", "good", "good", "blank", "cr", "short", "long"])


@settings(max_examples=60, deadline=None)
@given(
    kinds=st.lists(LINE_KINDS, max_size=40),
    block_size=st.integers(1, 120),
    threads=st.sampled_from([1, 3]),
    final_newline=st.booleans(),
)
def test_line_numbers_match_a_line_by_line_reference(
    tmp_path_factory: pytest.TempPathFactory,
    kinds: list[str],
    block_size: int,
    threads: int,
    final_newline: bool,
) -> None:
    """Any mix of good, blank and wrong-width lines, cut into any block size."""
    text_of = {"blank": "", "cr": "\r", "short": "1\t2\t3", "long": "1\t2\t3\t4\t5"}
    lines, good, bad = [], [], []
    for number, kind in enumerate(kinds, start=1):
        if kind == "good":
            row = ["1", str(number), f"a{number}", ""]
            lines.append("\t".join(row))
            good.append((row, number))
        else:
            lines.append(text_of[kind])
            if kind in ("short", "long"):
                bad.append(number)
    text = "\n".join(lines) + ("\n" if final_newline and lines else "")
    path = write_text(tmp_path_factory.mktemp("lines") / "f.tsv", text)
    source = SourceSpec(path=str(path), columns=COLUMNS)
    request = ReadRequest(
        path=path,
        display="f.tsv",
        source=source,
        where="w",
        columns=COLUMNS,
        block_size_bytes=block_size,
        threads=threads,
    )
    rows, numbers, invalid = read_all(list(get_format("criteo_tsv").read(request)))
    assert rows == [row for row, _ in good]
    assert numbers == [number for _, number in good]
    assert [b.line for b in invalid] == bad


def test_unterminated_quote_is_a_bad_row_or_a_clear_error(tmp_path: Path) -> None:
    def read(text: str) -> list[RawChunk]:
        path = write_text(tmp_path / "q.csv", text)
        source = SourceSpec(path="q.csv", format="csv")
        request = ReadRequest(path=path, display="q.csv", source=source, where="w", columns=COLUMNS)
        return list(get_format("csv").read(request))

    # On the last line the quote swallows only its own line: one bad row.
    _, _, invalid = read_all(read('label,n,c1,c2\n0,1,2,3\n1,2,"abc,d\n'))
    assert invalid == [BadRow("q.csv", 3, "expected 4 fields, found 3")]
    # Earlier, it swallows the lines after it: refused, never misnumbered.
    with pytest.raises(DataFileError, match=r"^q\.csv: a row spans several lines"):
        read('label,n,c1,c2\n1,2,"abc,d\n0,1,2,3\n')
