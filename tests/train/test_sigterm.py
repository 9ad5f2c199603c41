"""``estuary train`` on SIGTERM (a scheduler's preemption) or Ctrl-C: it finishes
the step in progress, checkpoints it, exits 128 + signal, and ``--resume``
trains the rest once."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from estuary.cli import main
from estuary.train import load_checkpoint

from .test_end_to_end import write_criteo, write_job

# Holds training inside step 6 until a stop is requested (at most 60 s), so the
# test's signal lands mid-training.
HELD = """
import sys, time
from pathlib import Path

from estuary.cli import main
from estuary.train.trainer import Trainer

_train_step = Trainer._train_step


def _held(self, *args):
    if self.step == 5:
        Path({marker!r}).write_text("in step 6")
        for _ in range(600):
            if self.stop_reason is not None:
                break
            time.sleep(0.1)
    return _train_step(self, *args)


Trainer._train_step = _held
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_after_the_step_with_a_checkpoint_and_resume_finishes(
    tmp_path: Path, sig: signal.Signals
) -> None:
    write_criteo(tmp_path / "train.tsv", 700)  # 9 steps of 64 per epoch, 2 epochs
    job = write_job(tmp_path, tmp_path / "train.tsv", mode="sync", threads=1)
    marker, script = tmp_path / "held", tmp_path / "held.py"
    script.write_text(HELD.format(marker=str(marker)))
    run = subprocess.Popen(
        [sys.executable, str(script), "train", str(job), "--no-progress"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert run.poll() is None, run.stderr.read() if run.stderr else ""
            assert time.monotonic() < deadline, "training never reached step 6"
            time.sleep(0.05)
        run.send_signal(sig)
        _, err = run.communicate(timeout=120)
    finally:
        run.kill()
    assert run.returncode == 128 + sig, err
    name = sig.name
    assert f"{name}: stopping after this step with a checkpoint" in err
    assert f"stopped by {name} after step 6; checkpoint " in err and "--resume" in err
    assert load_checkpoint(tmp_path / "out").manifest["step"] == 6

    assert main(["train", str(job), "--no-progress", "--resume"]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["steps"] == 18 and summary["train_rows"] == 2 * 560 - 6 * 64
