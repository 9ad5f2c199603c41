"""Online equals offline: the server's probability for a row is ``estuary eval``'s
for the same row and checkpoint (within 1e-6), from an export and when following
the run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from estuary.cli import main
from estuary.serve.app import create_app
from estuary.serve.checkpoints import model_from_checkpoint
from estuary.serve.export import load_export
from estuary.serve.model import ServingModel
from estuary.train.checkpoint import load_checkpoint

from .conftest import TinyRun, predict_call, request_all


@pytest.fixture(scope="module")
def eval_predictions(tiny_run: TinyRun, tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    path = tmp_path_factory.mktemp("eval") / "predictions.jsonl"
    argv = ["eval", str(tiny_run.job), "--checkpoint", str(tiny_run.run_dir), "-q"]
    assert main([*argv, "--predictions", str(path)]) == 0
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    labels = [row["label"] for row in tiny_run.eval_rows]
    assert [line["label"] for line in lines] == labels  # the same rows, in the same order
    return np.array([line["prediction"] for line in lines])


def served_predictions(model: ServingModel, rows: list[dict[str, object]]) -> np.ndarray:
    # Several requests, batched differently from eval's batches.
    calls = [predict_call(rows[start : start + 128]) for start in range(0, len(rows), 128)]
    out: list[float] = []
    for reply in request_all(create_app(model), calls):
        assert reply.status_code == 200, reply.text
        assert reply.json()["model_version"] == model.version
        out += reply.json()["predictions"]
    return np.array(out)


def test_an_export_serves_the_predictions_eval_makes(
    tiny_run: TinyRun, eval_predictions: np.ndarray
) -> None:
    online = served_predictions(load_export(tiny_run.export_dir), tiny_run.eval_rows)
    np.testing.assert_allclose(online, eval_predictions, rtol=0, atol=1e-6)


def test_a_followed_run_serves_the_predictions_eval_makes(
    tiny_run: TinyRun, eval_predictions: np.ndarray
) -> None:
    model = model_from_checkpoint(load_checkpoint(tiny_run.run_dir))
    online = served_predictions(model, tiny_run.eval_rows)
    np.testing.assert_allclose(online, eval_predictions, rtol=0, atol=1e-6)


def test_eval_predictions_file_has_one_line_per_eval_row(
    tiny_run: TinyRun, eval_predictions: np.ndarray
) -> None:
    assert eval_predictions.shape == (len(tiny_run.eval_rows),)
    assert ((eval_predictions > 0) & (eval_predictions < 1)).all()


def test_tables_stored_as_bf16_serve_what_eval_predicts(tmp_path: Path) -> None:
    """A job whose tables hold bf16 weights (``dtype: bf16``): the export and a
    followed run serve eval's predictions (the rows widen to float32 exactly)."""
    from .conftest import write_data, write_job

    rows = write_data(tmp_path / "train.tsv", 600)
    job = write_job(tmp_path)
    dtype = ["--set", "model.embedding.default.dtype=bf16"]
    assert main(["train", str(job), "-q", *dtype]) == 0
    predictions = tmp_path / "predictions.jsonl"
    argv = ["eval", str(job), "--checkpoint", str(tmp_path / "out"), "-q", *dtype]
    assert main([*argv, "--predictions", str(predictions)]) == 0
    offline = np.array([json.loads(x)["prediction"] for x in predictions.read_text().splitlines()])
    eval_rows = rows[len(rows) - len(rows) // 5 :]
    assert main(["export", str(tmp_path / "out"), "--output", str(tmp_path / "export")]) == 0
    for model in (
        load_export(tmp_path / "export"),
        model_from_checkpoint(load_checkpoint(tmp_path / "out")),
    ):
        online = served_predictions(model, eval_rows)
        np.testing.assert_allclose(online, offline, rtol=0, atol=1e-6)
