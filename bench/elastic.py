"""Benchmark: elastic data executors on Ray, from a bad start, against the best
static configuration (the oracle) and DLRover's threshold rules.

    python bench/elastic.py [--json PATH] [--interval 3] [--run-s 45] [--static-s 14]
                            [--grid 1,2,4,6,8] [--need 4] [--max-executors 8]
                            [--max-threads 1] [--bridge 4]
                            [--order dlrover_rules,estuary]

The job: one trainer with its table in its own process (one PS shard), fed by
Ray data executors reading a ``data.dataset`` of many small splits through a
latency-bound source (``DelayedSource``: every split read waits ``delay_s``
first, as remote storage would), so more executors help without more cores.
The trainer is a real step (embedding lookups and Adagrad updates on an
``EmbeddingTable``, an MLP forward/backward in torch, one thread). Its
throughput is measured first (``trainer_rows_per_s``) and the delay set so that
``--need`` executors feed it: ``delay_s = need x rows per split / trainer rows/s``.

Runs, one Ray instance, the same data and trainer:

  oracle        a static run per executor count in ``--grid`` (``--static-s``
                each); rows/s over the run's second half; the best is the oracle.
  dlrover_rules from 1 executor: ``DLRoverRules`` (re-plan every interval; with
                PS CPU below 0.8 grow the executors by its headroom, x2 at most
                a plan). DLRover re-plans every 300 s; here every ``--interval``
                like the policy, which favours it.
  estuary       from 1 executor: ``EstuaryPolicy`` (``runtime.scaling`` defaults,
                ``interval_s = --interval``, ``max_executor_threads =
                --max-threads``: reads per executor it may set, at most the
                driver's readers, ``max(--max-executors, grid)``, in flight).

Every pool's executors read one split at a time unless a policy raises it
(``--max-threads``): while an added executor starts, a running one reads a
split in its place, up to ``--bridge`` such splits each (the pool's start-up
bridge, ``RayExecutorPool``; ``runtime.scaling.bridge_reads``, whose default
is ``--bridge``'s), for DLRover's rules as for the policy. The grid's pools
never resize, so they never bridge. ``--order`` sets which dynamic run goes
first (the machine's load drifts over a run of the bench). ``--max-threads`` is
1 by default: on this machine one executor process reading several splits at
once fed the trainer slower in steady state than as many processes reading one
split each (docs/results.md), so the policy adds processes and the pool's
bridge covers their start-up.

Each dynamic run lasts ``--run-s``. Figures per run: rows/s per interval,
``time_to_90pct_s`` (the first time, in whole seconds, at which the rows/s over
the trailing ``--interval`` seconds reach 90% of the oracle's; the controller's
own interval snapshots, 3 s apart, tie policies that differ by less:
``time_to_90pct_interval_s`` keeps that coarser figure),
``converged_rows_per_s`` (mean of the last third of the run), scale actions and
reversed actions (from the controller's timeline, also written next to the JSON
as ``elastic_<run>.json``/``.png``). ``ratios.converged_vs_oracle`` is the
policy's converged rows/s over the oracle's. The grid (``--static-s`` each, the
second half's mean: ``oracle.grid``) picks the best executor count; the
oracle's rate (``oracle.rows_per_s``) is then a fresh run of that count, as long
as a dynamic run and read over the same last third, since the best of several
noisy short runs overstates its own rate. The machine has 2 cores shared
with other work: timings are noisy; compare figures within one run.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group

from estuary.config import job_from_dict
from estuary.config.scaling import ScalingSpec
from estuary.config.spec import JobSpec, RoleResources, TableSpec
from estuary.data.graph import Driver, build_operators
from estuary.data.graph.delayed import DelayedSource
from estuary.data.types import Batch
from estuary.embedding.table import EmbeddingTable
from estuary.runtime.ray.executors import RayExecutorPool, RayExecutors
from estuary.runtime.scaling import Bounds, DLRoverRules, EstuaryPolicy, Policy
from estuary.runtime.scaling.pool import PoolScaling

COLUMNS = ["label", "I1", "I2", "C1", "C2"]
FILES, ROWS = 20, 1000  # an hour: 20 splits of 1,000 rows
DATA_MARGIN = 2.0  # the data holds this many times what the trainer alone reads in a run
BATCH = 256
EXECUTOR_CPUS = 0.25  # logical: executors wait on the source, they need little CPU


START = datetime(2026, 1, 1, tzinfo=UTC)


def hours_for(rows_per_s: float, seconds: float) -> int:
    """Hours of data (``FILES x ROWS`` rows each) for ``DATA_MARGIN`` x what a
    trainer at ``rows_per_s`` reads in ``seconds``: no run may run out of
    splits (idle executors at the end of the data would read as surplus)."""
    return max(24, math.ceil(DATA_MARGIN * rows_per_s * seconds / (FILES * ROWS)))


def write_data(root: Path, hours: int) -> None:
    rng = np.random.default_rng(0)
    start = START
    for hour in range(hours):
        when = start + timedelta(hours=hour)
        folder = root / "data" / when.strftime("%Y%m%d") / when.strftime("%H")
        folder.mkdir(parents=True)
        for part in range(FILES):
            c1 = rng.integers(0, 50_000, ROWS)
            c2 = rng.integers(0, 1_000, ROWS)
            label = (rng.random(ROWS) < np.where(c1 % 3 == 0, 0.7, 0.1)).astype(int)
            i1, i2 = rng.integers(0, 9, ROWS), rng.integers(0, 4, ROWS)
            lines = [
                f"{a}\t{b}\t{c}\t{d:05x}\t{e:04x}"
                for a, b, c, d, e in zip(label, i1, i2, c1, c2, strict=True)
            ]
            (folder / f"part-{part:05d}.tsv").write_text("\n".join(lines) + "\n")
        (folder / "_SUCCESS").write_text("")


def make_job(root: Path, workers: int, hours: int) -> JobSpec:
    source = {
        "name": "a",
        "path": "data/{{YYYY}}{{MM}}{{DD}}/{{HH}}/part-*.tsv",
        "columns": COLUMNS,
        "start": START.strftime("%Y-%m-%dT%H"),
        "end": (START + timedelta(hours=hours)).strftime("%Y-%m-%dT%H"),
    }
    raw: dict[str, Any] = {
        "data": {
            "schema": {"dense": ["I1", "I2"], "sparse": ["C1", "C2"]},
            "dataset": {
                "streams": {"s": {"sources": [source]}},
                "timer": {"poll_interval_s": 0.01, "ready_timeout_s": 5},
                "executor": {"workers": workers, "lookahead_splits": 2 * workers},
                "shuffle": {"buffer_rows": 0, "interleave_splits": 1},
            },
        },
    }
    return job_from_dict(raw, base_dir=root)


class Trainer:
    """A small DLRM-like step: 2 embedding lookups (D=16) + MLP, BCE, Adagrad rows."""

    def __init__(self, hidden: int) -> None:
        torch.manual_seed(0)
        self.tables = [EmbeddingTable(TableSpec(dim=16), seed=k, name=f"C{k}") for k in (1, 2)]
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(2 + 32, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, 1),
        )
        self.opt = torch.optim.SGD(self.mlp.parameters(), lr=0.01)

    def step(self, batch: Batch) -> float:
        embs, idss = [], []
        for table, name in zip(self.tables, ("C1", "C2"), strict=True):
            ids = batch.sparse[name].values
            assert ids.shape[0] == batch.num_rows, "one id per row"
            idss.append(ids)
            embs.append(torch.from_numpy(table.lookup(ids, train=True)).requires_grad_())
        x = torch.cat([torch.from_numpy(batch.dense), *embs], dim=1)
        logits = self.mlp(x).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            logits, torch.from_numpy(batch.labels)
        )
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        for table, ids, emb in zip(self.tables, idss, embs, strict=True):
            assert emb.grad is not None
            table.apply_gradients(ids, emb.grad.numpy())
        return float(loss.detach())


def fake_batches(n: int) -> list[Batch]:
    from estuary.data.types import JaggedIds

    rng = np.random.default_rng(1)
    out = []
    for _ in range(n):
        sparse = {
            name: JaggedIds(
                rng.integers(0, 10**6, BATCH).astype(np.int64),
                np.arange(BATCH + 1, dtype=np.int64),
            )
            for name in ("C1", "C2")
        }
        out.append(
            Batch(
                labels=(rng.random(BATCH) < 0.2).astype(np.float32),
                dense=rng.random((BATCH, 2)).astype(np.float32),
                sparse=sparse,
            )
        )
    return out


def trainer_rate(trainer: Trainer) -> float:
    """Rows/s of the trainer alone (best of 5 rounds of 10 steps: the least
    disturbed by other work on the machine)."""
    batches = fake_batches(10)
    trainer.step(batches[0])  # warm-up (numba compiles)
    rates = []
    for _ in range(5):
        began = time.perf_counter()
        for batch in batches:
            trainer.step(batch)
        rates.append(10 * BATCH / (time.perf_counter() - began))
    return float(max(rates))


class Run:
    """One run: a pool of ``start`` executors, the trainer, optional scaling."""

    def __init__(
        self,
        job: JobSpec,
        root: Path,
        delay_s: float,
        start: int,
        hidden: int,
        max_threads: int,
        bridge: int,
    ) -> None:
        self.job, self.root, self.delay_s, self.start = job, root, delay_s, start
        self.hidden, self.max_threads, self.bridge = hidden, max_threads, bridge

    def pool(self) -> tuple[RayExecutorPool, Any]:
        # One group per executor, as the runtime places them (cluster.place).
        groups = tuple(placement_group([{"CPU": EXECUTOR_CPUS}]) for _ in range(self.start))
        ray.get([g.ready() for g in groups])
        spec = RayExecutors(
            count=self.start,
            resources=RoleResources(cpus=EXECUTOR_CPUS, gpus=0.0, memory_mb=None),
            groups=groups,
            max_restarts=0,
            name=f"estuary-elastic-{time.monotonic_ns()}",
            direct=False,
            max_threads=self.max_threads,
            bridge=self.bridge,
        )
        return spec(), groups

    def batches(self, pool: RayExecutorPool) -> Iterator[Batch]:
        data = self.job.data
        assert data.dataset is not None
        ops = build_operators(data.dataset, self.root, data.schema.label)
        driver = Driver(
            data,
            self.root,
            batch_size=BATCH,
            pool=pool,
            operators=[DelayedSource(op, self.delay_s) for op in ops],
        )
        return driver.batches()

    def go(
        self, seconds: float, scaling: ScalingSpec | None, policy: Policy | None, out: Path | None
    ) -> dict[str, Any]:
        """Train for ``seconds``; rows/s per second (and the timeline when scaled)."""
        trainer = Trainer(self.hidden)
        trainer.step(fake_batches(1)[0])  # warm-up outside the clock
        pool, groups = self.pool()
        # The starting executors are up before the clock starts (a running job's).
        ray.get([actor.pid.remote() for actor in pool.actors.values()])
        per_second: list[int] = []
        began = time.monotonic()
        manager = None
        batches = self.batches(pool)
        if scaling is not None:
            bounds = getattr(policy, "bounds", Bounds(1, MAX_EXECUTORS, 1))
            manager = PoolScaling(pool, scaling, bounds, out=None, policy=policy)
            batches = manager.wrap(batches, lambda b: b.num_rows)
        try:
            for batch in batches:
                trainer.step(batch)
                second = int(time.monotonic() - began)
                while len(per_second) <= second:
                    per_second.append(0)
                per_second[second] += batch.num_rows
                if time.monotonic() - began >= seconds:
                    break
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()  # stops the manager (and the driver, which closes the pool)
            for group in groups:  # those the pool has not given back
                if ray.util.placement_group_table(group).get("state") != "REMOVED":
                    remove_placement_group(group)
        result: dict[str, Any] = {"rows_per_s_each_second": per_second[: int(seconds)]}
        if manager is not None:
            timeline = manager.controller.timeline
            if out is not None:
                timeline.write(out.parent, f"elastic_{timeline.policy}")
            result["timeline"] = timeline.as_dict()
        return result


MAX_EXECUTORS = 8


def steady(per_second: list[int]) -> float:
    """Rows/s over the run's second half."""
    half = per_second[len(per_second) // 2 :]
    return float(np.mean(half)) if half else 0.0


def time_to(per_second: list[int], target: float, window: int) -> int | None:
    """The first ``t`` (s) at which the mean rows/s of seconds ``[t - window, t)``
    reaches ``target``; ``None`` if it never does."""
    for t in range(window, len(per_second) + 1):
        if np.mean(per_second[t - window : t]) >= target:
            return t
    return None


def converged(per_second: list[int]) -> float:
    """Rows/s over the last third of a run."""
    last = per_second[-max(1, len(per_second) // 3) :]
    return float(np.mean(last)) if last else 0.0


def summarise(result: dict[str, Any], oracle: float, interval: float) -> dict[str, Any]:
    tl = result["timeline"]
    per_second = result["rows_per_s_each_second"]
    snaps = tl["snapshots"]
    t90 = next((s["t"] for s in snaps if s["rows_per_s"] >= 0.9 * oracle), None)
    return {
        "time_to_90pct_s": time_to(per_second, 0.9 * oracle, max(1, round(interval))),
        "time_to_90pct_interval_s": t90,
        "rows_each_second": per_second,
        "converged_rows_per_s": round(converged(per_second), 1),
        "n_scale_actions": tl["n_scale_actions"],
        "reversed_actions": tl["reversed_actions"],
        "executors_final": snaps[-1]["executors"] if snaps else None,
        "executors_path": [s["executors"] for s in snaps],
        "threads_final": snaps[-1]["executor_threads"] if snaps else None,
        "threads_path": [s["executor_threads"] for s in snaps],
        "executor_cpu_per_interval": [s.get("executor_cpu") for s in snaps],
        "rows_per_s_per_interval": [s["rows_per_s"] for s in snaps],
        "decisions": [
            {k: d[k] for k in ("interval", "t", "knob", "old", "new", "trigger", "applied")}
            for d in tl["decisions"]
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write figures and ratios here")
    parser.add_argument("--interval", type=float, default=3.0, help="scaling interval (s)")
    parser.add_argument("--run-s", type=float, default=45.0, help="seconds per dynamic run")
    parser.add_argument("--static-s", type=float, default=14.0, help="seconds per grid run")
    parser.add_argument("--grid", default="1,2,4,6,8", help="static executor counts")
    parser.add_argument("--need", type=float, default=4.0, help="executors the trainer needs")
    parser.add_argument("--max-executors", type=int, default=MAX_EXECUTORS)
    parser.add_argument("--max-threads", type=int, default=1, help="policy: reads per executor")
    parser.add_argument(
        "--order", default="dlrover_rules,estuary", help="the dynamic runs, in this order"
    )
    parser.add_argument(
        "--bridge",
        type=int,
        default=ScalingSpec().bridge_reads,
        help="runtime.scaling.bridge_reads: extra splits an executor reads for ones starting",
    )
    parser.add_argument("--hidden", type=int, default=1024, help="trainer MLP width")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="estuary-elastic-"))
    ray.init(address="local", num_cpus=16, include_dashboard=False, logging_level="WARNING")
    try:
        grid = [int(x) for x in args.grid.split(",")]
        workers = max(args.max_executors, *grid)
        rate = trainer_rate(Trainer(args.hidden))
        hours = hours_for(rate, max(args.run_s, args.static_s))
        write_data(root, hours)
        job = make_job(root, workers, hours)
        delay = args.need * ROWS / rate
        print(
            f"trainer alone: {rate:.0f} rows/s; split delay {delay:.3f} s; "
            f"{hours * FILES * ROWS:,} rows of data"
        )

        static, series = {}, {}
        for n in grid:
            run = Run(job, root, delay, n, args.hidden, args.max_threads, args.bridge)
            res = run.go(args.static_s, None, None, None)
            series[str(n)] = res["rows_per_s_each_second"]
            static[n] = steady(res["rows_per_s_each_second"])
            print(f"static {n} executors: {static[n]:.0f} rows/s")
        best = max(static, key=lambda n: static[n])
        # The grid picks the best count; its figure is the best of several noisy
        # short runs, so it overstates that count's rate (the winner's curse).
        # The oracle's rate is a fresh run of it, as long as a dynamic run and
        # read over the same window (its last third).
        fresh = Run(job, root, delay, best, args.hidden, args.max_threads, args.bridge)
        confirm = fresh.go(args.run_s, None, None, None)
        oracle_each_second = confirm["rows_per_s_each_second"]
        oracle = converged(oracle_each_second)
        print(f"oracle: {best} executors, {oracle:.0f} rows/s over a fresh {args.run_s:.0f}-s run")

        spec = ScalingSpec(
            enabled=True,
            interval_s=args.interval,
            max_executor_threads=args.max_threads,
            bridge_reads=args.bridge,
        )
        policies: dict[str, Policy] = {
            "dlrover_rules": DLRoverRules(Bounds(1, args.max_executors, 1)),
            "estuary": EstuaryPolicy(
                spec, Bounds(1, args.max_executors, args.max_threads, max_reads=workers)
            ),
        }
        runs = {}
        order = args.order.split(",")
        if sorted(order) != sorted(policies):
            parser.error(f"--order must name {', '.join(policies)} once each")
        for name in order:
            policy = policies[name]
            run = Run(job, root, delay, 1, args.hidden, args.max_threads, args.bridge)
            res = run.go(args.run_s, spec, policy, args.json)
            runs[name] = summarise(res, oracle, args.interval)
            r = runs[name]
            print(
                f"{name:14s} 90% at {r['time_to_90pct_s']} s, converged "
                f"{r['converged_rows_per_s']:.0f} rows/s with {r['executors_final']} executors "
                f"x {r['threads_final']} reads, "
                f"{r['n_scale_actions']} actions, {r['reversed_actions']} reversed"
            )
        est, dl = runs["estuary"], runs["dlrover_rules"]
        out = {
            "setup": {
                "trainer_rows_per_s": round(rate, 1),
                "delay_s": round(delay, 4),
                "rows_per_split": ROWS,
                "data_rows": hours * FILES * ROWS,
                "batch_size": BATCH,
                "interval_s": args.interval,
                "run_s": args.run_s,
                "static_s": args.static_s,
                "max_executors": args.max_executors,
                "max_threads": args.max_threads,
                "bridge_reads": args.bridge,
                "order": order,
                "driver_readers": workers,
                "start": {"executors": 1, "trainers": 1, "ps_shards": 1},
            },
            "oracle": {
                "executors": best,
                "rows_per_s": round(oracle, 1),
                "rows_each_second_confirm": oracle_each_second,
                "grid": {str(n): round(v, 1) for n, v in static.items()},
                "rows_each_second": series,
            },
            "runs": runs,
            "time_to_90pct_s": est["time_to_90pct_s"],
            "n_scale_actions": est["n_scale_actions"],
            "reversed_actions": est["reversed_actions"],
            "ratios": {
                "converged_vs_oracle": round(est["converged_rows_per_s"] / oracle, 3),
                "dlrover_converged_vs_oracle": round(dl["converged_rows_per_s"] / oracle, 3),
                "time_to_90pct_vs_dlrover": (
                    round(est["time_to_90pct_s"] / dl["time_to_90pct_s"], 3)
                    if est["time_to_90pct_s"] and dl["time_to_90pct_s"]
                    else None
                ),
            },
        }
        print(json.dumps(out["ratios"]))
        if args.json is not None:
            args.json.write_text(json.dumps(out, indent=1))
    finally:
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
