"""A two-trainer run (``--nproc 2``) observed from outside: one progress bar
counting both ranks' rows to the run's total, JSON log lines from the trainer
processes stamped with their rank and step, and a time series whose rows are
every rank's."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from estuary.metrics.timeseries import TIMESERIES_FILE, read_timeseries

from .conftest import TinyJob


def test_two_trainers_show_one_bar_and_log_with_rank_and_step(
    tmp_path: Path, tiny_job: TinyJob
) -> None:
    job = tiny_job(tmp_path, progress=True, checkpoint_every_steps=40)
    argv = ["train", str(job), "--nproc", "2", "--log-format", "json"]
    argv += ["--log-level", "train.checkpointer=INFO"]
    done = subprocess.run(
        [sys.executable, "-m", "estuary.cli", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    err = done.stderr
    # One bar (one start), counting both ranks' rows to 1,200 train rows x 2 epochs.
    assert err.count(" 0%|") == 1, err[-3000:]
    assert set(re.findall(r"\| *[0-9.k]+/([0-9.k]+) \[", err)) == {"2.40k"}, err[-3000:]
    assert "2.40k/2.40k" in err
    records = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    saved = [r for r in records if r["component"] == "estuary.train.checkpointer"]
    # 600 rows per rank and epoch, in 38 steps (the last of 8 rows): 76 steps,
    # a periodic checkpoint at 40 and the final one at 76.
    assert [(r["rank"], r["step"]) for r in saved] == [(0, 40), (0, 76)], records
    series = list(read_timeseries(tmp_path / "run" / TIMESERIES_FILE))
    [start] = [r for r in series if r["kind"] == "start"]
    [end] = [r for r in series if r["kind"] == "end"]
    assert start["world_size"] == 2
    assert end["rows"] == 2400 and end["step"] == 76


def test_each_launch_gives_its_trainers_the_launchers_streams_and_settings(
    tmp_path: Path, tiny_job: TinyJob, capfd: pytest.CaptureFixture[str]
) -> None:
    """Trainers start from a fork server that outlives a run (estuary.runtime.
    launcher): a later run's trainers still write to the launcher's standard
    error of that moment and log with its settings of that moment (the CLI hands
    its --log-* to them through the environment), not the fork server's."""
    from estuary.cli import main

    with capfd.disabled():  # the first run (and maybe the fork server) on other streams
        assert main(["train", str(tiny_job(tmp_path / "a")), "--nproc", "2"]) == 0
    job = tiny_job(tmp_path / "b", checkpoint_every_steps=40)
    argv = ["train", str(job), "--nproc", "2", "--log-format", "json"]
    assert main([*argv, "--log-level", "train.checkpointer=INFO"]) == 0
    records = [json.loads(line) for line in capfd.readouterr().err.splitlines() if line[:1] == "{"]
    saved = [r for r in records if r["component"] == "estuary.train.checkpointer"]
    assert [(r["rank"], r["step"]) for r in saved] == [(0, 40), (0, 76)], records
