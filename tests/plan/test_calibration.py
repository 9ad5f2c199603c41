from __future__ import annotations

from pathlib import Path

import pytest

from estuary.config import load_job
from estuary.plan.calibration import calibrate
from estuary.plan.costs import load_costs, save_costs

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "criteo.yaml"
# The first 10,000 lines of the DAC training data: the example's model and
# tables on a third of its sample's rows (the timed fits and loads shrink with
# the rows; the multi-process probes time fixed step counts either way).
HEAD_10K = EXAMPLE.parents[2] / "shared" / "data" / "criteo_dac_head10k.txt.gz"


@pytest.mark.slow
def test_calibration_of_the_real_code_round_trips(tmp_path: Path) -> None:
    """One repeat of every timed run on the Criteo example's job over 10,000 rows
    (under a minute): every figure is positive where the code does work, the file reads
    back equal, and the job's run folder is left alone."""
    out = tmp_path / "run"
    overrides = ["train.batch_size=512", f"output.dir={out}", f"data.sources[0].path={HEAD_10K}"]
    job = load_job(EXAMPLE, overrides)
    costs = calibrate(job, repeats=1)
    assert not out.exists()  # its fits write nothing into the job's run folder
    assert costs.sparse_features == 26 and costs.embedding_dim == 16
    for name in ("parse_s_per_row", "dense_s_per_row", "bytes_per_row", "net_bytes_per_s"):
        assert getattr(costs, name) > 0, name
    assert costs.lookup_s_per_id + costs.lookup_s_per_call > 0
    assert 0 < costs.unique_exp <= 1
    assert costs.machine["distinct_ids"] > 1000
    path = tmp_path / "costs.json"
    save_costs(costs, path)
    assert load_costs(path) == costs
