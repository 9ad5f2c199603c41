"""The preparing process: ``python -m estuary.serve.prepare_process RUN_DIR OUT_DIR``.

Started by a server following a run (``estuary.serve.process_follow``), it does
the work of an update off the server's interpreter and GIL: every ``--poll-s``
it prepares the run's newest checkpoint (``Preparer``: read and verify it,
check its deltas, or prepare it whole), writes it into one of two slot files
of ``OUT_DIR`` (``SlotWriter``: files of a memory-backed folder, taking turns,
each catching up by the deltas it missed) and tells the server.

Protocol (JSON lines; the process's own stdout is moved to stderr, so nothing
else reaches the server's pipe):

- to the server, on the original stdout: ``{"ready": true}`` once started (the
  served checkpoint prepared); then ``{"checkpoint": NAME, "kind":
  "delta"|"full", "file": PATH, "bytes": N, "committed": MTIME, "cpu_s": S,
  "whole": BOOL}`` for a prepared version (``whole``: the slot was written
  whole, not by its missed deltas), or ``{"error": MESSAGE}`` when the
  newest checkpoint does not load (retried at the next poll);
- from the server, on stdin: one line after each prepared version: ``served``
  once it serves it (the next version goes to the other slot, which the server
  no longer reads), or ``skipped`` when it could not (the next one goes to the
  same slot). The next version is prepared only after this line. End of
  stdin (the server stopped, or died: the kernel closes its pipes) ends this
  process, which removes its files.

``--from FOLDER``: the checkpoint the server serves now; it is prepared first
(not sent), so the next one is reached by its deltas.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import select
import signal
import sys
import time
from pathlib import Path
from typing import IO, Any

from estuary.serve.follow import UpdateKind
from estuary.serve.preparer import Prepared, Preparer
from estuary.serve.slots import SlotWriter
from estuary.train.checkpoint_chain import MANIFEST, CheckpointError

__all__ = ["NICE", "main", "version_message"]

logger = logging.getLogger(__name__)

NICE = 10
"""Nice value of the preparing process: it yields the CPU to the server. It holds
no lock or GIL the server waits on, so a lower priority only delays an update."""


def version_message(
    prepared: Prepared, path: Path, size: int, cpu_s: float, whole: bool
) -> dict[str, Any]:
    """What a server is told of a prepared version written into slot file
    ``path`` (``size`` bytes): the protocol's version message (module docstring)."""
    return {
        "checkpoint": prepared.checkpoint.name,
        "kind": prepared.kind.value,
        "file": str(path),
        "bytes": size,
        "committed": (prepared.checkpoint / MANIFEST).stat().st_mtime,
        "cpu_s": cpu_s,
        "whole": whole,
    }


def _send(out: IO[str], message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def _wait_for_server(timeout: float | None) -> bytes:
    """The server's next line, or ``b""`` when it has gone (end of stdin); after
    ``timeout`` seconds without one (``None``: wait), an empty line."""
    if timeout is not None:
        ready, _, _ = select.select([sys.stdin.buffer], [], [], timeout)
        if not ready:
            return b"\n"
    return sys.stdin.buffer.readline()


def serve_versions(run_dir: Path, out_dir: Path, start: str | None, poll_s: float) -> int:
    """The loop of the module docstring; returns when the server goes."""
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything printed goes to stderr, not into the protocol
    preparer = Preparer(run_dir)
    slots = SlotWriter(out_dir)
    if start is not None:
        with contextlib.suppress(CheckpointError, OSError):  # else: the next one whole
            slots.base(preparer.load(Path(start)).tables)
    _send(protocol, {"ready": True})
    try:
        while _wait_for_server(poll_s):
            cpu = time.process_time()
            try:
                prepared = preparer.step()
            except (CheckpointError, OSError) as exc:
                logger.warning("prepare %s: not prepared (retrying): %s", run_dir, exc)
                _send(protocol, {"error": str(exc)})
                continue
            if prepared is None:
                continue
            if prepared.kind is UpdateKind.DELTA:
                path, size = slots.write_deltas(prepared.links, prepared.dense)
            else:
                path, size = slots.write_whole(prepared.tables, prepared.dense)
            message = version_message(
                prepared, path, size, time.process_time() - cpu, slots.last_whole
            )
            _send(protocol, message)
            reply = _wait_for_server(None)  # Blocking wait: the server's answer
            if not reply:
                break
            if reply.strip() == b"served":  # the other slot is free now
                slots.served()
    finally:
        slots.close()
        with contextlib.suppress(OSError):  # the folder, once empty (a server killed)
            out_dir.rmdir()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--from", dest="start", help="the checkpoint folder served now")
    parser.add_argument("--poll-s", type=float, default=0.1)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the server; it ends us
    with contextlib.suppress(AttributeError, OSError):
        os.nice(NICE)
    import torch

    torch.set_num_threads(1)
    return serve_versions(args.run_dir, args.out_dir, args.start, args.poll_s)


if __name__ == "__main__":
    sys.exit(main())
