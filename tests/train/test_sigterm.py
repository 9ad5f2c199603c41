"""``estuary train`` on SIGTERM (a scheduler's preemption) or Ctrl-C: it finishes
the step in progress, checkpoints it, exits 128 + signal, and ``--resume``
trains the rest once."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from estuary.cli import main
from estuary.train import load_checkpoint

from .test_end_to_end import write_criteo, write_job


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_after_the_step_with_a_checkpoint_and_resume_finishes(
    tmp_path: Path,
    sig: signal.Signals,
    signal_in_step_6: Callable[[list[str], signal.Signals], tuple[int, str]],
) -> None:
    write_criteo(tmp_path / "train.tsv", 700)  # 9 steps of 64 per epoch, 2 epochs
    job = write_job(tmp_path, tmp_path / "train.tsv", mode="sync", threads=1)
    code, err = signal_in_step_6(["train", str(job), "--no-progress"], sig)
    assert code == 128 + sig, err
    name = sig.name
    assert f"{name}: stopping after this step with a checkpoint" in err
    assert f"stopped by {name} after step 6; checkpoint " in err and "--resume" in err
    assert load_checkpoint(tmp_path / "out").manifest["step"] == 6

    assert main(["train", str(job), "--no-progress", "--resume"]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 18 and summary["train_rows"] == 2 * 560 - 6 * 64
