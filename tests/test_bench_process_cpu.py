"""``bench/process_cpu.py --threads`` reads each thread's CPU and run-queue wait
from ``/proc/PID/task/TID/schedstat``: a spinning thread's CPU shows, a sleeping
one's does not."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

process_cpu = pytest.importorskip("process_cpu")


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_threads_reads_each_threads_cpu_and_wait() -> None:
    ids: dict[str, int] = {}
    stop = threading.Event()

    def spin() -> None:
        ids["spin"] = threading.get_native_id()
        until = time.thread_time() + 0.2
        while time.thread_time() < until:
            pass
        stop.wait()

    def sleep() -> None:
        ids["sleep"] = threading.get_native_id()
        stop.wait()

    workers = [threading.Thread(target=spin), threading.Thread(target=sleep)]
    for w in workers:
        w.start()
    try:
        while len(ids) < 2:  # both started
            time.sleep(0.01)
        deadline = time.perf_counter() + 5
        got = process_cpu._threads(os.getpid())
        while got[ids["spin"]][1] < 0.2 and time.perf_counter() < deadline:
            time.sleep(0.02)
            got = process_cpu._threads(os.getpid())
    finally:
        stop.set()
        for w in workers:
            w.join()
    _, spin_cpu, spin_wait, spin_slices = got[ids["spin"]]
    _, sleep_cpu, _, _ = got[ids["sleep"]]
    assert spin_cpu >= 0.2
    assert spin_wait >= 0.0 and spin_slices >= 1
    assert sleep_cpu < 0.05
