"""``RayRuntime``: connects, places the roles, runs attempts until one finishes
(see the package docstring)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import Any, NoReturn

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from estuary.config import JobSpec
from estuary.config.spec import data_delivery
from estuary.runtime.failure import policy_for
from estuary.runtime.launcher import act, default_backend, ps_server_config
from estuary.runtime.ray.actors import ServerActor, TrainerActor, kill_all, server_name
from estuary.runtime.ray.cluster import Placement, PlacementError, connect, place, role_asks
from estuary.runtime.ray.delivery import RayPartRoutes
from estuary.runtime.ray.embedding_workers import EmbeddingWorkerActor
from estuary.runtime.ray.executors import RayExecutors
from estuary.runtime.ray.scaling import (
    PSScaling,
    RayShards,
    elastic_shards,
    ps_scaling_manager,
    resumed_shard_count,
    spare_shard_cpus,
)
from estuary.runtime.recovery import DistributedError, supervise
from estuary.runtime.types import (
    FailurePolicy,
    JobState,
    RoleFailure,
    RoleState,
    StopRequest,
    tracking,
)
from estuary.runtime.worker import WorkerLaunch
from estuary.train import FitResult, TrainingStopped
from estuary.train.plan import TrainPlan

__all__ = ["PlacementError", "RayRuntime"]

POLL_S = 0.25  # how often the controller looks at its roles (failures seen within ~1 s)


class RayRuntime:
    """Runs a job's roles as Ray actors.

    Args:
        policy: what a role's failure means (default: the job's
            ``runtime.max_restarts``).
        ps_wait_timeout_s: longest a server request waits for a step.
        pg_timeout_s: timeout of the trainers' process-group collectives.
        startup_timeout_s: longest wait for the roles to start.

    ``state`` is the job's ``JobState``; ``roles`` maps ``(role, rank)`` to its
    ``RoleState``.
    """

    def __init__(
        self,
        policy: FailurePolicy | None = None,
        *,
        ps_wait_timeout_s: float = 300.0,
        pg_timeout_s: float = 600.0,
        startup_timeout_s: float = 180.0,
    ) -> None:
        self._policy = policy
        self.policy: FailurePolicy | None = policy
        self.ps_wait_timeout_s = ps_wait_timeout_s
        self.pg_timeout_s = pg_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.state = JobState.PENDING
        self.roles: dict[tuple[str, int], RoleState] = {}
        self._stop_signum = 0
        self._run_id = os.urandom(4).hex()  # names this runtime's data executors
        self._extra_actors: list[Any] = []  # embedding workers of the current attempt
        self._attempts = 0

    def run(
        self,
        job: JobSpec,
        *,
        resume: bool = False,
        stop: StopRequest | None = None,
        progress: bool | None = None,
    ) -> FitResult:
        policy = policy_for(job) if self._policy is None else self._policy
        self.policy = policy
        stop = StopRequest() if stop is None else stop
        stop.on_request(self._ask_stop)
        asks = role_asks(job)
        with tracking(self), contextlib.ExitStack() as cleanup:
            disconnect = connect(job.runtime.ray, asks, spare_shard_cpus(job))
            if disconnect is not None:
                cleanup.callback(disconnect)
            placement = place(asks, job.runtime.ray.placement_timeout_s)
            cleanup.callback(placement.remove)

            def attempt(resume: bool, running: Callable[[], None]) -> FitResult:
                return self._attempt(job, placement, policy, resume, running)

            result = supervise(attempt, job, resume=resume)
            result.extra["ray_nodes"] = placement.nodes()  # nodes the roles landed on
        result.extra["runtime"] = "ray"
        result.extra["roles"] = {a.role: a.count for a in asks}
        return result

    def _ask_stop(self, reason: str) -> None:
        # From a signal handler: only note it; the controller loop forwards it.
        self._stop_signum = StopRequest.signal_number(reason)

    def _attempt(
        self,
        job: JobSpec,
        placement: Placement,
        policy: FailurePolicy,
        resume: bool,
        running: Callable[[], None],
    ) -> FitResult:
        runtime = job.runtime
        world = runtime.trainers
        plan = TrainPlan.from_job(job)
        # A resume after a split or merge starts the shards the checkpoint had.
        shards = resumed_shard_count(job) if resume else None
        count = runtime.ps_shards if shards is None else shards
        config = ps_server_config(job, plan, world, count, self.ps_wait_timeout_s)
        ps_res, tr_res = runtime.ray.ps, runtime.ray.trainer
        keys = [os.urandom(32) for _ in range(count)]
        servers = [
            ServerActor.options(  # type: ignore[attr-defined]
                num_cpus=ps_res.cpus,
                num_gpus=ps_res.gpus,
                # Shards past the placement group's (a resume after a split): their own ask.
                scheduling_strategy=(
                    placement.strategy("ps", p) if p < runtime.ps_shards else "DEFAULT"
                ),
                name=server_name(),  # the actor plane's clients find a joined one by name
            ).remote(config, keys[p])
            for p in range(count)
        ]
        trainers = [
            TrainerActor.options(  # type: ignore[attr-defined]
                num_cpus=tr_res.cpus,
                num_gpus=tr_res.gpus,
                max_concurrency=2 + world,  # run, stop, next_part per rank
                scheduling_strategy=placement.strategy("trainer", r),
            ).remote()
            for r in range(world)
        ]
        self.roles.update({("ps", p): RoleState.STARTING for p in range(len(servers))})
        self.roles.update({("trainer", r): RoleState.STARTING for r in range(world)})
        self.pids: dict[tuple[str, int], int] = {}
        started: list[Any] = []  # shards the scaling manager added
        try:
            endpoints = self._get([s.endpoint.remote() for s in servers], "ps")
            host, port, pid0 = self._get([trainers[0].rendezvous.remote()], "trainer")[0]
            pids = self._get([t.rendezvous.remote() for t in trainers[1:]], "trainer")
            self.pids.update({("ps", p): e[1] for p, e in enumerate(endpoints)})
            self.pids[("trainer", 0)] = pid0
            self.pids.update({("trainer", r + 1): x[2] for r, x in enumerate(pids)})
            executors = self._executors(job, placement)
            launch = WorkerLaunch(
                job=job,
                world_size=world,
                addresses=tuple(e[0] for e in endpoints),
                authkeys=tuple(keys),
                init_method=f"tcp://{host}:{port}",
                backend=default_backend(job),
                pg_timeout_s=self.pg_timeout_s,
                ps_timeout_s=self.ps_wait_timeout_s + 60.0,
                startup_timeout_s=self.startup_timeout_s,
                threads=max(1, int(tr_res.cpus)),
                progress=False,
                resume=resume,
                one_machine=placement.nodes() == 1,
                server_actors=tuple(servers) if runtime.ray.data_plane == "actor" else (),
                split_pool=executors,
                part_routes=RayPartRoutes(trainers[0]) if executors and executors.direct else None,
                embedding_workers=self._embedding_workers(job, placement, endpoints, keys, servers),
                sharded_ps=elastic_shards(job),
            )
            runs = {t.run.remote(r, launch): r for r, t in enumerate(trainers)}
            watches = {s.serve.remote(): p for p, s in enumerate(servers)}
            self.roles.update({key: RoleState.RUNNING for key in self.roles})
            running()
            # runtime.scaling: PS memory (row caps, added and merged shards), hot shards
            scaling = ps_scaling_manager(
                job,
                servers,
                endpoints=[e[0] for e in endpoints],
                keys=keys,
                config=config,
                timeout_s=self.ps_wait_timeout_s + 60.0,
            )
            try:
                serving = {ref: servers[p] for ref, p in watches.items()}
                return self._watch(runs, watches, trainers, policy, scaling, serving)
            finally:
                if scaling is not None:
                    scaling.close()
                    started.extend(scaling.shards.started)
        finally:
            kill_all([*trainers, *servers, *started, *self._extra_actors])
            self._extra_actors = []

    def _executors(self, job: JobSpec, placement: Placement) -> RayExecutors | None:
        """The data executors rank 0 starts (``runtime.data_executors``), if any."""
        if not placement.executor_groups:
            return None
        self._attempts += 1
        return RayExecutors(
            count=job.runtime.data_executors,
            resources=job.runtime.ray.data_executor,
            groups=placement.live_executor_groups(),
            max_restarts=job.runtime.max_restarts,
            name=f"estuary-data-{self._run_id}-{self._attempts}",
            direct=data_delivery(job) == "direct",
            max_threads=(
                job.runtime.scaling.max_executor_threads if job.runtime.scaling.enabled else 1
            ),
            bridge=job.runtime.scaling.bridge_reads if job.runtime.scaling.enabled else 0,
            custom=next(a.custom for a in role_asks(job) if a.role == "data_executor"),
            near=placement.node_of("trainer") if "trainer" in placement.first_bundle else None,
        )

    def _embedding_workers(
        self,
        job: JobSpec,
        placement: Placement,
        endpoints: list[Any],
        keys: list[bytes],
        servers: list[Any],
    ) -> tuple[Any, ...]:
        """One embedding worker per trainer (``runtime.embedding_workers``), if asked."""
        if not job.runtime.embedding_workers:
            return ()
        res = job.runtime.ray.embedding_worker
        actor_plane = job.runtime.ray.data_plane == "actor"
        workers = tuple(
            EmbeddingWorkerActor.options(  # type: ignore[attr-defined]
                num_cpus=res.cpus,
                num_gpus=res.gpus,
                scheduling_strategy=placement.strategy("embedding_worker", r),
            ).remote(
                [e[0] for e in endpoints],
                keys,
                servers if actor_plane else [],
                r,
                job.runtime.trainers,
                self.ps_wait_timeout_s + 60.0,
                elastic_shards(job),
            )
            for r in range(job.runtime.trainers)
        )
        self._extra_actors.extend(workers)
        return workers

    def _get(self, refs: list[Any], role: str) -> list[Any]:
        try:
            return list(ray.get(refs, timeout=self.startup_timeout_s))
        except GetTimeoutError as exc:
            raise DistributedError(
                f"{role} actors did not start within {self.startup_timeout_s:g} s"
            ) from exc

    def _watch(
        self,
        runs: dict[Any, int],
        watches: dict[Any, int],
        trainers: list[Any],
        policy: FailurePolicy,
        scaling: PSScaling | None = None,
        servers: dict[Any, Any] | None = None,
    ) -> FitResult:
        """The controller: forward stops, collect results, turn the first failure
        into the policy's decision. Shards the scaling manager adds are watched
        too; one it retired ends without failing the job."""
        out: FitResult | TrainingStopped | None = None
        forwarded = False
        actors: dict[Any, Any] = {}  # serve call -> actor, of the shards added
        first = len(watches)
        while runs:
            if scaling is not None:
                _follow_shards(scaling.shards, watches, actors, first)
            if self._stop_signum and not forwarded:
                for trainer in trainers:
                    trainer.stop.remote(self._stop_signum)
                forwarded = True
            # Blocking wait: the next role to finish (or fail), for at most POLL_S.
            ready, _ = ray.wait([*runs, *watches], num_returns=1, timeout=POLL_S)
            for ref in ready:
                if ref in watches:
                    rank = watches.pop(ref)
                    if scaling is not None and _retired(scaling.shards, ref, actors, servers):
                        continue
                    self._fail(RoleFailure("ps", rank, _reason(ref)), policy)
                rank = runs.pop(ref)
                try:
                    value = ray.get(ref)
                except (RayActorError, RayTaskError) as exc:
                    # A server's death fails the trainers too: name the cause.
                    lost = _lost_server(watches, grace_s=2.0)
                    failure = lost or RoleFailure("trainer", rank, _reason(ref, exc))
                    self._fail(failure, policy, exc)
                self.roles[("trainer", rank)] = RoleState.FINISHED
                if rank == 0:
                    out = value
        if out is None:
            raise DistributedError("trainer rank 0 finished without a result")
        if isinstance(out, TrainingStopped):
            raise out
        return out

    def _fail(
        self, failure: RoleFailure, policy: FailurePolicy, cause: BaseException | None = None
    ) -> NoReturn:
        self.roles[(failure.role, failure.rank)] = RoleState.FAILED
        noticed = time.monotonic()
        act(policy.decide(failure), failure, cause or DistributedError(failure.reason), noticed)


def _follow_shards(
    shards: RayShards, watches: dict[Any, int], actors: dict[Any, Any], first: int
) -> None:
    """Watch (``serve``) the shards the scaling manager started and ``actors``
    (serve call -> actor) does not hold yet, numbered from ``first``."""
    known = {id(a) for a in actors.values()}
    for actor in shards.started:
        if id(actor) not in known:
            ref = actor.serve.remote()
            watches[ref] = first + len(actors)
            actors[ref] = actor


def _retired(
    shards: RayShards, ref: Any, added: dict[Any, Any], first: dict[Any, Any] | None
) -> bool:
    """Whether the ``serve`` call ``ref`` is a shard's the scaling manager retired."""
    actor = added.get(ref) or (first or {}).get(ref)
    return actor is not None and any(actor is r for r in shards.retired)


def _lost_server(watches: dict[Any, int], grace_s: float) -> RoleFailure | None:
    """A server whose actor died (its ``serve`` call ended), within ``grace_s``."""
    if not watches:
        return None
    ready, _ = ray.wait(list(watches), num_returns=1, timeout=grace_s)
    if not ready:
        return None
    return RoleFailure("ps", watches[ready[0]], _reason(ready[0]))


def _reason(ref: Any, exc: BaseException | None = None) -> str:
    """One line on why a role's call ended."""
    if exc is None:
        try:
            ray.get(ref)
        except RayActorError as error:
            exc = error
        except RayTaskError as error:
            exc = error
        else:
            return "stopped serving"
    if isinstance(exc, RayActorError):
        return "died (its process exited or its node was lost)"
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return f"failed: {lines[-1] if lines else type(exc).__name__}"
