"""Derived sparse features (``data.schema.features``): each kind's ids, bad rows,
jagged sequence storage through batches and shuffles, config errors, user
transforms, and a job using every kind training end to end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

import estuary
from estuary.config import ConfigError
from estuary.config.loader import job_from_dict
from estuary.data import TabularDataset, feature_seed, hash_array, missing_id, register_transform
from estuary.data.features import CROSS_SEPARATOR
from estuary.data.hashing import hash_bytes
from estuary.data.transforms import TRANSFORMS

HEADER = ["label", "price", "user", "item", "hist", "ts"]


def ident(value: str | int, feature: str) -> int:
    return hash_bytes(value, feature_seed(feature))


def write_csv(path: Path, rows: list[list[str]]) -> Path:
    path.write_text("\n".join(",".join(r) for r in [HEADER, *rows]) + "\n")
    return path


def job(features: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    data = {
        "sources": [{"path": "d.csv", "format": "csv"}],
        "schema": {"dense": ["price"], "sparse": ["user", "item"], "features": features},
        "eval_fraction": 0.0,
        "max_bad_row_ratio": 1.0,
        **extra,
    }
    return {"data": data}


def dataset(
    tmp_path: Path, rows: list[list[str]], features: list[dict[str, Any]]
) -> TabularDataset:
    write_csv(tmp_path / "d.csv", rows)
    spec = job_from_dict(job(features), tmp_path)
    return TabularDataset(spec.data, tmp_path)


ROWS = [
    ["1", "0.5", "u1", "i1", "a|b|c", "14102100"],
    ["0", "1", "u2", "i2", "", "14102113"],
    ["1", "", "", "i1", "b||d|e|f", "14102123"],
    ["0", "250", "u1", "", "z", ""],
]


def test_cross_ids_hash_the_joined_values_in_declaration_order(tmp_path: Path) -> None:
    features = [
        {"name": "ui", "kind": "cross", "columns": ["user", "item"]},
        {"name": "iu", "kind": "cross", "columns": ["item", "user"]},
    ]
    ds = dataset(tmp_path, ROWS, features)
    assert ds.feature_names == ["user", "item", "ui", "iu"]
    sep = CROSS_SEPARATOR
    assert ds.ids[:, 2].tolist() == [
        ident(b"u1" + sep + b"i1", "ui"),
        ident(b"u2" + sep + b"i2", "ui"),
        ident(sep + b"i1", "ui"),  # a missing value joins as empty text
        ident(b"u1" + sep, "ui"),
    ]
    # Order-sensitive: (item, user) hashes item first.
    assert ds.ids[0, 3] == ident(b"i1" + sep + b"u1", "iu")
    assert ds.ids[0, 3] != ident(b"u1" + sep + b"i1", "iu")


def test_bucketize_lower_bound_inclusive_and_missing_is_its_own_bucket(tmp_path: Path) -> None:
    rows = [
        [str(i % 2), v, "u", "i", "", ""]
        for i, v in enumerate(["0.5", "1", "9.99", "10", "250", ""])
    ]
    ds = dataset(
        tmp_path,
        rows,
        [{"name": "pb", "kind": "bucketize", "columns": ["price"], "boundaries": [1, 10]}],
    )
    assert ds.ids[:, 2].tolist() == [
        ident(0, "pb"),  # x < 1
        ident(1, "pb"),  # 1 <= x < 10: the lower bound is inclusive
        ident(1, "pb"),
        ident(2, "pb"),  # x >= 10
        ident(2, "pb"),
        missing_id("pb"),
    ]


def test_bucketize_non_numbers_are_bad_rows(tmp_path: Path) -> None:
    rows = [["1", "abc", "u", "i", "", ""], ["0", "2", "u", "i", "", ""]]
    ds = dataset(
        tmp_path,
        rows,
        [{"name": "pb", "kind": "bucketize", "columns": ["item"], "boundaries": [1]}],
    )
    assert ds.num_rows == 0 and ds.bad_rows.count == 2
    assert "field item: 'i' is not a finite number (bucketize pb)" in ds.bad_rows.examples[1].reason


def test_modulo_truncates_the_hash(tmp_path: Path) -> None:
    ds = dataset(
        tmp_path, ROWS, [{"name": "um", "kind": "modulo", "columns": ["user"], "modulo": 3}]
    )
    seed = feature_seed("um")
    buckets = [np.uint64(hash_bytes(u, seed) & (2**64 - 1)) % np.uint64(3) for u in ["u1", "u2"]]
    expected = [ident(int(buckets[0]), "um"), ident(int(buckets[1]), "um"), missing_id("um")]
    assert ds.ids[:, 2].tolist() == [expected[0], expected[1], expected[2], expected[0]]
    assert len(set(ds.ids[:, 2].tolist())) <= 4


def test_sequence_empty_fields_empty_items_and_truncation(tmp_path: Path) -> None:
    ds = dataset(
        tmp_path, ROWS, [{"name": "h", "kind": "sequence", "columns": ["hist"], "max_length": 3}]
    )
    assert ds.feature_names == ["user", "item", "h"]
    assert ds.ids.shape == (4, 2)  # sequences are stored jagged, not in ids
    batch = ds.take(np.arange(4))
    bag = batch.sparse["h"]
    assert bag.offsets.tolist() == [0, 3, 3, 6, 7]
    expected = [ident(v, "h") for v in ["a", "b", "c", "b", "d", "e", "z"]]  # "" dropped, 'f' cut
    assert bag.values.tolist() == expected
    assert list(batch.sparse) == ["user", "item", "h"]


def test_shuffled_batches_keep_each_rows_bag(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    rows = []
    for r in range(200):
        items = [f"x{int(v)}" for v in rng.integers(0, 30, size=int(rng.integers(0, 5)))]
        rows.append([str(r % 2), str(r), f"u{r}", "i", ";".join(items), ""])
    features = [{"name": "h", "kind": "sequence", "columns": ["hist"], "delimiter": ";"}]
    ds = dataset(tmp_path, rows, features)
    want = {f"u{r}": [ident(v, "h") for v in row[4].split(";") if v] for r, row in enumerate(rows)}
    by_user = {ident(f"u{r}", "user"): f"u{r}" for r in range(200)}
    seen = 0
    for batch in ds.batches("all", 32, shuffle=True, seed=3, epoch=1):
        bag = batch.sparse["h"]
        assert bag.num_rows == batch.num_rows
        for i in range(batch.num_rows):
            user = by_user[int(batch.sparse["user"].values[i])]
            assert bag.values[bag.offsets[i] : bag.offsets[i + 1]].tolist() == want[user]
            sub = batch.take(np.array([i]))
            assert sub.sparse["h"].values.tolist() == want[user]
        seen += batch.num_rows
    assert seen == 200


def test_sequence_bags_survive_bad_rows_and_several_chunks(tmp_path: Path) -> None:
    rows = [
        [str(r % 2), "x" if r % 7 == 3 else str(r), f"u{r}", "i", f"a{r}|b{r}", ""]
        for r in range(400)
    ]
    write_csv(tmp_path / "d.csv", rows)
    spec = job_from_dict(job([{"name": "h", "kind": "sequence", "columns": ["hist"]}]), tmp_path)
    ds = TabularDataset(spec.data, tmp_path, block_size_bytes=512)
    good = [r for r in range(400) if r % 7 != 3]
    assert ds.num_rows == len(good)
    bag = ds.take(np.arange(ds.num_rows)).sparse["h"]
    assert np.diff(bag.offsets).tolist() == [2] * len(good)
    assert bag.values[::2].tolist() == [ident(f"a{r}", "h") for r in good]


def test_transform_feature_and_user_registered_transform(tmp_path: Path) -> None:
    @register_transform("test_upper", expects="lowercase text")
    def _upper(values: pa.Array) -> pa.Array:
        text = values.cast(pa.string())
        ok = pc.match_substring_regex(text, r"^[a-z0-9]*$")
        return pc.if_else(ok, pc.utf8_upper(text), pa.scalar(None, pa.string()))

    try:
        features = [
            {"name": "hour", "kind": "transform", "columns": ["ts"], "transform": "hour_of_day"},
            {"name": "up", "kind": "transform", "columns": ["user"], "transform": "test_upper"},
        ]
        rows = [*ROWS, ["1", "1", "BAD", "i", "", ""]]
        ds = dataset(tmp_path, rows, features)
        assert ds.num_rows == 4 and ds.bad_rows.count == 1
        assert (
            "field user: 'BAD' is not lowercase text (test_upper)" in ds.bad_rows.examples[0].reason
        )
        assert ds.ids[:, 2].tolist() == [
            ident("00", "hour"),
            ident("13", "hour"),
            ident("23", "hour"),
            missing_id("hour"),
        ]
        assert ds.ids[:, 3].tolist() == [
            ident("U1", "up"),
            ident("U2", "up"),
            missing_id("up"),
            ident("U1", "up"),
        ]
    finally:
        TRANSFORMS.pop("test_upper", None)


def test_unknown_transform_names_the_feature_path(tmp_path: Path) -> None:
    features = [{"name": "t", "kind": "transform", "columns": ["ts"], "transform": "nope"}]
    with pytest.raises(
        ConfigError, match=r"data\.schema\.features\[0\]\.transform: unknown transform 'nope'"
    ):
        dataset(tmp_path, ROWS, features)


def test_hash_array_matches_ident_helper() -> None:
    assert hash_array(pa.array(["a"]), feature_seed("h")).tolist() == [ident("a", "h")]


CRITEO = {"path": "d.tsv", "format": "criteo_tsv"}


@pytest.mark.parametrize(
    ("features", "path", "message"),
    [
        (
            [{"name": "x", "kind": "cross", "columns": ["C1"]}],
            "data.schema.features[0].columns",
            "at least 2",
        ),
        (
            [
                {"name": "x", "kind": "cross", "columns": ["C1", "C2"]},
                {"name": "y", "kind": "bucketize", "columns": ["I1"], "boundaries": [1]},
                {"name": "z", "kind": "cross", "columns": ["C1", "C99"]},
            ],
            "data.schema.features[2].columns",
            "'C99' is not a column",
        ),
        (
            [{"name": "x", "kind": "bucketize", "columns": ["I1"]}],
            "data.schema.features[0].boundaries",
            "required",
        ),
        (
            [{"name": "x", "kind": "bucketize", "columns": ["I1"], "boundaries": [2, 1]}],
            "data.schema.features[0].boundaries",
            "strictly increasing",
        ),
        (
            [{"name": "x", "kind": "modulo", "columns": ["C1"], "modulo": 0}],
            "data.schema.features[0].modulo",
            ">= 1",
        ),
        (
            [{"name": "x", "kind": "cross", "columns": ["C1", "C2"], "modulo": 3}],
            "data.schema.features[0].modulo",
            "not used by kind 'cross'",
        ),
        (
            [{"name": "x", "kind": "sequence", "columns": ["C1"], "max_length": 0}],
            "data.schema.features[0].max_length",
            ">= 1",
        ),
        (
            [{"name": "x", "kind": "sequence", "columns": ["C1"], "delimiter": ""}],
            "data.schema.features[0].delimiter",
            "must not be empty",
        ),
        (
            [{"name": "x", "kind": "hash", "columns": ["C1"]}],
            "data.schema.features[0].kind",
            "must be one of",
        ),
        (
            [{"name": "C1", "kind": "modulo", "columns": ["C2"], "modulo": 4}],
            "data.schema.features[0].name",
            "already a column",
        ),
        (
            [{"name": "x", "kind": "modulo", "columns": ["C2"], "modulo": 4}] * 2,
            "data.schema.features[1].name",
            "already declared",
        ),
        (
            [{"name": "x", "kind": "modulo", "columns": ["label"], "modulo": 4}],
            "data.schema.features[0].columns[0]",
            "label column",
        ),
        (
            [{"name": "x", "kind": "transform", "columns": ["C1"]}],
            "data.schema.features[0].transform",
            "required",
        ),
    ],
)
def test_config_errors_name_the_path(
    features: list[dict[str, Any]], path: str, message: str
) -> None:
    data = {
        "sources": [CRITEO],
        "schema": {"dense": ["I1"], "sparse": ["C1", "C2"], "features": features},
    }
    with pytest.raises(ConfigError) as info:
        job_from_dict({"data": data})
    assert info.value.path == path
    assert message in str(info.value)


def test_derived_features_may_have_table_overrides_and_share_tables() -> None:
    data = {
        "sources": [CRITEO],
        "schema": {
            "sparse": ["C1"],
            "features": [{"name": "h", "kind": "sequence", "columns": ["C2"]}],
        },
    }
    embedding = {"tables": {"h": {"pooling": "mean"}}, "shared": {"ids": ["C1", "h"]}}
    with pytest.raises(ConfigError, match=r"model\.embedding\.tables\.h"):
        job_from_dict({"data": data, "model": {"embedding": embedding}})
    embedding = {"tables": {"h": {"pooling": "mean"}}}
    spec = job_from_dict({"data": data, "model": {"embedding": embedding}})
    assert spec.table_spec("h").pooling == "mean"
    bad = {"tables": {"hh": {"dim": 4}}}
    with pytest.raises(ConfigError, match="did you mean 'h'"):
        job_from_dict({"data": data, "model": {"embedding": bad}})


def test_a_job_with_every_kind_trains(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(600):
        u, i = int(rng.integers(0, 20)), int(rng.integers(0, 10))
        price = float(rng.lognormal(2, 1))
        hist = "|".join(f"i{int(v)}" for v in rng.integers(0, 10, size=int(rng.integers(0, 6))))
        p = 1 / (1 + np.exp(-((u + i) % 3 - 1 + (price > 10) * 0.5)))
        label = int(rng.random() < p)
        ts = f"141021{int(rng.integers(0, 24)):02d}"
        rows.append([str(label), f"{price:.2f}", f"u{u}", f"i{i}", hist, ts])
    write_csv(tmp_path / "d.csv", rows)
    spec = job(
        [
            {"name": "ui", "kind": "cross", "columns": ["user", "item"]},
            {"name": "pb", "kind": "bucketize", "columns": ["price"], "boundaries": [1, 5, 10, 50]},
            {"name": "um", "kind": "modulo", "columns": ["user"], "modulo": 8},
            {"name": "hist", "kind": "sequence", "columns": ["hist"], "max_length": 4},
            {"name": "hour", "kind": "transform", "columns": ["ts"], "transform": "hour_of_day"},
        ],
        eval_fraction=0.2,
    )
    spec["model"] = {
        "type": "dlrm",
        "params": {"bottom_mlp": [8, 4], "top_mlp": [8]},
        "embedding": {"default": {"dim": 4}, "tables": {"hist": {"pooling": "mean"}}},
    }
    spec["train"] = {"batch_size": 64, "epochs": 2, "seed": 1, "shuffle": True}
    spec["output"] = {"dir": "out", "progress": False}
    trainer = estuary.Trainer(job_from_dict(spec, tmp_path))
    assert trainer.features == ["user", "item", "ui", "pb", "um", "hist", "hour"]
    result = trainer.fit(progress=False)
    assert result.train_rows == 2 * 480
    assert result.eval is not None and result.eval.rows == 120
    assert np.isfinite(result.eval.logloss) and 0.0 <= result.eval.auc <= 1.0
    assert set(trainer.tables) == {"user", "item", "ui", "pb", "um", "hist", "hour"}
    assert len(trainer.tables["hist"]) >= 10  # i0..i9 each got a row
    assert len(trainer.tables["pb"]) <= 6  # 5 buckets (+ missing)
