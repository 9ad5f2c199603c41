"""The trainer on parameter-server tables, in one process: same results as
in-memory tables, and server failures surface as clear errors, not hangs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch

from estuary.config import JobSpec
from estuary.config.spec import TrainSpec
from estuary.data import TabularDataset
from estuary.embedding import EmbeddingTable
from estuary.ps import PSClient, PSConnectionError, PSTimeoutError, ServerConfig, serving
from estuary.ps.server import ParameterServer
from estuary.train import Trainer
from estuary.train.distributed import rank_rows, server_staleness, table_plan

from .conftest import DIM


def remote_trainer(job: JobSpec, server: ParameterServer) -> Trainer:
    client = PSClient(server.address, server.authkey, timeout_s=30)
    return Trainer(job, tables=client.tables(rank=0))


@pytest.fixture
def one_rank_server(job: JobSpec) -> Iterator[ParameterServer]:
    config = ServerConfig(table_plan(job), world_size=1, staleness=0, wait_timeout_s=5)
    with serving(config) as server:
        yield server


def test_table_plan_matches_the_trainers_own_tables(job: JobSpec) -> None:
    plan = table_plan(job)
    local = Trainer(job)
    assert list(plan) == list(local.tables) == ["s1", "ids"]
    for name, hosted in plan.items():
        table = EmbeddingTable(hosted.spec, seed=hosted.seed, name=name)
        ids = np.arange(-50, 50, dtype=np.int64)
        np.testing.assert_array_equal(
            table.lookup(ids, train=True), local.tables[name].lookup(ids, train=True)
        )


def test_remote_tables_train_exactly_like_local_ones(
    job: JobSpec, one_rank_server: ParameterServer
) -> None:
    local = Trainer(job)
    local_result = local.fit(progress=False)
    remote = remote_trainer(job, one_rank_server)
    remote_result = remote.fit(progress=False)
    assert remote_result.auc == local_result.auc
    for key, value in local.model.state_dict().items():
        torch.testing.assert_close(remote.model.state_dict()[key], value, rtol=0, atol=0)
    for name, table in local.tables.items():
        want, got = table.state_dict(), remote.tables[name].state_dict()
        order_w, order_g = np.argsort(want["ids"]), np.argsort(got["ids"])
        for key in ("ids", "weights", "opt.accum"):
            np.testing.assert_array_equal(got[key][order_g], want[key][order_w])


def test_hybrid_mode_on_remote_tables_applies_every_step_once(job: JobSpec) -> None:
    job = replace(job, train=replace(job.train, mode="hybrid", staleness=1))
    assert server_staleness(job.train) == 1
    config = ServerConfig(table_plan(job), world_size=1, staleness=1, wait_timeout_s=5)
    with serving(config) as server:
        trainer = remote_trainer(job, server)
        result = trainer.fit(progress=False)
        client = PSClient(server.address, server.authkey)
        stats = client.server_stats()
        client.close()
    assert {s["applied"] for s in stats.values()} == {result.extra["steps"]}
    assert {s["duplicates"] for s in stats.values()} == {0}


def test_a_rank_that_never_pushes_fails_the_run_with_a_timeout(job: JobSpec) -> None:
    # The server expects 2 ranks; only this trainer pushes, so step 1 never lands.
    config = ServerConfig(table_plan(job), world_size=2, staleness=0, wait_timeout_s=0.5)
    with serving(config) as server:
        trainer = remote_trainer(job, server)
        start = time.monotonic()
        with pytest.raises(PSTimeoutError, match=r"needs pushes from ranks \[1\]"):
            trainer.fit(progress=False)
        assert time.monotonic() - start < 10


def test_a_dead_server_fails_the_run_with_a_connection_error(
    job: JobSpec, one_rank_server: ParameterServer
) -> None:
    trainer = remote_trainer(job, one_rank_server)
    one_rank_server.close()
    start = time.monotonic()
    with pytest.raises(PSConnectionError, match="parameter server"):
        trainer.fit(progress=False)
    assert time.monotonic() - start < 10


def test_external_tables_must_cover_the_job(job: JobSpec, one_rank_server: ParameterServer) -> None:
    client = PSClient(one_rank_server.address, one_rank_server.authkey)
    tables = client.tables()
    del tables["ids"]
    with pytest.raises(ValueError, match=f"need table 'ids' with dim {DIM}"):
        Trainer(job, tables=tables)
    client.close()


@pytest.mark.parametrize("shuffle", [False, True])
def test_ranks_split_each_epoch_into_equal_disjoint_interleaved_shares(
    job: JobSpec, shuffle: bool
) -> None:
    part = TabularDataset(job.data, job.base_dir).part("train")  # 195 rows
    train = TrainSpec(shuffle=shuffle, seed=4)
    shares = [
        rank_rows(part, r, 2, shuffle=train.shuffle, seed=train.seed, epoch=1) for r in range(2)
    ]
    order = np.concatenate([b.row_ids for b in part.batches(195, shuffle=shuffle, seed=4, epoch=1)])
    assert shares[0].size == shares[1].size == 97  # the odd row out is dropped
    # Step t of both ranks together = rows [2tB, 2(t+1)B) of the one-process order.
    np.testing.assert_array_equal(np.stack(shares, axis=1).reshape(-1), order[:194])
