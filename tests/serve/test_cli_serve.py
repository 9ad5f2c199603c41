"""``estuary serve`` and ``estuary export`` from the command line: a real uvicorn
server on a free loopback port, and the errors a wrong call gets."""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from estuary.cli import main

from .conftest import TinyRun, instances

SRC = Path(__file__).resolve().parents[2] / "src"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_estuary_serve_answers_over_http(tiny_run: TinyRun) -> None:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    argv = ["serve", str(tiny_run.export_dir), "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen([sys.executable, "-m", "estuary.cli", *argv], env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2):
                    break
            except OSError:
                assert server.poll() is None, "the server exited"
                assert time.monotonic() < deadline, "the server did not start in 60 s"
                time.sleep(0.2)
        body = json.dumps({"instances": instances(tiny_run.rows[:3])}).encode()
        url = f"http://127.0.0.1:{port}/predict"
        with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=10) as r:
            reply = json.loads(r.read())
        assert len(reply["predictions"]) == 3
        assert reply["model_version"] == "tiny@step-000000100-2"
        with pytest.raises(urllib.error.HTTPError) as bad:
            urllib.request.urlopen(urllib.request.Request(url, data=b"{"), timeout=10)
        assert bad.value.code == 400
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_serve_needs_exactly_one_of_a_folder_and_follow(
    tiny_run: TinyRun, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve"]) == 2
    assert "--follow" in capsys.readouterr().err
    assert main(["serve", str(tiny_run.export_dir), "--follow", str(tiny_run.run_dir)]) == 2


def test_serving_a_folder_that_is_no_export_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "manifest.json").write_text('{"format": "other"}')
    assert main(["serve", str(tmp_path)]) == 2
    assert "estuary export" in capsys.readouterr().err


def test_run_server_freezes_the_heap_before_serving(
    tiny_run: TinyRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A full collection walks every object not frozen while holding the GIL
    # (~200 ms for a server's ~300k on a busy machine): the server freezes
    # what startup made before the first request, so such pauses stay short.
    import uvicorn

    from estuary.serve.server import ServeOptions, open_served, run_server

    served = open_served(tiny_run.export_dir, None)
    walked: list[bool] = []  # at uvicorn.run: does a collection still walk the model?

    def serve(app: object, **kwargs: object) -> None:
        walked.append(any(o is served.model for g in range(3) for o in gc.get_objects(g)))

    monkeypatch.setattr(uvicorn, "run", serve)
    gc.unfreeze()
    try:
        assert any(o is served.model for o in gc.get_objects())  # walked before
        run_server(served, ServeOptions(port=0))
    finally:
        gc.unfreeze()  # the other tests run with the collector as usual
    assert walked == [False]
