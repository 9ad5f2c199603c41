"""Fixtures shared by every test folder."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from estuary.metrics.logs import LOG_CONTEXT

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


@pytest.fixture(autouse=True)
def pristine_logging() -> Iterator[None]:
    """Every test starts, and leaves the next fixture, with the ``estuary``
    loggers its process began with. An in-process ``main`` (in a test or in a
    fixture of any scope) or ``LogSettings.apply`` sets their levels and
    handler, and ``-q`` leaves errors only, so a later test in the same process
    would miss the warnings it looks for (caplog sees only what the loggers pass
    on). Which tests share a process depends on pytest-xdist's split:
    tests/serve's session fixture trains with ``-q``, and a test of
    tests/embedding, run after it on the same worker, saw no warning."""
    _reset_loggers()
    yield
    _reset_loggers()


def _reset_loggers() -> None:
    for logger in _estuary_loggers():
        # One made since this process began gets NOTSET (its parents' level)
        # and no handlers.
        handlers, level, disabled = _PRISTINE_LOGGERS.get(logger.name, ([], logging.NOTSET, False))
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.disabled = disabled
    LOG_CONTEXT.rank, LOG_CONTEXT.step = 0, None


def _estuary_loggers() -> list[logging.Logger]:
    """The ``estuary`` logger and every one made below it so far."""
    named = list(logging.Logger.manager.loggerDict.items())
    below = [g for n, g in named if n.startswith("estuary.") and isinstance(g, logging.Logger)]
    return [logging.getLogger("estuary"), *below]


_PRISTINE_LOGGERS = {
    lg.name: (list(lg.handlers), lg.level, lg.disabled) for lg in _estuary_loggers()
}


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


# The first scheduler a hook returns is the one xdist uses; its own hook is
# trylast, and tryfirst here says so plainly.
@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's ``--dist loadfile`` (pyproject.toml's default, 2 workers),
    with every test of tests/cluster (the Ray tests) in one unit: they run on
    one worker and share its one local Ray instance (tests/cluster/conftest.py)
    instead of each worker starting its own. Every other file's tests run on
    one worker, in file order: some build on what the test before them left in
    a module-scoped fixture (tests/serve/test_process_follow.py). The test ids
    stay as they are (xdist's ``loadgroup`` adds ``@group`` to every id)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class RayTestsTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return "ray" if file.startswith("tests/cluster/") else file

    return RayTestsTogether(config, log)
