"""``train.mixed_buffer`` on Ray with data executors: the buffer ranks rows by
their content at rank 0, so ``runtime.ray.data_delivery: auto`` delivers through
rank 0 there, and an explicit ``direct`` is refused at load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from estuary.config import ConfigError
from estuary.config.spec import data_delivery
from estuary.data.synthetic import SynthOutput, write_synthetic

from ..train.test_mixed_feed import HOURS, ROWS, SPEC, SURGE, job_for

pytestmark = pytest.mark.ray

RAY = {"backend": "ray", "data_executors": 1}


def test_auto_delivery_is_rank0_for_a_mixed_buffer_and_direct_otherwise(tmp_path: Path) -> None:
    assert data_delivery(job_for(tmp_path, SURGE, runtime=RAY)) == "rank0"
    assert data_delivery(job_for(tmp_path, None, runtime=RAY)) == "direct"
    rank0 = {**RAY, "ray": {"data_delivery": "rank0"}}
    assert data_delivery(job_for(tmp_path, None, runtime=rank0)) == "rank0"
    with pytest.raises(ConfigError) as refused:
        job_for(tmp_path, SURGE, runtime={**RAY, "ray": {"data_delivery": "direct"}})
    assert refused.value.path == "runtime.ray.data_delivery"
    assert "mixed_buffer" in str(refused.value)


def test_a_surge_through_the_buffer_on_ray_executors_accounts_for_every_row(
    ray_instance: Any, tmp_path: Path
) -> None:
    """The same surge as tests/train/test_mixed_feed.py, read by a data executor
    on Ray: every row trained once or dropped once, and all of them scored."""
    from estuary.runtime.ray import RayRuntime

    write_synthetic(SPEC, tmp_path / "data", SynthOutput(format="criteo_tsv"))
    result = RayRuntime().run(job_for(tmp_path, SURGE, runtime=RAY), progress=False)
    extra, total = result.extra, HOURS * ROWS
    assert extra["data_delivery"] == "rank0"
    sources = extra["mixed_buffer"]["sources"]
    assert sum(c["offered"] for c in sources.values()) == total
    dropped = sum(c["sampled_out"] + c["evicted"] for c in sources.values())
    taken = sum(c["taken"] for c in sources.values())
    assert dropped > 0 and taken > 0  # offered 3x faster than trained: rows were shed
    assert extra["rows_committed"] == taken and extra["rows_dropped"] == dropped
    assert taken + dropped == total and extra["duplicate_rows"] == 0
    assert extra["progressive"]["rows"] == total
