"""Runtime backends: found by ``runtime.backend``; one module plus one registry
entry makes a new one; job and role states; the failure policy's decision."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from estuary import plugins, runtime
from estuary.cli import main
from estuary.config import ConfigError, load_job
from estuary.runtime import FailureAction, JobState, RoleFailure, RoleState
from estuary.runtime.failure import FailFast
from estuary.runtime.local import LocalRuntime
from estuary.train import TrainingStopped

from .test_end_to_end import write_criteo, write_job

TOY_BACKEND = '''
"""A toy runtime: trains in this process and notes each run it did."""
from estuary.train import Trainer

RUNS = []


class ToyRuntime:
    def run(self, job, *, resume=False, stop=None, progress=None):
        RUNS.append(job.name)
        trainer = Trainer(job)
        if stop is not None:
            stop.on_request(trainer.request_stop)
        return trainer.fit(progress=False)
'''


@pytest.fixture
def job_path(tmp_path: Path) -> Path:
    write_criteo(tmp_path / "train.tsv", 300)
    return write_job(tmp_path, tmp_path / "train.tsv", mode="sync")


def test_a_backend_is_one_module_and_one_registry_entry(
    job_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    (tmp_path / "toy_backend.py").write_text(TOY_BACKEND)
    monkeypatch.syspath_prepend(str(tmp_path))
    runtime.register_runtime("toy", "toy_backend:ToyRuntime")
    request.addfinalizer(lambda: plugins.RUNTIMES.unregister("toy"))
    out = tmp_path / "out"
    argv = ["train", str(job_path), "--no-progress", "--output", str(out)]
    assert main([*argv, "--set", "runtime.backend=toy"]) == 0
    assert [load_job(job_path).name] == sys.modules["toy_backend"].RUNS
    toy = json.loads((out / "summary.json").read_text())
    assert main(argv) == 0  # the local backend: the same run, the same result
    local = json.loads((out / "summary.json").read_text())
    assert toy["auc"] == local["auc"] and toy["steps"] == local["steps"]


def test_an_unknown_backend_is_an_error_naming_the_known_ones(
    job_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match=r"runtime.backend: unknown backend 'nope' \(known: "):
        runtime.get_runtime("nope")
    # A job naming it is refused at load, like any other unknown plugin name.
    with pytest.raises(ConfigError, match=r"runtime\.backend: must be one of 'local'"):
        load_job(job_path, ["runtime.backend=nope"])
    assert main(["train", str(job_path), "--set", "runtime.backend=nope"]) == 2
    assert "runtime.backend: must be one of 'local'" in capsys.readouterr().err


def test_the_local_runtime_tracks_job_and_role_states(job_path: Path) -> None:
    local = LocalRuntime()
    assert local.state is JobState.PENDING and not local.state.is_terminal
    result = local.run(load_job(job_path), progress=False)
    assert result.train_rows > 0
    assert local.state is JobState.SUCCEEDED and local.state.is_terminal
    assert local.roles == {0: RoleState.FINISHED}


def test_a_stop_requested_before_the_run_stops_it_after_its_first_step(job_path: Path) -> None:
    stop = runtime.StopRequest()
    stop.request("SIGTERM")
    local = LocalRuntime()
    with pytest.raises(TrainingStopped) as info:
        local.run(load_job(job_path), stop=stop, progress=False)
    assert info.value.step == 1 and info.value.reason == "SIGTERM"
    assert local.state is JobState.STOPPED


def test_fail_fast_decides_to_fail_naming_the_rank() -> None:
    decision = FailFast().decide(RoleFailure("trainer", 1, "failed: ValueError: boom"))
    assert decision.action is FailureAction.FAIL
    assert decision.message == "trainer rank 1 failed: ValueError: boom"
