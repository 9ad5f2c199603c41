"""The run's time series (``timeseries.jsonl``) and ``estuary report``: a real
run records start, samples, checkpoints, its evaluation and its end; a resume
appends with a restart; the report's PNGs are real images, its page links each
one, and headless Chromium loads every image of the page."""

from __future__ import annotations

import json
import math
import re
import shutil
import struct
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from estuary.cli import main
from estuary.config import load_job
from estuary.metrics.report import render_report
from estuary.metrics.timeseries import TIMESERIES_FILE, TimeSeriesWriter, read_timeseries
from estuary.train import Trainer

from .conftest import DatasetJob, TinyJob


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory, tiny_job: TinyJob) -> Path:
    """A finished run folder (150 steps, a checkpoint every 50)."""
    root = tmp_path_factory.mktemp("run")
    assert main(["train", str(tiny_job(root, checkpoint_every_steps=50))]) == 0
    return root / "run"


def by_kind(run: Path) -> dict[str, list[dict[str, Any]]]:
    kinds: dict[str, list[dict[str, Any]]] = {}
    for record in read_timeseries(run / TIMESERIES_FILE):
        kinds.setdefault(record["kind"], []).append(record)
    return kinds


def test_a_run_records_its_time_series(trained_run: Path) -> None:
    kinds = by_kind(trained_run)
    summary = json.loads((trained_run / "summary.json").read_text())
    steps = summary["steps"]
    assert steps == 150  # 2 epochs x 1200 train rows / 16
    [start] = kinds["start"]
    assert start["step"] == 0 and start["restarts"] == 0 and start["job"] == "tiny"
    samples = kinds["sample"]
    assert len(samples) >= 3
    rows = [s["rows"] for s in samples]
    assert rows == sorted(rows) and rows[-1] == summary["train_rows"] == 16 * steps
    assert [s["step"] for s in samples][-1] == steps
    assert all(s["loss"] > 0 for s in samples if s["loss"] is not None)
    aucs = [s["auc_window"] for s in samples if s["auc_window"] is not None]
    assert aucs and all(0 <= a <= 1 for a in aucs)
    last = samples[-1]
    assert set(last["tables"]) == {"C1", "C2"}
    c1 = last["tables"]["C1"]
    assert c1["rows"] == c1["admissions"] - c1["evictions"] > 0
    assert last["stages"]["steps"] == steps and last["stages"]["forward_backward_s"] > 0
    assert last["data_lag_s"] == {} and last["queues"] == {"sparse_updates": 0}
    # Periodic checkpoints at 50, 100, 150 (the final one lands on 150 too).
    assert [c["step"] for c in kinds["checkpoint"]][:3] == [50, 100, 150]
    assert all(c["duration_s"] > 0 for c in kinds["checkpoint"])
    [evaluation] = kinds["eval"]
    assert evaluation["auc"] == pytest.approx(summary["auc"])
    assert evaluation["rows"] == summary["eval_rows"] == 300
    [end] = kinds["end"]
    assert end["step"] == steps and end["rows"] == summary["train_rows"]
    times = [r["time"] for r in read_timeseries(trained_run / TIMESERIES_FILE)]
    assert times == sorted(times)


def test_a_resume_appends_a_start_with_a_restart(tmp_path: Path, tiny_job: TinyJob) -> None:
    job = tiny_job(tmp_path, checkpoint_every_steps=30)
    assert main(["train", str(job), "--set", "train.epochs=1"]) == 0
    assert main(["train", str(job), "--resume"]) == 0
    starts = by_kind(tmp_path / "run")["start"]
    assert [(s["step"], s["restarts"]) for s in starts] == [(0, 0), (75, 1)]


def test_a_dataset_run_records_data_lag_per_stream(tmp_path: Path, dataset_job: DatasetJob) -> None:
    job = dataset_job(tmp_path, timeseries_every_s=0.01)
    assert main(["train", str(job)]) == 0
    samples = by_kind(tmp_path / "run")["sample"]
    # The newest trained row's window starts at 2026-01-01T01:00Z by the end.
    hour_01 = datetime(2026, 1, 1, 1, tzinfo=UTC).timestamp()
    last = samples[-1]
    assert last["data_lag_s"]["clicks"] == pytest.approx(last["time"] - hour_01, abs=1.0)
    lags = [s["data_lag_s"]["clicks"] - (s["time"] - hour_01) for s in samples]
    assert lags[0] == pytest.approx(3600.0, abs=1.0)  # hour 00 first: an hour more
    assert "data_splits" in last["queues"]
    report = render_report(tmp_path / "run")
    assert "data_lag.png" in {p.name for p in report.images}


def test_no_time_series_when_off(tmp_path: Path, tiny_job: TinyJob) -> None:
    trainer = Trainer(load_job(tiny_job(tmp_path, timeseries_every_s=None)))
    trainer.fit()
    assert not (tmp_path / "run" / TIMESERIES_FILE).exists()


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_report_plots_a_run_and_links_every_plot(
    trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report"
    assert main(["report", str(trained_run), "--out", str(out)]) == 0
    assert f"6 plots: {out / 'index.html'}" in capsys.readouterr().out
    names = sorted(p.name for p in out.glob("*.png"))
    assert names == sorted(
        ["loss.png", "auc.png", "throughput.png", "stages.png", "staleness.png", "tables.png"]
    )
    page = (out / "index.html").read_text()
    for name in names:
        width, height = png_size(out / name)
        assert width >= 400 and height >= 200
        assert f'src="{name}"' in page
    assert "Data lag: the data has no event time" in page
    assert "eval AUC" in page


def test_report_of_a_folder_without_series_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(tmp_path)]) == 2
    assert "no time series" in capsys.readouterr().err


def test_report_plots_data_lag_restarts_and_scaling_when_the_series_has_them(
    tmp_path: Path,
) -> None:
    writer = TimeSeriesWriter(tmp_path)
    writer.write("start", step=0, world_size=2, mode="sync", job="j", restarts=0)
    for step in range(1, 6):
        stages = {"data_s": 0.1 * step, "forward_backward_s": 0.5 * step}
        writer.write(
            "sample",
            step=step * 10,
            rows=step * 640,
            loss=0.7 - 0.02 * step,
            rows_per_s=1000.0,
            auc_window=0.6 + 0.01 * step,
            staleness_max=1,
            stages=stages,
            tables={"a": {"rows": step, "bytes": 64 * step, "admissions": step, "evictions": 0}},
            data_lag_s={"clicks": 30.0 - step},
            queues={"sparse_updates": 1},
        )
        time.sleep(0.01)
    writer.write("scaling", step=30, action="grow", trainers=4, reason="lag over 25 s")
    writer.write("start", step=40, world_size=4, mode="sync", job="j", restarts=1)
    writer.close()
    with (tmp_path / TIMESERIES_FILE).open("a") as torn:
        torn.write('{"kind": "sample", "ti')  # a run killed mid-line
    report = render_report(tmp_path)
    assert {p.name for p in report.images} >= {"data_lag.png", "scaling.png", "stages.png"}
    assert report.skipped == {}
    page = report.index.read_text()
    assert "<th>restarts</th><td>1</td>" in page


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


_MARK_IMAGES = """<script>
window.addEventListener("load", () => {
  for (const img of document.images) {
    img.setAttribute("data-loaded", String(img.complete && img.naturalWidth > 0));
  }
  document.body.setAttribute("data-checked", "yes");
});
</script></body>"""


def loaded_images(browser: str, page: Path) -> dict[str, bool]:
    """src -> whether headless Chromium loaded it (naturalWidth > 0), read from
    the DOM it dumps after the page's load event."""
    probe = page.with_name("probe.html")  # beside the page: relative image paths resolve
    probe.write_text(page.read_text().replace("</body>", _MARK_IMAGES))
    try:
        done = subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",  # root in CI containers
                "--disable-gpu",
                "--allow-file-access-from-files",
                "--virtual-time-budget=10000",
                "--dump-dom",
                probe.as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
    finally:
        probe.unlink()
    dom = done.stdout
    assert 'data-checked="yes"' in dom, f"the page did not finish loading: {done.stderr[-2000:]}"
    images: dict[str, bool] = {}
    for tag in re.findall(r"<img [^>]*>", dom):
        src = re.search(r'src="([^"]+)"', tag)
        assert src is not None, tag
        images[src.group(1)] = 'data-loaded="true"' in tag
    return images


@pytest.mark.skipif(
    chromium() is None,
    reason="headless Chromium not installed (Debian: apt-get install chromium; .ci/run does)",
)
def test_headless_chromium_loads_every_image_of_the_report(
    trained_run: Path, tmp_path: Path
) -> None:
    browser = chromium()
    assert browser is not None
    report = render_report(trained_run, tmp_path / "report")
    images = loaded_images(browser, report.index)
    assert images == {p.name: True for p in report.images}
    # The check can fail: a missing image is seen as not loaded.
    report.images[0].unlink()
    images = loaded_images(browser, report.index)
    assert images[report.images[0].name] is False
    assert sum(images.values()) == len(report.images) - 1


def test_windowed_auc_reads_the_newest_rows_of_the_interval(tmp_path: Path) -> None:
    """The observer keeps each step's logits and labels; the window's AUC is that
    of the interval's rows, the newest ``AUC_WINDOW_ROWS`` at most and
    ``AUC_MIN_ROWS`` at least (whole steps)."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from estuary.metrics.evaluation import roc_auc
    from estuary.metrics.training import TrainingMetrics
    from estuary.train.callbacks import LoopState
    from estuary.train.observe import AUC_WINDOW_ROWS, RunObserver

    engine = SimpleNamespace(
        last_logits=None, last_labels=None, times=SimpleNamespace(as_dict=dict)
    )
    updater = SimpleNamespace(submitted=0, landed=0, log=SimpleNamespace(max_behind=0))
    feed = SimpleNamespace(
        bad_rows=lambda: 0, bad_rows_this_run=lambda: 0, newest_event_s=dict, queue_depths=dict
    )
    observer = RunObserver(
        TrainingMetrics(port=None),
        engine,
        feed,
        {},
        updater,
        folder=tmp_path,
        every_s=3600.0,  # no sample but the ones asked for below
    )
    state = LoopState()
    observer.on_fit_start(state)
    rng = np.random.default_rng(0)
    batch, steps = 8192, 6  # 49,152 rows: the first two steps fall out of the window
    scores, labels = [], []
    for step in range(1, steps + 1):
        y = (rng.random(batch) < 0.3).astype(np.float32)
        # Early steps predict badly, later ones well: the window's AUC shows which it read.
        signal = 0.0 if step <= 2 else 2.0
        logit = rng.normal(size=batch).astype(np.float32) + signal * y
        engine.last_logits, engine.last_labels = torch.from_numpy(logit), torch.from_numpy(y)
        scores.append(logit)
        labels.append(y)
        state.step = step
        observer.after_step(state, batch, 0.5)
    sample = observer.sample()
    newest = AUC_WINDOW_ROWS // batch
    expected = roc_auc(np.concatenate(labels[-newest:]), np.concatenate(scores[-newest:]))
    assert sample.auc_window == pytest.approx(expected)
    assert sample.auc_window > 0.85
    # A short interval (512 rows) reads the newest 2,048 at least: whole steps, so
    # the last 8,192-row step too.
    y = (rng.random(512) < 0.3).astype(np.float32)
    logit = rng.normal(size=512).astype(np.float32)  # no signal
    engine.last_logits, engine.last_labels = torch.from_numpy(logit), torch.from_numpy(y)
    state.step += 1
    observer.after_step(state, 512, 0.5)
    short = observer.sample().auc_window
    expected = roc_auc(np.concatenate([labels[-1], y]), np.concatenate([scores[-1], logit]))
    assert short == pytest.approx(expected)
    assert math.isnan(observer.sample().auc_window)  # nothing trained since
    observer.close()


def test_samples_come_fast_at_first_and_spread_out_to_the_configured_interval() -> None:
    from estuary.train.observe import series_interval_s

    assert series_interval_s(0.0, 10.0) == 0.25
    assert series_interval_s(5.0, 10.0) == 0.25
    assert series_interval_s(100.0, 10.0) == 2.5
    assert series_interval_s(3600.0, 10.0) == 10.0
    assert series_interval_s(0.0, 0.02) == 0.02  # a shorter setting always wins


def test_asynchronous_checkpoints_reach_the_series_from_their_writer(
    tmp_path: Path, tiny_job: TinyJob
) -> None:
    job = tiny_job(tmp_path, checkpoint_every_steps=50, checkpoint_async=True)
    assert main(["train", str(job)]) == 0
    checkpoints = by_kind(tmp_path / "run")["checkpoint"]
    # Mid-run ones committed by the background writer, then the final one.
    assert [c["step"] for c in checkpoints] == [50, 100, 150, 150]
    assert all(c["duration_s"] > 0 for c in checkpoints)
