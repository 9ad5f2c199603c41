"""Parquet and JSON Lines through ``TabularDataset``: the same rows give the same
labels, dense values and ids as the text formats; bad rows, missing columns,
corrupt and empty files."""

from __future__ import annotations

import gzip
import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from estuary.config.errors import ConfigError
from estuary.config.spec import DataSpec, SchemaSpec, SourceSpec
from estuary.data import (
    BadDataError,
    BadRow,
    DataFileError,
    DataWarning,
    TabularDataset,
    missing_id,
)
from estuary.data.decode import RowDecoder
from estuary.data.formats import RawChunk, ReadRequest, get_format
from estuary.data.formats.values import to_raw, to_text
from estuary.testing.formats import write_text

from .ctr_datagen import (
    AVAZU_COLUMNS,
    AVAZU_SPARSE,
    CRITEO_COLUMNS,
    CRITEO_DENSE,
    CRITEO_SPARSE,
    avazu_rows,
    criteo_rows,
    join_rows,
)

Row = list[str]
SAMPLES = Path(os.environ.get("ESTUARY_SAMPLE_DATA", "/work/shared/data"))


def spec(path: str, fmt: str = "criteo_tsv", **overrides: object) -> DataSpec:
    fields: dict[str, object] = {
        "sources": [SourceSpec(path=path, format=fmt)],  # type: ignore[arg-type]
        "schema": SchemaSpec(dense=list(CRITEO_DENSE), sparse=list(CRITEO_SPARSE)),
        "eval_fraction": 0.0,
    }
    fields.update(overrides)
    return DataSpec(**fields)  # type: ignore[arg-type]


def load(base: Path, path: str, fmt: str, **kw: object) -> TabularDataset:
    return TabularDataset(spec(path, fmt), base, **kw)  # type: ignore[arg-type]


# -- writers: one set of text rows, several typed layouts --------------------------


def columns_of(rows: list[Row]) -> dict[str, list[str]]:
    return {c: [r[j] for r in rows] for j, c in enumerate(CRITEO_COLUMNS)}


def parquet_typed(rows: list[Row], path: Path) -> None:
    """label, I1..I13 int64 (null = missing); C1..C26 string (null = missing)."""
    table = {}
    for c, values in columns_of(rows).items():
        if c in CRITEO_SPARSE:
            table[c] = pa.array([v or None for v in values], pa.string())
        else:
            table[c] = pa.array([int(v) if v else None for v in values], pa.int64())
    pq.write_table(pa.table(table), path, row_group_size=128)


def parquet_pandas_style(rows: list[Row], path: Path) -> None:
    """Counts as float64 (how pandas stores an integer column with gaps), label bool,
    categoricals dictionary-encoded, zstd."""
    table = {}
    for c, values in columns_of(rows).items():
        if c == "label":
            table[c] = pa.array([v == "1" for v in values])
        elif c in CRITEO_DENSE:
            table[c] = pa.array([float(v) if v else None for v in values], pa.float64())
        else:
            table[c] = pa.array([v or None for v in values]).dictionary_encode()
    pq.write_table(pa.table(table), path, compression="zstd", row_group_size=100)


def parquet_strings(rows: list[Row], path: Path) -> None:
    """Every column as the original text ("" kept as "")."""
    pq.write_table(pa.table(columns_of(rows)), path)


def jsonl_numbers(rows: list[Row], path: Path) -> None:
    """Counts and label as JSON integers, missing values left out, gzip."""
    lines = []
    for r in rows:
        obj: dict[str, object] = {}
        for c, v in zip(CRITEO_COLUMNS, r, strict=True):
            if v:
                obj[c] = v if c in CRITEO_SPARSE else int(v)
        lines.append(json.dumps(obj))
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))


def jsonl_floats(rows: list[Row], path: Path) -> None:
    """Counts as JSON floats (15706.0), missing values as null, label as boolean."""
    lines = []
    for r in rows:
        obj: dict[str, object] = {}
        for c, v in zip(CRITEO_COLUMNS, r, strict=True):
            if c == "label":
                obj[c] = v == "1"
            elif c in CRITEO_DENSE:
                obj[c] = float(v) if v else None
            else:
                obj[c] = v or None
        lines.append(json.dumps(obj))
    path.write_text("\n".join(lines) + "\n")


def jsonl_strings(rows: list[Row], path: Path) -> None:
    """Every value as a JSON string, "" kept."""
    lines = [json.dumps(dict(zip(CRITEO_COLUMNS, r, strict=True))) for r in rows]
    path.write_text("\n".join(lines) + "\n")


WRITERS: dict[str, tuple[str, str, Callable[[list[Row], Path], None]]] = {
    "parquet_typed": ("parquet", "f.parquet", parquet_typed),
    "parquet_pandas_style": ("parquet", "f.parquet", parquet_pandas_style),
    "parquet_strings": ("parquet", "f.parquet", parquet_strings),
    "jsonl_numbers": ("jsonl", "f.jsonl.gz", jsonl_numbers),
    "jsonl_floats": ("jsonl", "f.jsonl", jsonl_floats),
    "jsonl_strings": ("jsonl", "f.jsonl", jsonl_strings),
}


def assert_same_table(a: TabularDataset, b: TabularDataset) -> None:
    assert a.num_rows == b.num_rows
    assert np.array_equal(a.labels, b.labels)
    assert np.array_equal(a.dense, b.dense)
    assert np.array_equal(a.ids, b.ids)


@pytest.mark.parametrize("layout", list(WRITERS))
def test_same_rows_give_identical_tables_in_every_format(tmp_path: Path, layout: str) -> None:
    rows = criteo_rows(600, seed=7)
    rows[0][1:14] = ["0", "-1", "", "15706", "2", "9007199254740993", "", "", "", "", "", "", ""]
    write_text(tmp_path / "f.tsv", join_rows(rows, "\t"))
    tsv = load(tmp_path, "f.tsv", "criteo_tsv")
    fmt, name, writer = WRITERS[layout]
    writer(rows, tmp_path / name)
    other = load(tmp_path, name, fmt, block_size_bytes=8192, threads=2)
    assert tsv.num_rows == 600 and tsv.bad_rows.count == 0 and other.bad_rows.count == 0
    assert_same_table(tsv, other)


def test_integer_categoricals_hash_like_their_text(tmp_path: Path) -> None:
    """Avazu: integer columns (id near 1e18, hour YYMMDDHH through hour_of_day, C14..)
    as int64 / int32 / float64 in Parquet and as JSON numbers hash like the CSV text."""
    rows = avazu_rows(200, seed=3)
    write_text(tmp_path / "a.csv", join_rows(rows, ",", AVAZU_COLUMNS))
    text = {c: [r[j] for r in rows] for j, c in enumerate(AVAZU_COLUMNS)}
    numeric = [c for c in AVAZU_COLUMNS if all(v.isdigit() for v in text[c])]
    assert {"id", "click", "hour", "C1", "C14", "C21"} <= set(numeric)
    typed = {}
    for c, values in text.items():
        if c == "id":
            typed[c] = pa.array([int(v) for v in values], pa.int64())
        elif c in ("click", "banner_pos"):
            typed[c] = pa.array([int(v) for v in values], pa.int32())
        elif c in numeric:  # small counts and codes: whole float64s
            typed[c] = pa.array([float(v) for v in values], pa.float64())
        else:
            typed[c] = pa.array(values)
    pq.write_table(pa.table(typed), tmp_path / "a.parquet")
    objects = [
        {c: int(v) if c in numeric else v for c, v in zip(AVAZU_COLUMNS, r, strict=True)}
        for r in rows
    ]
    write_text(tmp_path / "a.jsonl", "".join(json.dumps(o) + "\n" for o in objects))

    def avazu(path: str, fmt: str) -> TabularDataset:
        data = DataSpec(
            sources=[SourceSpec(path=path, format=fmt)],  # type: ignore[arg-type]
            schema=SchemaSpec(
                label="click", sparse=["id", *AVAZU_SPARSE], transforms={"hour": "hour_of_day"}
            ),
            max_bad_row_ratio=0.0,
        )
        return TabularDataset(data, tmp_path)

    csv = avazu("a.csv", "csv")
    assert csv.num_rows == 200
    assert_same_table(csv, avazu("a.parquet", "parquet"))
    assert_same_table(csv, avazu("a.jsonl", "jsonl"))


@pytest.mark.slow
def test_the_34k_criteo_sample_is_identical_as_tsv_parquet_and_jsonl(tmp_path: Path) -> None:
    source = SAMPLES / "criteo_dac_sample_34k.tsv.gz"
    if not source.is_file():
        pytest.skip(f"{source} not present")
    types = {c: pa.string() if c in CRITEO_SPARSE else pa.int64() for c in CRITEO_COLUMNS}
    table = pacsv.read_csv(
        source,
        read_options=pacsv.ReadOptions(column_names=CRITEO_COLUMNS),
        parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False),
        convert_options=pacsv.ConvertOptions(column_types=types, strings_can_be_null=True),
    )
    pq.write_table(table, tmp_path / "s.parquet", row_group_size=10_000)
    rows = table.to_pylist()
    with (tmp_path / "s.jsonl").open("w") as out:
        for row in rows:
            out.write(json.dumps({k: v for k, v in row.items() if v is not None}) + "\n")
    tsv = TabularDataset(spec(str(source)), tmp_path)
    assert tsv.num_rows == 34_578
    assert_same_table(tsv, load(tmp_path, "s.parquet", "parquet"))
    assert_same_table(tsv, load(tmp_path, "s.jsonl", "jsonl"))


def test_several_formats_in_one_spec_read_in_order(tmp_path: Path) -> None:
    rows = criteo_rows(90, seed=2)
    write_text(tmp_path / "a.tsv", join_rows(rows[:30], "\t"))
    parquet_typed(rows[30:60], tmp_path / "b.parquet")
    jsonl_numbers(rows[60:], tmp_path / "c.jsonl.gz")
    write_text(tmp_path / "all.tsv", join_rows(rows, "\t"))
    mixed = spec(
        "a.tsv",
        sources=[
            SourceSpec(path="a.tsv"),
            SourceSpec(path="b.parquet", format="parquet"),
            SourceSpec(path="c.jsonl.gz", format="jsonl"),
        ],
    )
    ds = TabularDataset(mixed, tmp_path)
    assert ds.files == ["a.tsv", "b.parquet", "c.jsonl.gz"]
    assert_same_table(ds, load(tmp_path, "all.tsv", "criteo_tsv"))


# -- bad rows ----------------------------------------------------------------------


def test_jsonl_bad_rows_are_counted_with_file_line_and_reason(tmp_path: Path) -> None:
    rows = criteo_rows(30, seed=4)
    objects: list[dict[str, object]] = [
        {c: v for c, v in zip(CRITEO_COLUMNS, r, strict=True) if v} for r in rows
    ]
    lines = [json.dumps(o) for o in objects]
    lines[3] = lines[3][:-5]  # cut short: not valid JSON
    objects[6]["I5"] = "abc"  # non-numeric dense value (a string)
    objects[9]["label"] = 2  # label not 0/1
    objects[12]["I3"] = float("nan")  # written as NaN, which JSON readers accept
    objects[15]["C2"] = ["x"]  # not a single value
    del objects[18]["label"]  # no label
    for i in (6, 9, 12, 15, 18):
        lines[i] = json.dumps(objects[i])
    lines[21] = '"just a string"'
    lines.insert(2, "")  # a blank line: every later row is one line further down
    write_text(tmp_path / "day.jsonl", "\n".join(lines) + "\n")

    data = spec("day.jsonl", "jsonl", max_bad_row_ratio=1.0, report_bad_rows=10)
    ds = TabularDataset(data, tmp_path, block_size_bytes=2000, threads=2)

    def line(i: int) -> int:
        return i + 1 + (1 if i >= 2 else 0)

    first, *rest = ds.bad_rows.examples
    assert first.file == "day.jsonl" and first.line == line(3)
    assert first.reason.startswith("not valid JSON: Unterminated string starting at (column ")
    assert rest == [
        BadRow("day.jsonl", line(6), "field I5: 'abc' is not a number"),
        BadRow("day.jsonl", line(9), "field label: '2' is not 0 or 1"),
        BadRow("day.jsonl", line(12), "field I3: 'nan' is not a finite number"),
        BadRow("day.jsonl", line(15), "field C2: a JSON array is not a single value"),
        BadRow("day.jsonl", line(18), "field label: '' is not 0 or 1"),
        BadRow("day.jsonl", line(21), "not a JSON object (found string)"),
    ]
    assert ds.bad_rows.count == 7 and ds.bad_rows.rows_read == 30
    good = [i for i in range(30) if i not in (3, 6, 9, 12, 15, 18, 21)]
    write_text(tmp_path / "good.tsv", join_rows([rows[i] for i in good], "\t"))
    assert_same_table(ds, load(tmp_path, "good.tsv", "criteo_tsv"))


def test_a_jsonl_file_of_garbage_fails_naming_lines(tmp_path: Path) -> None:
    write_text(tmp_path / "junk.jsonl", "label,I1\n" + "1,2\n" * 20)
    with pytest.raises(
        BadDataError, match=r"junk\.jsonl:1: not valid JSON: Expecting value \(column 1\)"
    ):
        load(tmp_path, "junk.jsonl", "jsonl")


@pytest.mark.parametrize("label_type", ["int64", "dictionary"])
def test_parquet_bad_rows_are_reported_by_row_number(tmp_path: Path, label_type: str) -> None:
    rows = criteo_rows(20, seed=5)
    rows[4][0] = "2"
    rows[11][3] = "nan"
    rows[15][4] = "abc"
    text = columns_of(rows)
    table = {c: pa.array(v) for c, v in text.items()}  # strings
    if label_type == "int64":
        table["label"] = pa.array([int(v) for v in text["label"]])
    else:
        table["label"] = pa.array(text["label"]).dictionary_encode()
    table["I3"] = pa.array([float(v) if v else None for v in text["I3"]])
    pq.write_table(pa.table(table), tmp_path / "p.parquet", row_group_size=8)
    ds = TabularDataset(spec("p.parquet", "parquet", max_bad_row_ratio=0.5), tmp_path)
    assert [str(b) for b in ds.bad_rows.examples] == [
        "p.parquet:5: field label: '2' is not 0 or 1",
        "p.parquet:12: field I3: 'nan' is not a finite number",
        "p.parquet:16: field I4: 'abc' is not a number",
    ]
    assert ds.num_rows == 17


def test_repetitive_parquet_columns_stay_dictionaries_with_the_same_results(
    tmp_path: Path,
) -> None:
    """Few distinct values: read as dictionaries (hashed once per value), through
    dense parsing, a transform and bad-row reports, exactly like the CSV text."""
    hours = ["14102100", "14102113", "14102223", "1410210"]  # the last is not YYMMDDHH
    rows = [[str(i % 2), hours[i % 4] if i != 7 else "14102100", str(i % 5), f"s{i % 3}"]
            for i in range(400)]  # fmt: skip
    rows[9][1] = hours[3]
    names = ["click", "hour", "n", "site"]
    write_text(tmp_path / "a.csv", join_rows(rows, ",", names))
    table = pa.table({c: [r[j] for r in rows] for j, c in enumerate(names)})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=100)
    request = ReadRequest(
        path=tmp_path / "a.parquet",
        display="a.parquet",
        source=SourceSpec(path="a.parquet", format="parquet"),
        where="data.sources[0]",
        columns=names,
    )
    for chunk in get_format("parquet").read(request):
        assert all(pa.types.is_dictionary(chunk.columns[c].type) for c in names)

    def load_as(name: str, fmt: str) -> TabularDataset:
        data = DataSpec(
            sources=[SourceSpec(path=name, format=fmt)],  # type: ignore[arg-type]
            schema=SchemaSpec(
                label="click",
                dense=["n"],
                sparse=["hour", "site"],
                transforms={"hour": "hour_of_day"},
            ),
            max_bad_row_ratio=0.5,
        )
        return TabularDataset(data, tmp_path, block_size_bytes=1 << 20)

    csv, parquet = load_as("a.csv", "csv"), load_as("a.parquet", "parquet")
    assert_same_table(csv, parquet)
    assert csv.bad_rows.count == parquet.bad_rows.count == 100
    assert [b.reason for b in parquet.bad_rows.examples] == [
        b.reason for b in csv.bad_rows.examples
    ]
    assert parquet.bad_rows.examples[0] == BadRow(
        "a.parquet", 4, "field hour: '1410210' is not YYMMDDHH (hour_of_day)"
    )


# -- missing columns, corrupt and empty files ---------------------------------------


def test_parquet_missing_column_is_a_config_error(tmp_path: Path) -> None:
    rows = criteo_rows(5)
    table = pa.table(columns_of(rows)).drop_columns(["C26"])
    pq.write_table(table, tmp_path / "p.parquet")
    with pytest.raises(ConfigError, match=r"data\.schema: column 'C26' is not in p\.parquet"):
        load(tmp_path, "p.parquet", "parquet")


def test_jsonl_missing_key_everywhere_is_a_warning_and_the_missing_id(tmp_path: Path) -> None:
    rows = criteo_rows(5)
    objects = [dict(zip(CRITEO_COLUMNS[:-1], r[:-1], strict=True)) for r in rows]
    write_text(tmp_path / "j.jsonl", "".join(json.dumps(o) + "\n" for o in objects))
    with pytest.warns(DataWarning, match=r"j\.jsonl: no row has a value for 'C26'"):
        ds = load(tmp_path, "j.jsonl", "jsonl")
    assert ds.num_rows == 5
    assert ds.ids[:, -1].tolist() == [missing_id("C26")] * 5


def test_corrupt_parquet_names_the_file(tmp_path: Path) -> None:
    parquet_typed(criteo_rows(300), tmp_path / "p.parquet")
    data = (tmp_path / "p.parquet").read_bytes()
    (tmp_path / "p.parquet").write_bytes(data[: len(data) - 100])
    with pytest.raises(DataFileError, match=r"p\.parquet: not a readable Parquet file"):
        load(tmp_path, "p.parquet", "parquet")


@pytest.mark.parametrize(
    ("name", "fmt", "content"),
    [
        ("e.parquet", "parquet", b""),
        ("e.jsonl", "jsonl", b""),
        ("blank.jsonl", "jsonl", b"\n \n\r\n"),
        # mtime=0: the same bytes in every run (without ids= the bytes would be
        # in the test id, and pytest-xdist's workers must collect the same ids).
        ("e.jsonl.gz", "jsonl", gzip.compress(b"", mtime=0)),
    ],
    ids=["parquet", "jsonl", "blank-jsonl", "jsonl-gz"],
)
def test_empty_files_warn_and_give_no_rows(
    tmp_path: Path, name: str, fmt: str, content: bytes
) -> None:
    (tmp_path / name).write_bytes(content)
    with pytest.warns(DataWarning, match=rf"{name.replace('.', '[.]')}: no data rows"):
        ds = load(tmp_path, name, fmt)
    assert ds.num_rows == 0 and ds.bad_rows.rows_read == 0


def test_parquet_with_schema_but_no_rows_warns(tmp_path: Path) -> None:
    parquet_typed(criteo_rows(3), tmp_path / "full.parquet")
    empty = pq.read_table(tmp_path / "full.parquet").slice(0, 0)
    pq.write_table(empty, tmp_path / "none.parquet")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = load(tmp_path, "none.parquet", "parquet")
    assert ds.num_rows == 0
    assert [str(w.message) for w in caught] == ["none.parquet: no data rows"]


# -- the typed RawChunk columns decode exactly like their text ------------------------

INT_VALUES = st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1), st.integers(-3, 3))


@settings(max_examples=80, deadline=None)
@given(
    ints=st.lists(INT_VALUES, min_size=1, max_size=30),
    words=st.lists(st.sampled_from([None, "", "a", "b", "1410210", "14102113"]), max_size=30),
    start=st.integers(0, 3),
)
def test_int64_and_dictionary_columns_decode_like_their_text(
    ints: list[int | None], words: list[str | None], start: int
) -> None:
    """``to_raw``'s int64 and dictionary columns give the labels, dense values, ids
    and bad rows that the same values written as binary text give."""
    n = len(ints)
    words = (words * n)[:n] if words else [None] * n
    labels = [None if v is None else v % 2 for v in ints]
    typed = {
        "label": pa.array(labels, pa.int64()),
        "n": pa.array(ints, pa.int64()),
        "c": pa.array(ints, pa.int64()),
        "w": pa.array(words, pa.string()).dictionary_encode(),
        "h": pa.array(words, pa.string()).dictionary_encode(),
    }
    # Sliced, as a reader's batches may be.
    raw = {c: to_raw(a.slice(min(start, n - 1))) for c, a in typed.items()}
    rows = len(raw["label"])
    text = {c: to_text(a) for c, a in raw.items()}
    assert all(a.type == pa.binary() for a in text.values())
    schema = SchemaSpec(
        label="label", dense=["n"], sparse=["c", "w", "h"], transforms={"h": "hour_of_day"}
    )
    decoder = RowDecoder(schema)
    lines = np.arange(1, rows + 1, dtype=np.int64)
    got = decoder.decode(RawChunk("f", raw, lines, []), max_examples=100)
    want = decoder.decode(RawChunk("f", text, lines, []), max_examples=100)
    assert np.array_equal(got.labels, want.labels)
    assert np.array_equal(got.dense, want.dense)
    assert np.array_equal(got.ids, want.ids)
    assert got.bad_examples == want.bad_examples and got.bad_count == want.bad_count
