"""A ``ParameterServer`` in its own spawned process, for trainers to share.

::

    parent (trainer launcher)                     child (spawned, daemon)
      ServerProcess(config)   --start-->          _server_main: build tables, bind
        wait_ready()          <--ready pipe--     {"address": ...} or {"error": ...}
        PSClient(address, authkey)  <-->          ParameterServer.serve_forever()
        stop(): "shutdown" op, then terminate/kill if it lingers

The child leaves by itself when its parent dies (``_exit_with_parent``), so a
killed trainer never leaves a server waiting in ``accept()``.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import shutil
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from estuary.ps.client import PSClient
from estuary.ps.server import ParameterServer, default_address
from estuary.ps.types import Address, PSError, PSTimeoutError, ServerConfig


def _exit_with_parent(parent_pid: int) -> None:
    # An orphaned server would wait in accept() forever: leave with the parent.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def _server_main(
    config: ServerConfig, address: Address | None, authkey: bytes, ready: Connection
) -> None:
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    # Ctrl-C reaches the whole process group: the owner stops the server (stop()).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        server = ParameterServer(config, address=address, authkey=authkey)
    except BaseException as exc:
        ready.send_bytes(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
        raise
    ready.send_bytes(json.dumps({"address": server.address}).encode())
    ready.close()
    server.serve_forever()


class ServerProcess:
    """A ``ParameterServer`` in its own spawned process.

    Args:
        config: what the server hosts.
        address: as for ``ParameterServer`` (default: a fresh AF_UNIX socket whose
            folder this object owns).
        startup_timeout_s: longest wait for the process to build its tables.
        wait: block until the server is ready. With ``False`` (and a known
            address) callers may start clients at once (``PSClient`` retries its
            first connect) and call ``wait_ready()`` later: the server's start-up
            (~1-5 s, mostly imports) overlaps theirs.

    Use as a context manager or call ``stop()``. The process exits by itself if
    its parent dies.
    """

    def __init__(
        self,
        config: ServerConfig,
        *,
        address: Address | None = None,
        startup_timeout_s: float = 120.0,
        wait: bool = True,
    ) -> None:
        config.validate()
        self.config = config
        self.authkey = os.urandom(32)
        self.startup_timeout_s = startup_timeout_s
        self._folder: str | None = None
        if address is None:
            address, self._folder = default_address()
        elif not wait and not isinstance(address, str) and address[1] == 0:
            raise ValueError("wait=False needs a fixed address (TCP port 0 is known only later)")
        self.address: Address = address
        ctx = multiprocessing.get_context("spawn")
        self._ready, writer = ctx.Pipe(duplex=False)
        self._process = ctx.Process(
            target=_server_main,
            args=(config, address, self.authkey, writer),
            name="estuary-ps",
            daemon=True,
        )
        self._process.start()
        writer.close()
        self._started = False
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Block until the server listens (or raise why it never will)."""
        if self._started:
            return
        try:
            # Blocking wait: the child imports, builds its tables, reports its address.
            if not self._ready.poll(self.startup_timeout_s):
                raise PSTimeoutError(
                    f"parameter server process not ready within {self.startup_timeout_s:g} s"
                )
            try:
                message = json.loads(self._ready.recv_bytes())
            except EOFError:
                self._process.join(timeout=5)
                raise PSError(
                    f"parameter server process exited (code {self._process.exitcode}) "
                    "before it was ready"
                ) from None
            if "error" in message:
                raise PSError(f"parameter server failed to start: {message['error']}")
        except BaseException:
            self._kill()
            raise
        finally:
            self._ready.close()
        raw = message["address"]
        self.address = raw if isinstance(raw, str) else (str(raw[0]), int(raw[1]))
        self._started = True

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def is_alive(self) -> bool:
        return self._process.is_alive()

    @property
    def exitcode(self) -> int | None:
        """The process's exit code (``-N``: killed by signal N); ``None`` while it runs."""
        return self._process.exitcode

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the server to shut down; terminate it if it does not within ``timeout_s``."""
        if self._started and self._process.is_alive():
            with contextlib.suppress(PSError):
                client = PSClient(self.address, self.authkey, timeout_s=timeout_s)
                try:
                    client.shutdown()
                finally:
                    client.close()
            self._process.join(timeout=timeout_s)
        self._kill()

    def _kill(self) -> None:
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout=5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
