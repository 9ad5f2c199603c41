"""Every format reader passes the conformance suite (``estuary.testing.formats``);
plus format-specific cases.

Files here use the suite's 4 columns::

    label  n   c1  c2        (criteo_tsv gets them through SourceSpec.columns)
"""

from __future__ import annotations

import gzip
import json
import warnings
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from estuary.config.errors import ConfigError
from estuary.config.spec import SourceSpec
from estuary.data.badrows import BadRow
from estuary.data.errors import DataFileError, DataWarning
from estuary.data.formats import RawChunk, ReadRequest, available_formats, get_format
from estuary.data.formats.values import to_text
from estuary.testing.formats import (
    COLUMNS,
    DelimitedConformance,
    FormatConformance,
    TextConformance,
    is_raw_column,
    make_rows,
    read_all,
    write_text,
)

from .ctr_datagen import CRITEO_COLUMNS, criteo_rows, join_rows


class TestCriteoTsv(DelimitedConformance):
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


class TestCsv(DelimitedConformance):
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


class TestTsv(DelimitedConformance):
    format_name = "tsv"
    sep = "\t"
    header = True


def jsonl_line(row: list[str]) -> str:
    """A make_rows row as JSON: numbers for label and n, strings, "" left out."""
    label, n, c1, c2 = row
    obj: dict[str, object] = {"label": int(label), "n": int(n), "c1": c1}
    if c2:
        obj["c2"] = c2
    return json.dumps(obj)


class TestJsonl(TextConformance):
    format_name = "jsonl"

    def format_line(self, row: list[str]) -> str:
        return jsonl_line(row)

    def test_unknown_column_is_a_config_error(self, tmp_path: Path) -> None:
        """Overridden: a key no row has is all-missing with a warning, not an error
        (writers such as Spark leave null keys out)."""
        path = self.write(tmp_path / "f.txt", make_rows(2))
        with pytest.warns(DataWarning, match=r"f\.txt: no row has a value for 'nope'"):
            (chunk,) = self.read(path, columns=["label", "nope"])
        assert chunk.columns["nope"].to_pylist() == [None, None]

    def test_columns_setting_is_refused(self, tmp_path: Path) -> None:
        path = self.write(tmp_path / "f.jsonl", make_rows(1))
        with pytest.raises(ConfigError, match=r"data\.sources\[0\]\.columns: not used"):
            self.read(path, source_columns=["a"])

    @pytest.mark.parametrize("threads", [1, 2])
    def test_bad_lines_are_reported_with_their_line_and_reason(
        self, tmp_path: Path, threads: int
    ) -> None:
        rows = make_rows(5)
        good = [jsonl_line(r) for r in rows]
        lines = [
            good[0],
            '{"label": 1, "n": 2',  # 2: cut short
            good[1],
            "[1, 2]",  # 4: not an object
            "   ",  # 5: blank
            good[2],
            '{"label": 1, "c1": {"x": 1}}',  # 7: an object under a requested key
            '{"label": 1, "other": [1], "n": 3}',  # 8: fine, "other" is not requested
            good[3],
            '{"label": 1, "c1": "\\ud800"}',  # 10: unpaired surrogate escape
            '{"label": 1} trailing',  # 11
            good[4],
        ]
        data = "".join(line + "\n" for line in lines).encode()
        data = data.replace(b"trailing", b"\xff")  # 11: not UTF-8 either
        path = write_text(tmp_path / "bad.jsonl", data)
        got, numbers, invalid = read_all(self.read(path, block_size_bytes=64, threads=threads))
        assert got == [*rows[:3], ["1", "3", "", ""], *rows[3:]]
        assert numbers == [1, 3, 6, 8, 9, 12]
        assert invalid == [
            BadRow("bad.jsonl", 2, "not valid JSON: Expecting ',' delimiter (column 20)"),
            BadRow("bad.jsonl", 4, "not a JSON object (found array)"),
            BadRow("bad.jsonl", 7, "field c1: a JSON object is not a single value"),
            BadRow("bad.jsonl", 10, "field c1: a string with an unpaired surrogate escape"),
            BadRow("bad.jsonl", 11, "not valid UTF-8 (byte 14 is 0xff)"),
        ]

    def test_values_become_text_alike_on_both_paths(self, tmp_path: Path) -> None:
        values = [
            (15706, "15706"),
            (-1, "-1"),
            (2.0, "2"),
            (15706.0, "15706"),
            (-0.0, "0"),
            (0.1, "0.1"),
            (2.5, "2.5"),
            (1e-7, "1e-7"),
            (1e20, "1e+20"),
            (99999999999999999999, "99999999999999999999"),  # beyond int64: exact
            (True, "1"),
            (False, "0"),
            ("15706", "15706"),
            ("2014-10-21", "2014-10-21"),  # not read as a timestamp
            ("é", "é"),
            (None, None),
        ]
        lines = [json.dumps({"label": 1, "c1": v}) for v, _ in values]
        expected = [None if t is None else t.encode() for _, t in values]
        for name, extra in (("fast.jsonl", []), ("exact.jsonl", ["not json"])):
            # One value per block, so each block holds one type.
            path = write_text(tmp_path / name, "\n".join(lines + extra) + "\n")
            got = [
                v
                for chunk in self.read(path, ["c1"], block_size_bytes=1)
                for v in to_text(chunk.columns["c1"]).to_pylist()
            ]
            assert got == expected, name
            # One block holding all values at once.
            got = [
                v
                for chunk in self.read(path, ["c1"])
                for v in to_text(chunk.columns["c1"]).to_pylist()
            ]
            assert got == expected, name

    def test_first_line_may_start_with_a_bom_and_keys_may_repeat(self, tmp_path: Path) -> None:
        path = write_text(
            tmp_path / "bom.jsonl", b'\xef\xbb\xbf{"label": 1, "c1": "a", "c1": "b"}\n'
        )
        (chunk,) = self.read(path, ["label", "c1"])
        assert to_text(chunk.columns["c1"]).to_pylist() == [b"b"]  # the last value counts


PARQUET_SCHEMA = pa.schema(
    [("label", pa.int64()), ("n", pa.int64()), ("c1", pa.string()), ("c2", pa.string())]
)


class TestParquet(FormatConformance):
    format_name = "parquet"

    def write(self, path: Path, rows: Sequence[list[str]], compression: str | None = None) -> Path:
        """Typed columns (label, n int64), "" as null, row groups of 7 rows."""
        columns = list(zip(*rows, strict=True)) if rows else [(), (), (), ()]
        table = pa.table(
            {
                "label": [int(v) for v in columns[0]],
                "n": [int(v) for v in columns[1]],
                "c1": list(columns[2]),
                "c2": [v or None for v in columns[3]],
            },
            schema=PARQUET_SCHEMA,
        )
        pq.write_table(table, path, row_group_size=7, compression=compression or "snappy")
        return path

    def test_row_groups_and_codecs(self, tmp_path: Path) -> None:
        rows = make_rows(30)
        for codec in ("none", "snappy", "gzip", "zstd"):
            path = self.write(tmp_path / f"{codec}.parquet", rows, codec)
            assert pq.ParquetFile(path).num_row_groups == 5
            got, lines, _ = read_all(self.read(path))
            assert got == rows and lines == list(range(1, 31))

    def test_a_file_with_no_rows_still_checks_its_columns(self, tmp_path: Path) -> None:
        path = self.write(tmp_path / "none.parquet", [])
        assert self.read(path) == []
        with pytest.raises(ConfigError, match=r"column 'x' is not in none\.parquet"):
            self.read(path, ["x"])

    @pytest.mark.parametrize(
        ("array", "text", "kind"),
        [
            (pa.array([15706, -1, None], pa.int64()), [b"15706", b"-1", None], pa.int64()),
            (pa.array([7, None, -128], pa.int8()), [b"7", None, b"-128"], pa.int64()),
            (
                pa.array([2**64 - 1, 0, None], pa.uint64()),
                [b"18446744073709551615", b"0", None],
                pa.binary(),
            ),
            (pa.array([15706.0, 2.0, None]), [b"15706", b"2", None], pa.int64()),
            (pa.array([15706.0, 2.5, None]), [b"15706", b"2.5", None], pa.binary()),
            (pa.array([-0.0, float("nan"), float("-inf")]), [b"0", b"nan", b"-inf"], pa.binary()),
            (pa.array([0.1, 1e-7, 1e20]), [b"0.1", b"1e-7", b"1e+20"], pa.binary()),
            (pa.array([0.1, 3.0, None], pa.float32()), [b"0.1", b"3", None], pa.binary()),
            (pa.array([True, False, None]), [b"1", b"0", None], pa.binary()),
            (pa.array(["a", "", None]).dictionary_encode(), [b"a", b"", None], pa.binary()),
            (
                pa.array(["a", "b", None, "a", "a", "b"]).dictionary_encode(),
                [b"a", b"b", None, b"a", b"a", b"b"],
                pa.dictionary(pa.int32(), pa.binary()),
            ),
            (pa.array(["x", "y", None], pa.large_string()), [b"x", b"y", None], pa.binary()),
            (pa.array([b"\xff", b"", None], pa.binary()), [b"\xff", b"", None], pa.binary()),
            (
                pa.array([Decimal("2.00"), Decimal("1.50"), None], pa.decimal128(5, 2)),
                [b"2", b"1.5", None],
                pa.binary(),
            ),
        ],
    )
    def test_typed_values_become_text(
        self, tmp_path: Path, array: pa.Array, text: list[bytes | None], kind: pa.DataType
    ) -> None:
        """Each value's text per ``formats.values``; ints (and whole floats) stay
        int64, a repetitive string column stays a dictionary."""
        path = tmp_path / "typed.parquet"
        pq.write_table(pa.table({"v": array}), path)
        (chunk,) = self.read(path, ["v"])
        assert is_raw_column(chunk.columns["v"])
        assert chunk.columns["v"].type == kind
        assert to_text(chunk.columns["v"]).to_pylist() == text

    def test_dictionary_pages_stay_dictionaries_unless_the_writer_fell_back(
        self, tmp_path: Path
    ) -> None:
        """A column chunk whose dictionary overflowed into plain pages is read as plain
        text (asking Arrow for a dictionary there would make it build one, slowly)."""
        n = 2000
        few = [f"v{i % 5}" for i in range(n)]
        many = [f"{i:032x}" for i in range(n)]  # distinct: the dictionary overflows
        path = tmp_path / "d.parquet"
        table = pa.table({"few": few, "many": many})
        pq.write_table(table, path, dictionary_pagesize_limit=4096, compression="none")
        chunks = self.read(path, ["few", "many"])
        assert all(pa.types.is_dictionary(c.columns["few"].type) for c in chunks)
        assert all(c.columns["many"].type == pa.binary() for c in chunks)
        got, lines, _ = read_all(chunks, ["few", "many"])
        assert got == [list(r) for r in zip(few, many, strict=True)]
        assert lines == list(range(1, n + 1))

    def test_nested_columns_are_refused_only_when_requested(self, tmp_path: Path) -> None:
        path = tmp_path / "nested.parquet"
        pq.write_table(pa.table({"label": [1], "tags": [[1, 2]], "c1": ["a"]}), path)
        (chunk,) = self.read(path, ["label", "c1"])
        assert to_text(chunk.columns["c1"]).to_pylist() == [b"a"]
        with pytest.raises(ConfigError, match=r"column 'tags' of nested\.parquet has type list"):
            self.read(path, ["tags"])

    def test_not_parquet_or_truncated_names_the_file(self, tmp_path: Path) -> None:
        path = write_text(tmp_path / "junk.parquet", "label\n1\n")
        with pytest.raises(DataFileError, match=r"junk\.parquet: not a readable Parquet file"):
            self.read(path)
        path = self.write(tmp_path / "cut.parquet", make_rows(100))
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        with pytest.raises(DataFileError, match=r"cut\.parquet: not a readable Parquet file"):
            self.read(path)

    def test_corrupt_page_names_the_file_and_row_group(self, tmp_path: Path) -> None:
        path = tmp_path / "rot.parquet"
        table = pa.table({"label": [i % 2 for i in range(3000)]})
        pq.write_table(table, path, compression="none", write_page_checksum=True)
        data = bytearray(path.read_bytes())
        data[100:400] = bytes(300)  # inside the first data page
        path.write_bytes(bytes(data))
        with pytest.raises(DataFileError, match=r"rot\.parquet: corrupt data in row group 0"):
            self.read(path, ["label"])

    def test_settings_that_do_not_apply_are_refused(self, tmp_path: Path) -> None:
        path = self.write(tmp_path / "f.parquet", make_rows(1))
        with pytest.raises(ConfigError, match=r"data\.sources\[0\]\.columns: not used"):
            self.read(path, source_columns=["a"])
        with pytest.raises(ConfigError, match=r"data\.sources\[0\]\.compression: 'gzip'"):
            self.read(path, compression="gzip")


def test_registry_lists_every_spec_format_and_refuses_others() -> None:
    assert set(available_formats()) >= {"criteo_tsv", "csv", "tsv", "parquet", "jsonl"}
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


JSON_LINE_KINDS = st.sampled_from(
    ["good", "good", "good", "blank", "spaces", "cut", "array", "nested", "utf8"]
)


@settings(max_examples=60, deadline=None)
@given(
    kinds=st.lists(JSON_LINE_KINDS, max_size=40),
    block_size=st.integers(1, 200),
    threads=st.sampled_from([1, 3]),
    final_newline=st.booleans(),
)
def test_jsonl_line_numbers_match_a_line_by_line_reference(
    tmp_path_factory: pytest.TempPathFactory,
    kinds: list[str],
    block_size: int,
    threads: int,
    final_newline: bool,
) -> None:
    """Any mix of good, blank and bad JSON lines, cut into any block size."""
    text_of = {
        "blank": b"",
        "spaces": b" \t\r",
        "cut": b'{"label": 1, "n": ',
        "array": b"[1]",
        "nested": b'{"label": 1, "c1": [1]}',
        "utf8": b'{"label": 1, "c1": "\xc3"}',
    }
    lines, good, bad = [], [], []
    for number, kind in enumerate(kinds, start=1):
        if kind == "good":
            row = ["1", str(number), f"a{number}", ""]
            lines.append(jsonl_line(row).encode())
            good.append((row, number))
        else:
            lines.append(text_of[kind])
            if kind not in ("blank", "spaces"):
                bad.append(number)
    data = b"\n".join(lines) + (b"\n" if final_newline and lines else b"")
    path = write_text(tmp_path_factory.mktemp("lines") / "f.jsonl", data)
    source = SourceSpec(path=str(path), format="jsonl")
    request = ReadRequest(
        path=path,
        display="f.jsonl",
        source=source,
        where="w",
        columns=COLUMNS,
        block_size_bytes=block_size,
        threads=threads,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DataWarning)  # c2 is never present
        rows, numbers, invalid = read_all(list(get_format("jsonl").read(request)))
    assert rows == [row for row, _ in good]
    assert numbers == [number for _, number in good]
    assert [b.line for b in invalid] == bad


JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(-1e6, 1e6).map(lambda x: float(round(x))),  # whole numbers as floats
    st.text(max_size=5),
    st.sampled_from(["2014-10-21", "2014-10-21 00:00:00", "00:00:01", "1", "1.0"]),
)


@settings(max_examples=100, deadline=None)
@given(objects=st.lists(st.dictionaries(st.sampled_from(["a", "b", "x"]), JSON_VALUES), min_size=1))
def test_jsonl_fast_path_agrees_with_the_exact_path(objects: list[dict[str, object]]) -> None:
    """Whenever pyarrow's parse is taken, it gives what json.loads line by line gives."""
    from estuary.data.formats.jsonl import _BlockParser

    block = "".join(json.dumps(obj) + "\n" for obj in objects).encode()
    source = SourceSpec(path="f.jsonl", format="jsonl")
    request = ReadRequest(
        path=Path("f.jsonl"), display="f.jsonl", source=source, where="w", columns=["a", "b"]
    )
    parser = _BlockParser(request)
    exact = parser._exact(block, 1)
    assert exact.invalid == [] and exact.num_rows == len(objects)
    fast = parser._fast(block, 1, len(objects))
    if fast is not None:
        assert fast.line_numbers.tolist() == exact.line_numbers.tolist()
        for c in ("a", "b"):
            assert to_text(fast.columns[c]).to_pylist() == to_text(exact.columns[c]).to_pylist(), c
