"""The command line's logging: ``--log-format json`` writes one object per line
with component, rank and step; ``--log-level COMPONENT=LEVEL`` opens one
component up; ``--quiet`` leaves errors only; ``--version``; a bad level is an
error naming the option. ``estuary eval`` shows a progress bar of its rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from estuary.cli import main
from estuary.metrics.logs import ENV_VAR, LogSettings

from .conftest import TinyJob


def json_lines(err: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in err.splitlines() if line.startswith("{")]


def test_json_logs_carry_component_rank_and_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_job: TinyJob
) -> None:
    job = tiny_job(tmp_path, checkpoint_every_steps=40, metrics_port=0)
    argv = ["train", str(job), "--set", "train.epochs=1", "--log-format", "json"]
    assert main([*argv, "--log-level", "estuary.train=INFO"]) == 0
    err = capsys.readouterr().err
    records = json_lines(err)
    assert records, err
    for record in records:
        assert set(record) >= {"time", "level", "component", "rank", "step", "message"}
        assert record["rank"] == 0
    saved = [r for r in records if r["component"] == "estuary.train.checkpointer"]
    assert [r["step"] for r in saved] == [40, 75]  # periodic, final
    assert all(r["message"].startswith(f"checkpoint of step {r['step']} in ") for r in saved)
    port_line = [r for r in records if r["component"] == "estuary.metrics.prometheus"]
    assert len(port_line) == 1 and port_line[0]["step"] is None  # before the first step
    assert "serving Prometheus metrics at http://127.0.0.1:" in port_line[0]["message"]


def test_component_levels_quiet_and_verbose(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_job: TinyJob
) -> None:
    job = tiny_job(tmp_path, checkpoint_every_steps=40, metrics_port=0)
    argv = ["train", str(job), "--set", "train.epochs=1"]
    assert main(argv) == 0  # default: warnings, and the metrics port line
    err = capsys.readouterr().err
    assert "INFO estuary.metrics.prometheus: serving Prometheus metrics" in err
    assert "checkpoint of step" not in err
    assert main([*argv, "--verbose"]) == 0  # every component at INFO
    assert "INFO estuary.train.checkpointer: checkpoint of step 40" in capsys.readouterr().err
    assert main([*argv, "--quiet"]) == 0
    assert capsys.readouterr().err == ""
    # A component's level beats --quiet's default for the rest.
    assert main([*argv, "--quiet", "--log-level", "train.checkpointer=INFO"]) == 0
    err = capsys.readouterr().err
    assert "checkpoint of step 40" in err and "serving Prometheus" not in err


def test_bad_log_level_is_an_error_naming_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "nowhere", "--log-level", "estuary.ps=LOUD"]) == 2
    err = capsys.readouterr().err
    assert "--log-level" in err and "'estuary.ps=LOUD'" in err and "DEBUG" in err


def test_settings_travel_to_trainer_processes_through_the_environment() -> None:
    settings = LogSettings.parse(["ps=DEBUG"], verbosity=1, fmt="json")
    environ: dict[str, str] = {}
    settings.export(environ)
    assert ENV_VAR in environ
    assert LogSettings.from_env(environ) == settings
    assert settings.levels == {
        "estuary": "INFO",
        "estuary.metrics": "INFO",
        "estuary.ps": "DEBUG",
    }
    assert LogSettings.from_env({}) is None


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("estuary ") and "estuary" in out.split("(", 1)[1]


def test_eval_shows_a_progress_bar_of_its_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_job: TinyJob
) -> None:
    job = tiny_job(tmp_path, progress=True)
    assert main(["train", str(job), "--set", "train.epochs=1", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["eval", str(job), "--checkpoint", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert "eval: 100%" in err and "300/300" in err
    assert main(["eval", str(job), "--checkpoint", str(tmp_path / "run"), "--quiet"]) == 0
    assert "eval:" not in capsys.readouterr().err
