"""Drift scenarios (abrupt, gradual, recurring) and new-id bursts of ``estuary synth``."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest

from estuary.cli import main
from estuary.config import ConfigError
from estuary.data.synthetic import SyntheticSpec, epoch_hour, generate_chunks, model_for
from estuary.data.synthetic.model import _Tag, key, permute32
from estuary.metrics.evaluation import evaluate_predictions

START = datetime(2026, 1, 1, tzinfo=UTC)
AT = START + timedelta(hours=10)
SCENARIO = SyntheticSpec(
    rows_per_hour=4000,
    vocab_sizes=(50,) * 4,
    num_dense=0,
    num_interactions=0,
    drift=1.5,
    drift_fraction=1.0,
    diurnal_amplitude=0.0,
    missing_rate=0.0,
    signal_scale=2.0,
    drift_kind="abrupt",
    drift_at=AT,
    seed=4,
)
RANKS = np.arange(50, dtype=np.uint64)


def weights(spec: SyntheticSpec, hours_from_at: float) -> np.ndarray:
    return model_for(spec).value_weights(0, RANKS, epoch_hour(AT) + int(hours_from_at))


def test_default_smooth_data_is_bit_identical_to_before_scenarios() -> None:
    # Digest of this spec's hours 0 and 7 written by the generator before drift
    # kinds existed (commit 403b763): the default kind must not move one bit.
    spec = SyntheticSpec(
        rows_per_hour=2000, vocab_sizes=(1000,) * 8, drift=1.0, drift_period_hours=5, seed=11
    )
    digest = hashlib.sha256()
    for hour in (spec.start_hour, spec.start_hour + 7):
        for c in generate_chunks(spec, hour):
            for a in (c.labels, c.click_prob, c.sparse, c.dense):
                digest.update(a.tobytes())
    assert digest.hexdigest() == "d44163beec881f2165bdb37b3e76c576fbe9c9c6eda2a75edcaa822ce367d970"


def test_abrupt_drift_switches_every_drifting_weight_at_drift_at() -> None:
    before, just_before = weights(SCENARIO, -10), weights(SCENARIO, -1)
    at, after = weights(SCENARIO, 0), weights(SCENARIO, 30)
    assert np.array_equal(before, just_before) and np.array_equal(at, after)
    assert np.all(before != at)  # drift_fraction 1: every value moved
    assert abs(np.corrcoef(before, at)[0, 1]) < 0.6
    # Non-drifting values (drift_fraction 0) never move.
    still = replace(SCENARIO, drift_fraction=0.0)
    assert np.array_equal(weights(still, -1), weights(still, 5))


def test_gradual_drift_blends_linearly_over_the_span() -> None:
    spec = replace(SCENARIO, drift_kind="gradual", drift_span_hours=8)
    a, b = weights(SCENARIO, -1), weights(SCENARIO, 0)  # the abrupt scenario's concepts
    assert np.array_equal(weights(spec, -1), a) and np.array_equal(weights(spec, 0), a)
    np.testing.assert_allclose(weights(spec, 2), 0.75 * a + 0.25 * b, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(weights(spec, 4), 0.5 * (a + b), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(weights(spec, 8), b, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(weights(spec, 20), b, rtol=1e-12, atol=1e-12)


def test_recurring_drift_alternates_concepts_every_period() -> None:
    spec = replace(SCENARIO, drift_kind="recurring", drift_period_hours=6)
    a, b = weights(SCENARIO, -1), weights(SCENARIO, 0)
    for hours, concept in [(-3, a), (0, b), (5, b), (6, a), (11, a), (12, b), (18, a)]:
        assert np.array_equal(weights(spec, hours), concept), hours


def stale_auc(spec: SyntheticSpec, hours_from_at: int) -> float:
    """AUC, on one hour's labels, of the true click model *before* the drift (the
    concept-A model, whose rows are the same: weights never change the draws)."""
    stale = replace(spec, drift_at=AT + timedelta(days=3650))
    hour = epoch_hour(AT) + hours_from_at
    (now,) = generate_chunks(spec, hour)
    (old,) = generate_chunks(stale, hour)
    assert np.array_equal(now.sparse, old.sparse)
    return evaluate_predictions(now.labels, old.click_prob).auc


def test_a_stale_model_drops_at_once_under_abrupt_and_slowly_under_gradual_drift() -> None:
    gradual = replace(SCENARIO, drift_kind="gradual", drift_span_hours=8)
    before = stale_auc(SCENARIO, -1)
    assert before > 0.75  # the stale model is the truth before the drift
    assert before - stale_auc(SCENARIO, 0) > 0.15  # abrupt: the drop is immediate
    early, late = stale_auc(gradual, 1), stale_auc(gradual, 8)
    assert before - early < 0.06  # gradual: a small step after one hour ...
    assert early - late > 0.1  # ... and the full drop by the span's end
    assert abs(late - stale_auc(SCENARIO, 8)) < 0.02


def regular_ids(vocab: int, feature: int, seed: int) -> np.ndarray:
    return permute32(np.arange(vocab, dtype=np.uint64), key(seed, _Tag.PERMUTE, feature))


def test_burst_ids_are_new_outside_the_vocabulary_and_distinct_per_hour() -> None:
    spec = replace(SCENARIO, burst_at=AT, burst_hours=2, burst_share=0.3)
    vocab_ids = regular_ids(50, 0, spec.seed)

    def ids(hours_from_at: int) -> np.ndarray:
        (chunk,) = generate_chunks(spec, epoch_hour(AT) + hours_from_at)
        return chunk.sparse[:, 0]

    before, first, second, after = ids(-1), ids(0), ids(1), ids(2)
    assert np.isin(before, vocab_ids).all() and np.isin(after, vocab_ids).all()
    for burst in (first, second):
        new = ~np.isin(burst, vocab_ids)
        assert 0.25 < new.mean() < 0.35  # burst_share of the values
        assert np.unique(burst[new]).shape[0] > 20  # many new ids, Zipf-drawn
    assert not np.isin(first, second[~np.isin(second, vocab_ids)]).any()  # per-hour ids
    # Hours outside the burst are the no-burst spec's, bit for bit.
    (plain,) = generate_chunks(SCENARIO, epoch_hour(AT) - 1)
    assert np.array_equal(plain.sparse[:, 0], before)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"drift_kind": "sudden"}, "synthetic.drift_kind"),
        ({"drift_at": None}, "synthetic.drift_at"),
        ({"drift_kind": "smooth"}, "synthetic.drift_at"),
        ({"drift_at": AT + timedelta(minutes=5)}, "synthetic.drift_at"),
        ({"drift_span_hours": 0}, "synthetic.drift_span_hours"),
        ({"burst_share": 0.0}, "synthetic.burst_share"),
        ({"burst_at": AT, "burst_hours": 0}, "synthetic.burst_hours"),
        ({"burst_at": AT, "vocab_sizes": (1 << 31,), "burst_hours": 2}, "synthetic.burst_hours"),
        ({"burst_at": datetime(1960, 1, 1, tzinfo=UTC)}, "synthetic.burst_at"),
    ],
)
def test_scenario_fields_are_validated_naming_the_field(change: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        replace(SCENARIO, **change).validate()


def test_synth_command_takes_the_scenario_flags(tmp_path: Path) -> None:
    argv = ["synth", str(tmp_path), "--rows-per-hour", "200", "--hours", "3"]
    argv += ["--start", "2026-01-01T09", "--vocab-sizes", "50", "--num-sparse", "4"]
    argv += ["--drift-kind", "recurring", "--drift-at", "2026-01-01T10"]
    argv += ["--drift-period-hours", "1", "--burst-at", "2026-01-01T11", "--burst-share", "0.5"]
    assert main(argv) == 0
    marker = json.loads((tmp_path / "20260101" / "11" / "_SUCCESS").read_text())
    assert marker["rows"] == 200
    lines = (tmp_path / "20260101" / "11" / "part-00000.tsv").read_text().splitlines()
    spec = SyntheticSpec(
        rows_per_hour=200,
        vocab_sizes=(50,) * 4,
        drift_kind="recurring",
        drift_at=AT,
        drift_period_hours=1,
        burst_at=datetime(2026, 1, 1, 11, tzinfo=UTC),
        burst_share=0.5,
    )
    (chunk,) = generate_chunks(spec, epoch_hour(datetime(2026, 1, 1, 11, tzinfo=UTC)))
    assert [line.split("\t")[0] for line in lines] == [str(v) for v in chunk.labels]
    c1 = [int(line.split("\t")[14], 16) for line in lines if line.split("\t")[14]]
    assert not np.isin(c1, regular_ids(50, 0, 0)).all()  # the burst is in the file
