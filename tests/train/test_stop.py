"""Stop signals: a local flag, and the launcher's shared value seen by a rank."""

from __future__ import annotations

import multiprocessing
import signal

from estuary.train.stop import CollectiveStop, LocalStop


def test_a_local_stop_is_asked_once_requested() -> None:
    stop = LocalStop()
    assert not stop.asked() and not stop.poll(1) and stop.reason() == "a stop request"
    stop.request("SIGTERM")
    assert stop.asked() and stop.poll(2) and stop.reason() == "SIGTERM"


def test_a_collective_stop_reads_the_launchers_signal_and_names_it() -> None:
    value = multiprocessing.get_context("spawn").Value("i", 0)
    stop = CollectiveStop(value, world_size=1)
    assert not stop.asked() and not stop.poll(1)
    value.value = int(signal.SIGINT)  # the launcher on Ctrl-C
    assert stop.asked() and stop.poll(2) and stop.reason() == "SIGINT"


def test_a_collective_stop_requested_in_process_counts_as_its_signal() -> None:
    stop = CollectiveStop(None, world_size=1)
    stop.request("a test")  # not a signal name: polled as SIGTERM, reason kept
    assert stop.asked() and stop.poll(1) and stop.reason() == "a test"
