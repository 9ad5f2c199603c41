"""Direct delivery without a cluster: rank 0 routes whole blocks to ranks and
hands out row ids; each rank assembles its rows from the blocks it holds.

::

    executor: split -> blocks b0 b1 b2 ...      (RemoteBlock: accounting + a reference)
    rank 0:   b0 -> rank 0, b1 -> rank 1, ...   (the rank holding fewest rows)
    step t:   part 0 = B row ids of rank 0's buffer, part 1 = B of rank 1's
    rank r:   fetch its new blocks, gather its row ids -> Batch

The in-process ``LocalRoutes`` stands for Ray here: a reference is the block itself.
"""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from estuary.data.graph import Driver
from estuary.data.graph.executors import SplitReader, read_split_whole
from estuary.data.graph.routing import (
    BlockRows,
    PartAssembler,
    RankPart,
    RemoteBlock,
    StepRoute,
)
from estuary.train.batch_routes import RoutedBatches

from .conftest import dataset_job, source, write_hours

BATCH = 8  # rows per rank and step


class LocalPool:
    """A split pool that returns ``RemoteBlock``s whose reference is the rows."""

    def read(self, reader: SplitReader) -> tuple[list[Any], int, int]:
        blocks, good, last = read_split_whole(reader)
        return [RemoteBlock.of(b, BlockRows.of(b)) for b in blocks], good, last

    def summary(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        return None


class LocalRoutes:
    """``PartRoutes`` in one process: a queue per rank; fetch is the identity."""

    def __init__(self, ranks: int) -> None:
        self.boxes: list[queue.Queue[RankPart | None]] = [queue.Queue() for _ in range(ranks)]
        self.fetched = 0

    def send(self, rank: int, part: RankPart | None) -> None:
        self.boxes[rank].put(part)

    def receive(self, rank: int) -> RankPart | None:
        return self.boxes[rank].get(timeout=5)

    def fetch(self, refs: list[Any]) -> list[BlockRows]:
        self.fetched += len(refs)
        return list(refs)


def driver(tmp_path: Path, buffer_rows: int, ranks: int = 2, hours: int = 3) -> Driver:
    shuffle = {"buffer_rows": buffer_rows, "interleave_splits": 2, "seed": 3}
    job = dataset_job(
        tmp_path,
        {"s": {"sources": [source(hours=hours)]}},
        dataset={"shuffle": shuffle, "executor": {"block_size_bytes": 256}},
    )
    return Driver(job.data, tmp_path, batch_size=BATCH * ranks, pool=LocalPool())


def assembler() -> PartAssembler:
    return PartAssembler(["C1", "C2"], [], ["C1", "C2"], 2, lambda refs: list(refs))


def reference(tmp_path: Path) -> dict[int, tuple[float, list[float], int, int]]:
    """Row id -> (label, dense, C1 id, C2 id), read plainly by one reader."""
    job = dataset_job(tmp_path, {"s": {"sources": [source(hours=3)]}})
    rows = {}
    for b in Driver(job.data, tmp_path, batch_size=64, shuffle=False).batches():
        assert b.row_ids is not None
        for i, rid in enumerate(b.row_ids.tolist()):
            c1, c2 = int(b.sparse["C1"].values[i]), int(b.sparse["C2"].values[i])
            rows[rid] = (float(b.labels[i]), b.dense[i].tolist(), c1, c2)
    return rows


@pytest.mark.parametrize("buffer_rows", [0, 40])
def test_every_row_reaches_one_rank_once_with_its_own_values(
    tmp_path: Path, buffer_rows: int
) -> None:
    write_hours(tmp_path, 3, 60, files=2, bad_every=11)
    want = reference(tmp_path)
    ranks = [assembler(), assembler()]
    seen: dict[int, int] = {}  # row id -> rank
    steps = list(driver(tmp_path, buffer_rows).steps(2))
    for step in steps:
        assert isinstance(step, StepRoute)
        assert step.rows == sum(p.row_ids.shape[0] for p in step.parts)
        for rank, part in enumerate(step.parts):
            assert part.step_rows == step.rows and part.row_ids.shape[0] <= BATCH
            batch = ranks[rank].batch(part)
            assert batch.row_ids is not None
            np.testing.assert_array_equal(np.sort(part.row_ids), batch.row_ids)
            for i, rid in enumerate(batch.row_ids.tolist()):
                assert rid not in seen, "a row trained twice"
                seen[rid] = rank
                label, dense, c1, c2 = want[rid]
                assert batch.labels[i] == label and batch.dense[i].tolist() == dense
                assert batch.sparse["C1"].values[i] == c1 and batch.sparse["C2"].values[i] == c2
    assert set(seen) == set(want)  # every good row, once
    # Every block went whole to one rank: each rank fetched only its own rows.
    assert sum(a.rows_fetched for a in ranks) == len(want)
    counts = np.bincount(list(seen.values()))
    assert abs(int(counts[0]) - int(counts[1])) <= 60  # within about a block of each other
    # Full steps until the data runs low: every rank trains B rows.
    full = [s for s in steps if all(p.row_ids.shape[0] == BATCH for p in s.parts)]
    assert len(full) >= len(steps) - 4


def test_routing_is_seeded(tmp_path: Path) -> None:
    write_hours(tmp_path, 3, 60, files=2)
    a = [s.row_ids for s in driver(tmp_path, 40).steps(2)]
    b = [s.row_ids for s in driver(tmp_path, 40).steps(2)]
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_routed_batches_end_on_every_rank_together(tmp_path: Path) -> None:
    """Rank 0 routes; rank 1 receives its parts through the routes, in order,
    and both learn every step's total rows (the loss is reduced over them)."""
    write_hours(tmp_path, 2, 50)
    routes = LocalRoutes(2)
    chief = RoutedBatches(
        rank=0,
        world_size=2,
        assembler=assembler(),
        routes=routes,
        source=driver(tmp_path, 0, hours=2).steps(2),
    )
    other = RoutedBatches(rank=1, world_size=2, assembler=assembler(), routes=routes, source=None)
    mine = list(chief.batches())
    theirs = list(other.batches())  # rank 0 ran ahead: its parts wait in the queue
    assert len(mine) == len(theirs)
    shares = [(chief.next_share(), other.next_share()) for _ in mine]
    assert all(a.rows == b.rows for a, b in shares)
    assert sum(a.rows for a, _ in shares) == sum(b.num_rows for b in mine + theirs) == 100
    assert all(a.row_ids is not None and b.row_ids is None for a, b in shares)
    assert chief.rows_fetched + other.rows_fetched == 100


def test_a_row_in_no_held_block_is_a_routing_error() -> None:
    rows = BlockRows(
        np.array([1, 2], np.int64),
        np.zeros(2, np.float32),
        np.zeros((2, 2), np.float32),
        np.zeros((2, 2), np.int64),
    )
    got = assembler()
    got.batch(RankPart(np.array([1], np.int64), [(0, rows)], 1))
    with pytest.raises(RuntimeError, match="row id 3 is in no block"):
        got.batch(RankPart(np.array([3], np.int64), [], 1))
