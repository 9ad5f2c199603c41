"""Fixtures shared by every test folder."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

# `estuary` run so that rank 0 (the only trainer, or rank 0 of --nproc W) holds
# inside step 6 until a stop is asked of it (at most 60 s): a test's signal then
# lands mid-training, at a known step.
_HELD_CLI = """
import multiprocessing, sys, time
from pathlib import Path


def _hold(state):  # every trainer process runs this module's top level
    if state.rank == 0 and state.step == 5:
        Path({marker!r}).write_text("in step 6")
        for _ in range(600):
            if state.stop.asked():
                break
            time.sleep(0.1)


# A parameter-server process (spawned: it runs this top level too) needs neither
# the patch nor the trainer's imports (torch: seconds per server started).
if multiprocessing.current_process().name != "estuary-ps":
    from estuary.train import Trainer
    from estuary.train.callbacks import FaultInjection

    Trainer.default_callbacks.append(lambda: FaultInjection(_hold))

if __name__ == "__main__":
    from estuary.cli import main

    sys.exit(main(sys.argv[1:]))
"""

HeldRun = Callable[[list[str], signal.Signals], tuple[int, str]]


@pytest.fixture
def signal_in_step_6(tmp_path: Path) -> HeldRun:
    """``run(argv, sig)``: ``estuary *argv`` in a subprocess, ``sig`` sent to it once
    rank 0 is inside step 6; returns (exit code, stderr)."""

    def run(argv: list[str], sig: signal.Signals) -> tuple[int, str]:
        marker, script = tmp_path / "held", tmp_path / "estuary_held.py"
        script.write_text(_HELD_CLI.format(marker=str(marker)))
        proc = subprocess.Popen(
            [sys.executable, str(script), *argv], stderr=subprocess.PIPE, text=True
        )
        try:
            deadline = time.monotonic() + 120
            while not marker.is_file():
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                assert time.monotonic() < deadline, "training never reached step 6"
                time.sleep(0.05)
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
        return proc.returncode, err

    return run


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``-n 2 --dist loadgroup``): every test that runs Ray
    goes to one worker, so they share that worker's one local Ray instance
    (tests/cluster/conftest.py) instead of each worker starting its own."""
    for item in items:
        path = Path(str(item.path))
        if "cluster" in path.parts or "ray_instance" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("ray"))
