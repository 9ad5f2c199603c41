"""TabularDataset end to end on small synthetic files: values, bad rows, splits,
batches."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from estuary.config.spec import DataSpec, SchemaSpec, SourceSpec
from estuary.data import (
    BadDataError,
    BadRow,
    DataFileError,
    DataWarning,
    TabularDataset,
    missing_id,
)
from estuary.testing.formats import write_text

from .ctr_datagen import (
    AVAZU_COLUMNS,
    AVAZU_SPARSE,
    CRITEO_COLUMNS,
    CRITEO_DENSE,
    CRITEO_SPARSE,
    avazu_rows,
    criteo_rows,
    criteo_spec,
    join_rows,
    ref_decode,
    ref_id,
)


def write_criteo(path: Path, rows: list[list[str]], compression: str | None = None) -> Path:
    return write_text(path, join_rows(rows, "\t"), compression)


def assert_rows_equal(ds: TabularDataset, rows: list[list[str]]) -> None:
    """The dataset holds exactly ``rows`` (valid Criteo rows), in order."""
    expected = [ref_decode(r, CRITEO_COLUMNS, CRITEO_DENSE, CRITEO_SPARSE, "label") for r in rows]
    assert ds.num_rows == len(rows)
    assert ds.labels.dtype == np.float32 and ds.dense.dtype == np.float32
    assert ds.labels.tolist() == [e[0] for e in expected]
    np.testing.assert_allclose(ds.dense, np.array([e[1] for e in expected]).reshape(ds.dense.shape))
    assert ds.ids.tolist() == [e[2] for e in expected]


def test_good_rows_decode_to_reference_values(tmp_path: Path) -> None:
    rows = criteo_rows(300)
    write_criteo(tmp_path / "day0.tsv.gz", rows, "gzip")
    ds = TabularDataset(criteo_spec("day0.tsv.gz"), tmp_path, block_size_bytes=4096)
    assert_rows_equal(ds, rows)
    assert ds.feature_names == CRITEO_SPARSE
    assert ds.dense_names == CRITEO_DENSE
    assert ds.bad_rows.count == 0 and ds.bad_rows.rows_read == 300


def test_missing_values_become_zero_and_the_missing_id(tmp_path: Path) -> None:
    row = ["1"] + [""] * 13 + [""] * 26
    write_criteo(tmp_path / "f.tsv", [row])
    ds = TabularDataset(criteo_spec("f.tsv"), tmp_path)
    assert ds.dense.tolist() == [[0.0] * 13]
    assert ds.ids.tolist() == [[missing_id(f) for f in CRITEO_SPARSE]]


def test_negative_counts_get_signed_log1p(tmp_path: Path) -> None:
    row = criteo_rows(1)[0]
    row[2] = "-1"  # I2
    write_criteo(tmp_path / "f.tsv", [row])
    ds = TabularDataset(criteo_spec("f.tsv"), tmp_path)
    assert ds.dense[0, 1] == pytest.approx(-np.log(2.0))


def test_every_bad_row_kind_is_counted_with_file_line_and_field(tmp_path: Path) -> None:
    rows = criteo_rows(40, seed=1)
    lines = [r[:] for r in rows]
    bad: dict[int, list[str]] = {}  # index in `lines` -> the bad row

    def corrupt(i: int, column: str, value: str) -> None:
        row = rows[i][:]
        row[CRITEO_COLUMNS.index(column)] = value
        bad[i] = row

    corrupt(4, "I5", "abc")
    corrupt(9, "label", "2")
    corrupt(12, "I3", "nan")
    corrupt(13, "I13", "-inf")
    corrupt(20, "label", "")
    corrupt(21, "I1", "1e999")
    bad[30] = rows[30][:39]  # a field short
    for i, row in bad.items():
        lines[i] = row
    text = join_rows(lines, "\t")
    # A blank line after the second row shifts every later physical line by one.
    first, rest = text.split("\n", 2)[:2], text.split("\n", 2)[2]
    write_text(tmp_path / "day.tsv.gz", "\n".join(first) + "\n\n" + rest, "gzip")

    spec = criteo_spec("day.tsv.gz", max_bad_row_ratio=1.0, report_bad_rows=10)
    ds = TabularDataset(spec, tmp_path, block_size_bytes=700, threads=2)

    def line(i: int) -> int:
        return i + 1 + (1 if i >= 2 else 0)

    assert ds.bad_rows.examples == [
        BadRow("day.tsv.gz", line(4), "field I5: 'abc' is not a number"),
        BadRow("day.tsv.gz", line(9), "field label: '2' is not 0 or 1"),
        BadRow("day.tsv.gz", line(12), "field I3: 'nan' is not a finite number"),
        BadRow("day.tsv.gz", line(13), "field I13: '-inf' is not a finite number"),
        BadRow("day.tsv.gz", line(20), "field label: '' is not 0 or 1"),
        BadRow("day.tsv.gz", line(21), "field I1: '1e999' is not a finite number"),
        BadRow("day.tsv.gz", line(30), "expected 40 fields, found 39"),
    ]
    assert str(ds.bad_rows.examples[0]) == f"day.tsv.gz:{line(4)}: field I5: 'abc' is not a number"
    assert ds.bad_rows.count == 7
    assert ds.bad_rows.rows_read == 40
    # Every good row around the bad ones is kept, in order, with its values.
    assert_rows_equal(ds, [r for i, r in enumerate(rows) if i not in bad])
    assert ds.part("all").row_ids.tolist() == list(range(33))


def test_reason_names_the_first_bad_field_in_schema_order(tmp_path: Path) -> None:
    row = criteo_rows(1)[0]
    row[0], row[5] = "x", "y"  # label and I5 both bad
    write_criteo(tmp_path / "f.tsv", [row, *criteo_rows(9)])
    ds = TabularDataset(criteo_spec("f.tsv", max_bad_row_ratio=0.5), tmp_path)
    assert [str(b) for b in ds.bad_rows.examples] == ["f.tsv:1: field label: 'x' is not 0 or 1"]


def test_only_report_bad_rows_examples_are_kept(tmp_path: Path) -> None:
    rows = criteo_rows(50)
    for r in rows[::5]:
        r[1] = "?"
    write_criteo(tmp_path / "f.tsv", rows)
    ds = TabularDataset(criteo_spec("f.tsv", max_bad_row_ratio=0.5, report_bad_rows=3), tmp_path)
    assert ds.bad_rows.count == 10
    assert [b.line for b in ds.bad_rows.examples] == [1, 6, 11]


def test_too_many_bad_rows_fail_with_counts_and_examples(tmp_path: Path) -> None:
    rows = criteo_rows(100)
    for r in rows[10:15]:
        r[7] = "x"  # I7
    write_criteo(tmp_path / "f.tsv", rows)
    with pytest.raises(BadDataError) as info:
        TabularDataset(criteo_spec("f.tsv", max_bad_row_ratio=0.01), tmp_path)
    message = str(info.value)
    assert "too many bad rows: 5 of 100 rows read (5.00%)" in message
    assert "exceed data.max_bad_row_ratio=0.01 (checked at the end of f.tsv)" in message
    assert "f.tsv:11: field I7: 'x' is not a number" in message


def test_a_small_file_is_judged_on_all_its_rows(tmp_path: Path) -> None:
    rows = criteo_rows(50)
    rows[0][0] = "7"  # the very first row is bad: 1/50 = 2% <= 5%
    write_criteo(tmp_path / "f.tsv", rows)
    ds = TabularDataset(
        criteo_spec("f.tsv", max_bad_row_ratio=0.05), tmp_path, block_size_bytes=200
    )
    assert ds.num_rows == 49 and ds.bad_rows.count == 1


def test_a_garbage_file_fails_early_once_enough_rows_are_read(tmp_path: Path) -> None:
    rows = criteo_rows(6000)
    for r in rows[:3000:2]:
        r[0] = "yes"
    write_criteo(tmp_path / "f.tsv", rows)
    spec = criteo_spec("f.tsv", max_bad_row_ratio=0.1)
    with pytest.raises(BadDataError, match=r"checked after a block of f\.tsv") as info:
        TabularDataset(spec, tmp_path, block_size_bytes=64 << 10, threads=1)
    rows_read = int(str(info.value).split(" of ")[1].split(" rows read")[0])
    assert 1000 <= rows_read < 6000


def test_bad_rows_are_counted_over_all_files(tmp_path: Path) -> None:
    a, b = criteo_rows(100, seed=1), criteo_rows(100, seed=2)
    b[3][0] = "3"
    write_criteo(tmp_path / "a.tsv", a)
    write_criteo(tmp_path / "b.tsv", b)
    ds = TabularDataset(criteo_spec("a.tsv", "b.tsv", max_bad_row_ratio=0.005), tmp_path)
    assert ds.bad_rows.count == 1 and ds.bad_rows.rows_read == 200
    assert str(ds.bad_rows.examples[0]) == "b.tsv:4: field label: '3' is not 0 or 1"


def test_avazu_csv_with_hour_of_day(tmp_path: Path) -> None:
    rows = avazu_rows(30)
    rows[7][2] = "1410210"  # hour with 7 digits
    write_text(tmp_path / "avazu.csv.gz", join_rows(rows, ",", AVAZU_COLUMNS), "gzip")
    spec = DataSpec(
        sources=[SourceSpec(path="avazu.csv.gz", format="csv")],
        schema=SchemaSpec(label="click", sparse=AVAZU_SPARSE, transforms={"hour": "hour_of_day"}),
        max_bad_row_ratio=0.1,
    )
    ds = TabularDataset(spec, tmp_path)
    assert [str(b) for b in ds.bad_rows.examples] == [
        "avazu.csv.gz:9: field hour: '1410210' is not YYMMDDHH (hour_of_day)"
    ]
    good = [r for i, r in enumerate(rows) if i != 7]
    assert ds.num_rows == 29 and ds.dense.shape == (29, 0)
    assert ds.labels.tolist() == [float(r[1]) for r in good]
    hour = AVAZU_SPARSE.index("hour")
    assert ds.ids[:, hour].tolist() == [ref_id(r[2][6:], "hour") for r in good]
    c14 = AVAZU_SPARSE.index("C14")
    assert ds.ids[:, c14].tolist() == [ref_id(r[AVAZU_COLUMNS.index("C14")], "C14") for r in good]


def test_eval_is_the_last_fraction_in_file_order(tmp_path: Path) -> None:
    first, second = criteo_rows(30, seed=1), criteo_rows(10, seed=2)
    write_criteo(tmp_path / "day1.tsv", first)
    write_criteo(tmp_path / "day2.tsv", second)
    ds = TabularDataset(criteo_spec("day1.tsv", "day2.tsv", eval_fraction=0.25), tmp_path)
    train, eval_ = ds.split()
    assert (train.start, train.stop, eval_.start, eval_.stop) == (0, 30, 30, 40)
    batch = eval_.to_batch()
    assert batch.row_ids is not None and batch.row_ids.tolist() == list(range(30, 40))
    expected = [ref_decode(r, CRITEO_COLUMNS, CRITEO_DENSE, CRITEO_SPARSE, "label") for r in second]
    assert batch.sparse["C1"].values.tolist() == [e[2][0] for e in expected]


def test_shuffled_batches_cover_every_train_row_once_and_repeat_per_seed(tmp_path: Path) -> None:
    write_criteo(tmp_path / "f.tsv", criteo_rows(115))
    ds = TabularDataset(criteo_spec("f.tsv", eval_fraction=0.1), tmp_path)
    train, _ = ds.split()
    assert train.num_rows == 104

    def order(seed: int, epoch: int) -> list[int]:
        batches = list(ds.batches(train, 10, shuffle=True, seed=seed, epoch=epoch))
        assert [b.num_rows for b in batches] == [10] * 10 + [4]  # last partial batch kept
        return [i for b in batches for i in b.row_ids.tolist()]  # type: ignore[union-attr]

    epoch0 = order(seed=7, epoch=0)
    assert sorted(epoch0) == list(range(104))
    assert order(seed=7, epoch=0) == epoch0
    assert order(seed=7, epoch=1) != epoch0
    assert order(seed=8, epoch=0) != epoch0
    plain = [i for b in ds.batches("train", 32) for i in b.row_ids.tolist()]  # type: ignore[union-attr]
    assert plain == list(range(104))


def test_batches_carry_the_rows_they_name(tmp_path: Path) -> None:
    write_criteo(tmp_path / "f.tsv", criteo_rows(20))
    ds = TabularDataset(criteo_spec("f.tsv"), tmp_path)
    (batch, *_) = ds.batches("all", 8, shuffle=True, seed=1)
    rows = batch.row_ids
    assert rows is not None
    np.testing.assert_array_equal(batch.labels, ds.labels[rows])
    np.testing.assert_array_equal(batch.dense, ds.dense[rows])
    for f, name in enumerate(ds.feature_names):
        ids = batch.sparse[name]
        np.testing.assert_array_equal(ids.values, ds.ids[rows, f])
        np.testing.assert_array_equal(ids.offsets, np.arange(9))
    batch.labels[:] = 5  # batches are copies: the table does not change
    assert set(ds.labels.tolist()) <= {0.0, 1.0}


def test_take_matches_row_indexing_and_shares_one_offsets_array(tmp_path: Path) -> None:
    write_criteo(tmp_path / "f.tsv", criteo_rows(30))
    ds = TabularDataset(criteo_spec("f.tsv"), tmp_path)
    rows = np.array([29, 0, 7, 7, -1, -30], dtype=np.int64)  # repeats, negatives count from the end
    batch = ds.take(rows)
    np.testing.assert_array_equal(batch.labels, ds.labels[rows])
    np.testing.assert_array_equal(batch.dense, ds.dense[rows])
    assert batch.dense.flags.c_contiguous and batch.row_ids.tolist() == rows.tolist()  # type: ignore[union-attr]
    bags = [batch.sparse[name] for name in ds.feature_names]
    for f, bag in enumerate(bags):
        np.testing.assert_array_equal(bag.values, ds.ids[rows, f])
        assert bag.values.flags.c_contiguous
        assert bag.offsets is bags[0].offsets  # one (B + 1,) array for every one-id feature
    np.testing.assert_array_equal(bags[0].offsets, np.arange(7))
    assert not bags[0].offsets.flags.writeable  # shared: an in-place edit would hit them all
    with pytest.raises(IndexError):
        ds.take(np.array([30]))
    with pytest.raises(IndexError):
        ds.take(np.array([-31]))
    assert ds.take(np.zeros(0, np.int64)).num_rows == 0


def test_empty_file_warns_and_gives_no_rows(tmp_path: Path) -> None:
    write_text(tmp_path / "empty.tsv.gz", "", "gzip")
    with pytest.warns(DataWarning, match=r"empty\.tsv\.gz: no data rows"):
        ds = TabularDataset(criteo_spec("empty.tsv.gz", eval_fraction=0.1), tmp_path)
    assert ds.num_rows == 0 and ds.ids.shape == (0, 26) and ds.dense.shape == (0, 13)
    assert [p.num_rows for p in ds.split()] == [0, 0]
    assert list(ds.batches("train", 4, shuffle=True)) == []


def test_truncated_gzip_error_names_the_file(tmp_path: Path) -> None:
    path = write_criteo(tmp_path / "cut.tsv.gz", criteo_rows(2000), "gzip")
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(DataFileError, match=r"^cut\.tsv\.gz: truncated or corrupt gzip stream"):
        TabularDataset(criteo_spec("cut.tsv.gz"), tmp_path)


def test_globs_are_read_in_sorted_order_and_missing_files_fail(tmp_path: Path) -> None:
    parts = {name: criteo_rows(5, seed=i) for i, name in enumerate(["p2", "p10", "p1"])}
    for name, rows in parts.items():
        write_criteo(tmp_path / f"{name}.tsv", rows)
    ds = TabularDataset(criteo_spec("p*.tsv"), tmp_path)
    assert ds.files == ["p1.tsv", "p10.tsv", "p2.tsv"]
    assert_rows_equal(ds, parts["p1"] + parts["p10"] + parts["p2"])
    with pytest.raises(DataFileError, match=r"data\.sources\[0\]\.path: no files match"):
        TabularDataset(criteo_spec("q*.tsv"), tmp_path)
    with pytest.raises(DataFileError, match=r"data\.sources\[1\]\.path: file not found"):
        TabularDataset(criteo_spec("p1.tsv", "nope.tsv"), tmp_path)


def test_invalid_utf8_in_a_categorical_is_hashed_as_bytes(tmp_path: Path) -> None:
    rows = criteo_rows(2)
    text = join_rows(rows, "\t").encode().replace(rows[1][14].encode(), b"\xff\xfe", 1)
    write_text(tmp_path / "f.tsv", text)
    ds = TabularDataset(criteo_spec("f.tsv"), tmp_path)
    assert ds.bad_rows.count == 0
    from estuary.data import feature_seed
    from estuary.data.hashing import hash_bytes

    assert ds.ids[1, 0] == hash_bytes(b"\xff\xfe", feature_seed("C1"))


def test_dense_out_of_float32_range_is_bad_without_log1p(tmp_path: Path) -> None:
    rows = criteo_rows(20)
    rows[3][1] = "1e300"
    write_criteo(tmp_path / "f.tsv", rows)
    spec = criteo_spec("f.tsv", max_bad_row_ratio=0.1)
    spec = DataSpec(
        sources=spec.sources,
        schema=SchemaSpec(dense=CRITEO_DENSE, sparse=CRITEO_SPARSE, dense_transform="none"),
        max_bad_row_ratio=0.1,
    )
    ds = TabularDataset(spec, tmp_path)
    assert [str(b) for b in ds.bad_rows.examples] == [
        "f.tsv:4: field I1: '1e300' is out of float32 range"
    ]
    assert ds.dense[0, 0] == float(rows[0][1] or 0)


def test_hash_names_let_features_share_ids(tmp_path: Path) -> None:
    rows = criteo_rows(5)
    for r in rows:
        r[15] = r[14]  # C2 := C1
    write_criteo(tmp_path / "f.tsv", rows)
    ds = TabularDataset(criteo_spec("f.tsv"), tmp_path, hash_names={"C1": "ids", "C2": "ids"})
    np.testing.assert_array_equal(ds.ids[:, 0], ds.ids[:, 1])
    plain = TabularDataset(criteo_spec("f.tsv"), tmp_path)
    assert not np.any(plain.ids[:, 0] == plain.ids[:, 1])


def test_no_warning_for_a_clean_read(tmp_path: Path) -> None:
    write_criteo(tmp_path / "f.tsv", criteo_rows(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TabularDataset(criteo_spec("f.tsv"), tmp_path)
