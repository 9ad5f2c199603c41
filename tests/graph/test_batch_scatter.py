"""``BatchScatter`` between two gloo processes: each rank's part arrives whole,
per-row weights and the batch's origin included."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import numpy as np

from estuary.train.batch_scatter import split_rows

# Shared by the test and its two rank processes (run with exec: spawn cannot
# import a test module by name).
BATCHES = """
import numpy as np
from estuary.data.types import Batch, JaggedIds

FEATURES, DENSE = ["a", "b"], 3
SPECS = [
    dict(n=7, seed=1, weighted=True, origin="stream"),
    dict(n=5, seed=2, weighted=False, origin=None),
    dict(n=1, seed=3, weighted=True, origin="history"),  # rank 1's part is empty
]


def batch(n, seed, *, weighted, origin):
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(rng.integers(1, 3, size=n))]).astype(np.int64)
    sparse = {
        f: JaggedIds(rng.integers(0, 100, size=int(offsets[-1])).astype(np.int64), offsets)
        for f in FEATURES
    }
    return Batch(
        labels=rng.integers(0, 2, size=n).astype(np.float32),
        dense=rng.random((n, DENSE), dtype=np.float32),
        sparse=sparse,
        row_ids=np.arange(n, dtype=np.int64) + 1000 * seed,
        origin=origin,
        weights=rng.random(n, dtype=np.float32) if weighted else None,
    )
"""

RANK = (
    BATCHES
    + """
import os
import torch.distributed as dist
from estuary.train.batch_scatter import BatchScatter

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
try:
    scatter = BatchScatter(
        rank=rank,
        world_size=2,
        features=FEATURES,
        num_dense=DENSE,
        source=iter([batch(**spec) for spec in SPECS]) if rank == 0 else None,
        group=dist.new_group(backend="gloo"),
    )
    got = []
    for part in scatter.batches():
        rows = scatter.next_share().rows
        ids = {f: (part.sparse[f].values, part.sparse[f].offsets) for f in FEATURES}
        got.append((part.labels, part.dense, ids, part.weights, part.origin, rows))
    if rank == 1:
        out.put(got)
finally:
    dist.destroy_process_group()
"""
)


def test_each_part_arrives_with_its_weights_and_origin(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    out = context.SimpleQueue()
    rendezvous = f"file://{tmp_path / 'rendezvous'}"
    ranks = [
        context.Process(target=exec, args=(RANK, {"rank": r, "rendezvous": rendezvous, "out": out}))
        for r in range(2)
    ]
    for process in ranks:
        process.start()
    received = out.get()  # Blocking wait: rank 1 got every part
    for process in ranks:
        process.join(timeout=60)
        assert process.exitcode == 0
    scope: dict[str, Any] = {}
    exec(BATCHES, scope)
    assert len(received) == len(scope["SPECS"])
    for spec, got in zip(scope["SPECS"], received, strict=True):
        labels, dense, ids, weights, origin, rows = got
        want = split_rows(scope["batch"](**spec), 2)[1]
        assert rows == spec["n"]
        np.testing.assert_array_equal(labels, want.labels)
        np.testing.assert_array_equal(dense, want.dense)
        for f in scope["FEATURES"]:
            np.testing.assert_array_equal(ids[f][0], want.sparse[f].values)
            np.testing.assert_array_equal(ids[f][1], want.sparse[f].offsets)
        if spec["weighted"]:
            np.testing.assert_array_equal(weights, want.weights)
        else:
            assert weights is None
        assert origin == spec["origin"]
