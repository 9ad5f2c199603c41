"""A resume after slots moved (a hot-shard move, a split): the checkpoint's
manifest records the slot map (``routing_metadata``), a resume with as many
servers routes by it before loading (``restore_routing``), and a delta chain
whose base was written under an older map loads every row where the newest
map puts it (the base's own map is not gone back to)."""

from __future__ import annotations

from typing import Any

import numpy as np

from estuary.ps.sharded import ShardedPSClient, restore_routing, routing_metadata
from estuary.ps.snapshots import ServerSnapshot

from .test_split import connect, servers, sorted_state


def run_and_capture(split: bool) -> tuple[Any, ...]:
    """Two servers train; map v1, a full checkpoint, map v2 (slots of v1 move
    back) and, with ``split``, a third server joins; a delta. Returns the
    base, the delta, the manifest's routing, the final state and each server's ids."""
    with servers(2, spare=1, world_size=1) as (a, b, c):
        client = ShardedPSClient([connect(a), connect(b)])
        try:
            table = client.table("u")
            rng = np.random.default_rng(5)

            def steps(n: int) -> None:
                for _ in range(n):
                    ids = rng.integers(0, 300, size=48).astype(np.int64)
                    table.apply_gradients(ids, table.lookup(ids, train=True) + 0.2)

            steps(3)
            client.migrate(client.slot_map.owned(0)[::3], 1)  # map v1
            base = table.state_dict()  # its rows carry map v1
            steps(2)
            client.migrate(client.slot_map.owned(1)[::2], 0)  # map v2
            if split:
                client.add_server(connect(c))  # map v3, three servers
            steps(2)
            delta = table.delta_state_dict()
            saved = routing_metadata([table])
            want = sorted_state(table.state_dict(mark_clean=False))
            held = [p.state_dict(mark_clean=False)["ids"] for p in table.parts]
        finally:
            client.close()
    assert saved is not None and saved["version"] == client.slot_map.version
    assert saved["servers"] == client.servers and len(saved["owners"]) == client.slot_map.slots
    return base, delta, saved, want, held


def resume(count: int, base: Any, delta: Any, saved: Any) -> tuple[Any, list[Any]]:
    """Load the chain into ``count`` fresh servers as a resume does; returns the
    lookup of ``want``'s ids and each server's ids."""
    with servers(count, world_size=1) as fresh:
        resumed = ShardedPSClient([connect(s) for s in fresh])
        try:
            loaded = resumed.table("u")
            restored = restore_routing([loaded], saved)
            assert restored == (count == saved["servers"])
            loaded.load_state_dict(base)
            loaded.apply_delta(delta)
            state = sorted_state(loaded.state_dict(mark_clean=False))
            return state, [p.state_dict(mark_clean=False)["ids"] for p in loaded.parts]
        finally:
            resumed.close()


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_a_chain_across_moves_loads_every_row_where_the_newest_map_puts_it() -> None:
    base, delta, saved, want, held = run_and_capture(split=False)
    state, parts = resume(2, base, delta, saved)
    assert_same(state, want)
    for got, ids in zip(parts, held, strict=True):
        np.testing.assert_array_equal(np.sort(got), np.sort(ids))


def test_a_chain_across_a_split_resumes_into_the_split_count_or_any_other() -> None:
    base, delta, saved, want, held = run_and_capture(split=True)
    state, parts = resume(3, base, delta, saved)
    assert_same(state, want)
    for got, ids in zip(parts, held, strict=True):
        np.testing.assert_array_equal(np.sort(got), np.sort(ids))
    state, _ = resume(2, base, delta, saved)  # another count: the client's own map
    assert_same(state, want)


def test_a_server_snapshot_records_the_map_its_parts_were_captured_at() -> None:
    """An asynchronous checkpoint's ``ps_routing`` is the map at the capture: a
    split by another client since this one last routed is seen (three parts,
    three servers)."""
    with servers(2, spare=1, world_size=1) as (a, b, c):
        trainer = ShardedPSClient([connect(a), connect(b)])
        mover = ShardedPSClient([connect(a), connect(b)])
        try:
            table = trainer.table("u")
            ids = np.arange(64, dtype=np.int64)
            table.apply_gradients(ids, table.lookup(ids, train=True) + 0.1)
            table.wait_applied()
            mover.add_server(connect(c))
            assert trainer.servers == 2  # it has not routed since
            snapshot = ServerSnapshot({"u": table}, delta=False)
            try:
                assert snapshot.parts == {"u": 3}
                assert snapshot.routing is not None and snapshot.routing["servers"] == 3
                assert snapshot.routing["version"] == mover.slot_map.version
            finally:
                snapshot.drop()
        finally:
            trainer.close()
            mover.close()
