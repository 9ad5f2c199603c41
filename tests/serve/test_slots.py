"""Slot files written by what they missed (``estuary.serve.slots``): each slot
catches up in place by the deltas of the versions written into the other one,
and looks up what the tables merged in memory look up; a table outgrowing its
region moves to the file's room (the other tables stay), or, without room, the
slot is rewritten whole, as a whole version or a new chain is; the version the
server serves is never written; the reader maps in only the pages versions use."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from estuary.embedding.delta import BASE, EVICTED_IDS, IDS, LINEAGE, VERSION, WEIGHTS
from estuary.serve.checkpoints import model_from_checkpoint
from estuary.serve.follow import UpdateKind
from estuary.serve.prefault import Prefaulter
from estuary.serve.prepared import PreparedTable
from estuary.serve.preparer import Preparer
from estuary.serve.slot_table import SlotTable
from estuary.serve.slots import PreparedVersion, SlotReader, SlotWriter
from estuary.train.checkpoint import load_checkpoint

from .conftest import TinyRun
from .test_follow import D1, D2, D3, FULL, NEXT_FULL, land

DENSE = {"w": torch.arange(4, dtype=torch.bfloat16), "b": torch.ones(2)}


def served_table(version: PreparedVersion, name: str, shards: int = 1) -> SlotTable:
    index, weights, unknown, rows = version.tables[name]
    return SlotTable(name, index, weights, unknown, shards, rows)


def test_slots_look_up_what_restored_tables_do(tiny_run: TinyRun, tmp_path: Path) -> None:
    follow = tmp_path / "run"
    preparer = Preparer(follow)
    writer, reader = SlotWriter(tmp_path / "slots"), SlotReader()
    (tmp_path / "slots").mkdir()
    kinds, whole = [], []
    for i, name in enumerate((FULL, D1, D2, D3, NEXT_FULL)):
        land(tiny_run, follow, name)
        prepared = preparer.step()
        assert prepared is not None and prepared.checkpoint.name == name
        kinds.append(prepared.kind)
        if prepared.kind is UpdateKind.DELTA:
            path, size = writer.write_deltas(prepared.links, prepared.dense)
        else:
            path, size = writer.write_whole(prepared.tables, prepared.dense)
        whole.append(writer.last_whole)
        version = reader.read(path, size)
        restored = model_from_checkpoint(load_checkpoint(follow / "checkpoints" / name))
        rng = np.random.default_rng(i)
        for table_name in version.tables:
            shards = restored.plan.tables[table_name].shards
            table = served_table(version, table_name, shards)
            held = restored.tables[table_name].state_dict()["ids"]
            ids = np.concatenate([held, np.arange(-20, 20), rng.integers(0, 2**62, 50)])
            np.testing.assert_array_equal(
                table.lookup(ids, train=False), restored.tables[table_name].lookup(ids, train=False)
            )
            np.testing.assert_array_equal(table.state_dict()["ids"], np.sort(held))
            assert table.stats().rows == held.size
        for key, tensor in restored.dense_model.state_dict().items():
            torch.testing.assert_close(version.dense[key], tensor, rtol=0, atol=0)
        if i != 2:  # D2's version is not taken (skipped): D3 goes to the same slot
            writer.served()
    assert preparer.step() is None
    assert kinds == [UpdateKind.FULL, *[UpdateKind.DELTA] * 3, UpdateKind.FULL]
    # FULL whole; D1 into the other slot, which starts from FULL: whole; D2 into
    # FULL's slot by D1's and D2's deltas; D3 (D2 skipped) there by D3's; a new chain.
    assert whole == [True, True, False, False, True]
    writer.close()


def delta(
    ids: list[int], value: float, version: int, evicted: tuple[int, ...] = ()
) -> dict[str, np.ndarray]:
    return {
        IDS: np.array(ids, np.int64),
        WEIGHTS: np.full((len(ids), 2), value, np.float32),
        EVICTED_IDS: np.array(evicted, np.int64),
        BASE: np.array([version - 1]),
        LINEAGE: np.array([7]),
        VERSION: np.array([version]),
    }


def test_a_slot_applies_what_it_missed_in_place_and_grows_whole(tmp_path: Path) -> None:
    ids = np.arange(4, dtype=np.int64) * 3  # 0 3 6 9
    base = PreparedTable("t", ids, np.ones((4, 2), np.float32), np.zeros((1, 2), np.float32), 7, 0)
    writer, reader = SlotWriter(tmp_path, room=1.0), SlotReader()  # no room: grows whole
    writer.base({"t": base})
    links = [
        {"t": delta([3, 4, -5], 2.0, 1, evicted=(6,))},  # 3 updated, 4 and -5 new, 6 gone
        {"t": delta([4, 100], 3.0, 2, evicted=(0,))},
    ]
    first, size = writer.write_deltas(links[:1], DENSE)  # slot 0: from the base, whole
    served = reader.read(first, size)
    writer.served()
    second, size = writer.write_deltas(links[1:], DENSE)  # slot 1: whole
    first_expect = {-5: 2.0, 0: 1.0, 3: 2.0, 4: 2.0, 9: 1.0}  # the served one, untouched
    table = served_table(served, "t")
    ids = table.state_dict()["ids"]
    np.testing.assert_array_equal(ids, sorted(first_expect))
    np.testing.assert_array_equal(
        table.lookup(ids, train=False)[:, 0], [first_expect[k] for k in ids]
    )
    writer.served()
    expect = {-5: 2.0, 3: 2.0, 4: 3.0, 9: 1.0, 100: 3.0}
    third, size = writer.write_deltas([{"t": delta([9], 4.0, 3)}], DENSE)  # slot 0 catches up
    assert third == first and not writer.last_whole
    expect[9] = 4.0
    table = served_table(reader.read(third, size), "t")
    np.testing.assert_array_equal(table.state_dict()["ids"], sorted(expect))
    np.testing.assert_array_equal(
        table.lookup(np.array([*sorted(expect), 6, 0]), train=False)[:, 0],
        [expect[k] for k in sorted(expect)] + [0.0, 0.0],  # evicted: the unknown row
    )
    writer.served()
    many = list(range(1000, 4000))  # more new rows than slot 1's region holds
    fourth, size = writer.write_deltas([{"t": delta(many, 5.0, 4)}], DENSE)
    assert writer.last_whole and fourth != second and not second.exists()
    table = served_table(reader.read(fourth, size), "t")
    assert table.stats().rows == len(expect) + len(many)
    np.testing.assert_array_equal(table.lookup(np.array([9, 1500]), train=False)[:, 0], [4.0, 5.0])
    assert writer.writes == 4 and writer.whole_writes == 3 and writer.moves == 0
    torch.testing.assert_close(reader.read(fourth, size).dense["w"], DENSE["w"])
    writer.close()
    assert list(tmp_path.iterdir()) == []


def test_a_table_that_outgrows_its_region_moves_into_the_files_room(tmp_path: Path) -> None:
    small = PreparedTable(
        "s",
        np.array([1, 2], np.int64),
        np.ones((2, 2), np.float32),
        np.zeros((1, 2), np.float32),
        7,
        0,
    )
    big = PreparedTable(
        "t",
        np.arange(4, dtype=np.int64),
        np.ones((4, 2), np.float32),
        np.zeros((1, 2), np.float32),
        7,
        0,
    )
    writer, reader = SlotWriter(tmp_path, slots=1, room=8.0), SlotReader()
    path, size = writer.write_whole({"s": small, "t": big}, DENSE)
    writer.served()
    first = reader.read(path, size).tables["s"]
    before = first[1]  # the small table's rows, a view
    many = list(range(100, 3100))  # more new rows than t's region (1,028) holds
    again, size = writer.write_deltas([{"t": delta(many, 5.0, 1)}], DENSE)
    assert again == path and not writer.last_whole and writer.moves == 1
    assert writer.whole_writes == 1
    version = reader.read(again, size, dense=False)
    assert version.dense == {}
    assert version.tables["s"][1].ctypes.data == before.ctypes.data  # s did not move
    assert version.tables["s"][0] is first[0]  # its index's entry unchanged: the same view
    table = served_table(version, "t")
    assert table.stats().rows == 4 + len(many)
    np.testing.assert_array_equal(
        table.lookup(np.array([0, 3, 100, 3099, 5000]), train=False)[:, 0], [1, 1, 5, 5, 0]
    )
    # The room used up: the next table that outgrows its region rewrites the slot whole.
    more = list(range(10_000, 40_000))
    writer.served()
    _, size = writer.write_deltas([{"t": delta(more, 6.0, 2)}], DENSE)
    assert writer.last_whole and writer.moves == 1 and writer.whole_writes == 2
    writer.close()


def test_the_prefaulter_maps_in_each_range_once_and_only_its_new_pages(tmp_path: Path) -> None:
    import mmap

    page = mmap.PAGESIZE
    path = tmp_path / "f"
    path.write_bytes(bytes(16 * page))
    with path.open("rb") as f:
        buf = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    prefault = Prefaulter(buf)
    prefault.span(page + 8, 3 * page)  # from inside a page: the whole page
    assert prefault.pages == 2
    prefault.span(page + 8, 3 * page)  # seen: nothing to do
    assert prefault.pages == 2
    prefault.span(page + 8, 5 * page + 1)  # grown: only its new pages
    assert prefault.pages == 5
    prefault.span(0, 0)
    assert prefault.pages == 5
    with pytest.raises(ValueError, match="not in the mapping"):
        prefault.span(page, 17 * page)
    del prefault
    buf.close()
