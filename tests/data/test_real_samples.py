"""The real Criteo and Avazu samples in /work/shared/data read cleanly and match the
statistics published in that folder's README (skipped where the files are absent)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from estuary.config.spec import DataSpec, SchemaSpec, SourceSpec
from estuary.data import TabularDataset

from .ctr_datagen import AVAZU_SPARSE, CRITEO_DENSE, CRITEO_SPARSE

SAMPLES = Path(os.environ.get("ESTUARY_SAMPLE_DATA", "/work/shared/data"))

pytestmark = pytest.mark.slow


def need(name: str) -> str:
    if not (SAMPLES / name).is_file():
        pytest.skip(f"{SAMPLES / name} not present")
    return name


def criteo(name: str) -> TabularDataset:
    spec = DataSpec(
        sources=[SourceSpec(path=need(name))],
        schema=SchemaSpec(dense=CRITEO_DENSE, sparse=CRITEO_SPARSE),
        max_bad_row_ratio=0.0,
    )
    return TabularDataset(spec, SAMPLES)


def avazu(name: str) -> TabularDataset:
    spec = DataSpec(
        sources=[SourceSpec(path=need(name), format="csv")],
        schema=SchemaSpec(label="click", sparse=AVAZU_SPARSE, transforms={"hour": "hour_of_day"}),
        max_bad_row_ratio=0.0,
    )
    return TabularDataset(spec, SAMPLES)


def distinct_per_feature(ds: TabularDataset) -> list[int]:
    return [len(np.unique(ds.ids[:, f])) for f in range(ds.ids.shape[1])]


def test_criteo_head10k() -> None:
    ds = criteo("criteo_dac_head10k.txt.gz")
    assert ds.num_rows == 10_000 and ds.bad_rows.count == 0
    assert ds.labels.mean() == pytest.approx(0.2182, abs=5e-5)
    # README: distinct values in C1..C26 (empty counted as one); ids must not collide.
    assert distinct_per_feature(ds) == [
        175, 386, 5521, 4033, 56, 8, 3184, 93, 3, 2986, 2084, 5284, 1725,
        24, 2035, 4724, 9, 1149, 547, 4, 5037, 8, 12, 2525, 40, 1939,
    ]  # fmt: skip
    # Only I2 has negative counts (-1 and -2 here): signed log1p keeps their sign.
    negative_columns = np.flatnonzero((ds.dense < 0).any(axis=0))
    assert negative_columns.tolist() == [CRITEO_DENSE.index("I2")]
    assert ds.dense[:, 1].min() == pytest.approx(-np.log1p(2.0))


def test_criteo_34k_chronological_sample() -> None:
    ds = criteo("criteo_dac_sample_34k.tsv.gz")
    assert ds.num_rows == 34_578 and ds.bad_rows.count == 0
    assert ds.labels.mean() == pytest.approx(0.2464, abs=5e-5)
    assert distinct_per_feature(ds) == [
        317, 481, 17725, 11283, 86, 12, 5872, 159, 3, 6870, 3230, 16605, 2519,
        24, 3639, 14347, 9, 1917, 900, 4, 15651, 10, 13, 6232, 48, 4813,
    ]  # fmt: skip


def test_avazu_head10k() -> None:
    ds = avazu("avazu_head10k.csv.gz")
    assert ds.num_rows == 9_999 and ds.bad_rows.count == 0
    assert ds.labels.mean() == pytest.approx(0.1706, abs=5e-5)
    assert len(np.unique(ds.ids[:, AVAZU_SPARSE.index("hour")])) == 1  # all hour 00


def test_avazu_42k_two_hours() -> None:
    ds = avazu("avazu_sample_42k.csv.gz")
    assert ds.num_rows == 42_490 and ds.labels.mean() == pytest.approx(0.1736, abs=5e-5)
    distinct = dict(zip(AVAZU_SPARSE, distinct_per_feature(ds), strict=True))
    assert distinct["hour"] == 2  # 14102100 and 14103023 -> "00", "23"
    assert distinct["device_ip"] == 25497 and distinct["site_id"] == 722
    _, eval_ = ds.split()
    assert eval_.num_rows == 4249  # the last 10%: all from the last hour
