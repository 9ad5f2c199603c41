"""The hot-shard rebalance plan (``estuary.runtime.scaling.rebalance``): the
hottest slots of the hot shard that even it with the coldest, never a slot
that would overshoot, never every loaded slot."""

from __future__ import annotations

import numpy as np

from estuary.ps.slots import SlotMap
from estuary.runtime.scaling.rebalance import plan_moves


def test_the_moves_even_the_hot_and_the_cold_shard() -> None:
    owners = SlotMap.even(2, slots_per_server=8).owners  # 16 slots, even ones on 0
    loads = np.zeros(16, np.int64)
    loads[owners == 0] = [50, 40, 30, 20, 10, 10, 10, 10]
    loads[owners == 1] = 5
    moves = plan_moves(loads, owners, hot=0, cold=1)
    assert (owners[moves.slots] == 0).all()
    assert moves.hot_load == 180 and moves.cold_load == 40
    assert moves.moved <= (180 - 40) / 2  # never past even
    assert moves.moved >= (180 - 40) / 2 - 10  # and within one slot of it
    assert 0 in moves.slots.tolist()  # the hottest slot (50) goes first


def test_one_slot_hotter_than_the_move_moves_nothing() -> None:
    owners = SlotMap.even(2, slots_per_server=4).owners
    loads = np.zeros(8, np.int64)
    loads[0] = 1000  # one hot id
    loads[1] = 10
    moves = plan_moves(loads, owners, hot=0, cold=1)
    assert moves.slots.size == 0 and moves.share == 0.0


def test_slots_without_load_stay() -> None:
    owners = SlotMap.even(2, slots_per_server=4).owners
    loads = np.zeros(8, np.int64)
    loads[[0, 2]] = 30
    moves = plan_moves(loads, owners, hot=0, cold=1)
    assert moves.slots.tolist() == [0]  # 30 of 60 moves; the idle slots stay
    assert moves.share == 0.5
