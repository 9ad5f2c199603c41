"""``Subscribers``: the slot bookkeeping of a node's one preparer and its N
readers, without Ray (a fake clock).

Two slots, 0 and 1; ``v1 -> 0`` reads "version 1 is written into slot 0"."""

from __future__ import annotations

import os

import pytest

from estuary.serve.subscribers import Subscribers


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def write(subs: Subscribers, proposed: int, name: str) -> int:
    """The preparer's turn: choose a slot (it must be settled), offer ``name`` in it."""
    assert subs.settled()
    slot = subs.free_slot(proposed).slot
    subs.offer(slot, {"checkpoint": name})
    return slot


def serve_all(subs: Subscribers, *sids: str) -> None:
    for sid in sids:
        offer = subs.offer_for(sid)
        assert offer is not None
        assert subs.answer(sid, offer.seq, served=True)


def test_a_slot_is_written_only_after_every_subscriber_answered_the_version_in_the_other() -> None:
    subs = Subscribers(timeout_s=10, clock=Clock())
    subs.join("a")
    subs.join("b")
    assert write(subs, 0, "v1") == 0  # v1 -> 0
    serve_all(subs, "a")
    assert not subs.settled()  # b still reads its own version: v2 must wait for it
    serve_all(subs, "b")
    assert write(subs, 0, "v2") == 1  # both read 0: v2 -> 1, not over v1
    serve_all(subs, "a", "b")
    assert write(subs, 1, "v3") == 0  # both read 1 now: v3 -> 0 (v1's slot)
    assert subs.slots_read() == {"a": 1, "b": 1}


def test_a_version_skipped_by_all_leaves_its_slot_to_the_next() -> None:
    subs = Subscribers(timeout_s=10, clock=Clock())
    subs.join("a")
    subs.join("b")
    write(subs, 0, "v1")
    serve_all(subs, "a", "b")  # both on slot 0
    write(subs, 1, "v2")  # v2 -> 1
    for sid in ("a", "b"):
        assert subs.answer(sid, 2, served=False)
    assert write(subs, 1, "v3") == 1  # nobody reads 1: v3 over v2, v1 left alone
    assert subs.current is not None and subs.current.message == {"checkpoint": "v1"}


def test_a_silent_subscriber_is_dropped_after_the_deadline_and_the_others_go_on() -> None:
    clock = Clock()
    subs = Subscribers(timeout_s=5, clock=clock)
    subs.join("a")
    subs.join("silent")
    write(subs, 0, "v1")
    clock.now = 4.9
    serve_all(subs, "a")  # a answers (its deadline moves on), silent does not
    assert subs.expire() == [] and not subs.settled()  # within its deadline: waited for
    clock.now = 5.1
    assert subs.expire() == ["silent"]
    assert subs.settled() and "silent" not in subs
    assert not subs.answer("silent", 1, served=True)  # too late: it must join again
    with pytest.raises(KeyError):
        subs.offer_for("silent")
    assert write(subs, 0, "v2") == 1


def test_calls_keep_an_idle_subscriber_alive_and_silence_drops_it() -> None:
    clock = Clock()
    subs = Subscribers(timeout_s=5, clock=clock)
    subs.join("a")
    subs.join("b")
    for now in (3.0, 6.0, 9.0):  # a asks for news every 3 s, b never
        clock.now = now
        assert subs.offer_for("a") is None
        subs.expire()
    assert "a" in subs and "b" not in subs


def test_when_both_slots_are_read_the_readers_of_the_older_version_are_dropped() -> None:
    subs = Subscribers(timeout_s=10, clock=Clock())
    subs.join("a")
    subs.join("b")
    write(subs, 0, "v1")
    serve_all(subs, "a", "b")
    write(subs, 1, "v2")
    serve_all(subs, "a")  # a serves v2 (slot 1)
    assert subs.answer("b", 2, served=False)  # b still serves v1 (slot 0)
    choice = subs.free_slot(1)
    assert (choice.slot, choice.dropped) == (0, ["b"])  # v2 kept, v1's reader dropped
    subs.offer(choice.slot, {"checkpoint": "v3"})
    assert subs.slots_read() == {"a": 1}


def test_a_late_joiner_gets_the_version_its_peers_serve_and_is_waited_for() -> None:
    subs = Subscribers(timeout_s=10, clock=Clock())
    subs.join("a")
    write(subs, 0, "v1")
    serve_all(subs, "a")
    subs.join("late")
    offer = subs.offer_for("late")
    assert offer is not None and offer.message == {"checkpoint": "v1"} and offer.slot == 0
    assert not subs.settled()  # v2 waits until the joiner has mapped v1
    serve_all(subs, "late")
    assert write(subs, 0, "v2") == 1


def test_the_first_version_written_before_anyone_joined_is_offered_to_the_first_joiners() -> None:
    """The preparer hands over the version the replicas serve already (written
    before they join): each joiner gets it, and the next write waits for them."""
    subs = Subscribers(timeout_s=10, clock=Clock())
    assert write(subs, 0, "start") == 0  # nobody yet
    subs.join("a")
    subs.join("b")
    for sid in ("a", "b"):
        offer = subs.offer_for(sid)
        assert offer is not None and offer.message == {"checkpoint": "start"} and offer.slot == 0
    assert not subs.settled()
    serve_all(subs, "a", "b")
    assert subs.current is not None and subs.current.message == {"checkpoint": "start"}
    assert write(subs, 0, "v1") == 1


def test_a_joiner_during_a_write_gets_the_version_being_written() -> None:
    subs = Subscribers(timeout_s=10, clock=Clock())
    subs.join("a")
    write(subs, 0, "v1")
    serve_all(subs, "a")
    slot = subs.free_slot(0).slot  # writing v2 into slot 1
    subs.join("late")
    assert subs.offer_for("late") is None  # not v1: nothing until v2 is offered
    subs.offer(slot, {"checkpoint": "v2"})
    offer = subs.offer_for("late")
    assert offer is not None and offer.message == {"checkpoint": "v2"}


def test_the_last_subscriber_leaving_leaves_none() -> None:
    subs = Subscribers(timeout_s=10, clock=Clock())
    subs.join("a")
    subs.join("b")
    subs.leave("a")
    subs.leave("b")
    assert len(subs) == 0 and subs.joined_total == 2


def test_a_subscriber_whose_process_is_gone_is_dropped_at_once_and_holds_no_write() -> None:
    subs = Subscribers(timeout_s=10, clock=Clock())
    subs.join("a")
    subs.join("b")
    write(subs, 0, "v1")
    serve_all(subs, "a")
    assert not subs.settled()  # b owes its answer, for up to 10 s
    assert subs.drop(["b", "never-joined"]) == ["b"]
    assert subs.settled() and "b" not in subs and subs.dropped_total == 1
    assert write(subs, 0, "v2") == 1


def test_a_preparer_tells_a_live_process_from_a_gone_one_by_its_start_time() -> None:
    import subprocess
    import sys

    from estuary.serve.node_preparer import _birth

    here = _birth(os.getpid())
    assert here is not None and here == _birth(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    born = _birth(child.pid)
    child.wait()  # reaped: no such process any more
    assert born is not None and _birth(child.pid) is None
