"""Per-component costs of one machine, measured by ``calibration`` and stored as JSON.

Every time is seconds of one core (one thread), so a role given ``c`` cores does
``c`` times the work per second (``dense_speedup_2`` says how well the dense step
uses a second thread). The cost of a batch is affine in its size: a fixed part
per call or step plus a part per row or id, both measured by timing the real code
at three batch sizes in interleaved rounds and fitting a line
(``estimators.fit_affine``).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from estuary.config.errors import ConfigError

__all__ = ["COSTS_VERSION", "Costs", "load_costs", "save_costs"]

COSTS_VERSION = 6  # 2: PS figures from the multi-process probes; 3: parallel_efficiency;
# 4: collection_s_per_row; 5: chain_utilisation; 6: ddp_stretch, ddp_stretch_oversubscribed

# Figures a version-5 file lacks; it loads with each at 1.0 (the law before them).
ADDED_IN_6 = ("ddp_stretch", "ddp_stretch_oversubscribed")


@dataclass(frozen=True)
class Costs:
    """What each component costs on the calibrated machine.

    Args:
        parse_s_per_row: executor: read, parse and check one row (hashing excluded).
        hash_s_per_id: executor: hash one sparse value into its int64 id.
        lookup_s_per_id: PS: get-or-insert one unique id and copy its (D,) row out.
        lookup_s_per_call: PS: fixed cost of one table's lookup call.
        update_s_per_id: PS: one optimizer step of one unique id's row.
        update_s_per_call: PS: fixed cost of one table's update call.
        dense_s_per_row: trainer: forward, backward and dense optimizer step per row.
        dense_s_per_step: trainer: fixed cost of one step (Python, optimizer, autograd).
        dense_speedup_2: dense step time with 1 thread over with 2 threads (1..2).
        bytes_per_row: PS memory per embedding row (weights, optimizer state, index).
        row_bytes: bytes of one parsed row as it travels executor -> trainer.
        embedding_dim: D of the calibrated tables.
        sparse_features: F, sparse features per row (one id each unless jagged).
        ids_per_row: ids per row over all features (F for one-hot rows).
        unique_coef: unique ids of one feature in a batch of b rows are
            ``unique_coef * b ** unique_exp`` (fitted on the data's batches).
        unique_exp: see ``unique_coef`` (1.0: every id distinct).
        rpc_s_per_request: trainer: client CPU of one request to one PS server
            (``PSClient``: encoding, send, wait, decode), ids aside.
        rpc_s_per_id: trainer: client CPU per unique id of a step (its lookup
            and push: ids, rows and gradients copied).
        rpc_sharded_s_per_request: as ``rpc_s_per_request`` through the sharded
            client (S >= 2 servers: a thread per server, routing), per server.
        rpc_sharded_s_per_id: as ``rpc_s_per_id`` through the sharded client
            (routing and scattering the rows back included).
        ps_s_per_request: PS server: CPU of one request (a lookup or a push of
            every table, ids aside: dispatch, the tables' fixed per-call costs).
        ps_s_per_id: PS server: CPU per unique id of one trainer's step (its
            lookup, the update, the copies in and out).
        allreduce_s_per_step: trainer: CPU per step that DDP's gradient
            all-reduce over gloo adds when W > 1 (measured at W = 2 and the
            batch size: it grows with the step).
        collection_s_per_row: trainer: the embedding collection's own CPU per
            row of a step (dedup of the batch's ids, pooling, scattering the
            gradient back to the unique ids), tables aside. In a one-process
            layout it is inside the ``lookup_*`` / ``update_*`` figures (timed
            through the collection); with PS shards the trainer pays it beside
            the client's requests (``rpc_*`` are timed on ids already unique).
        parallel_efficiency: work one process does per CPU second while
            ``cores`` processes compute at once on this machine, over what it
            does alone (CPU per dense step alone over CPU per step with
            ``cores`` independent processes stepping at once; 1.0: the cores
            scale linearly; (0, 1]).
        chain_utilisation: the share of the cores a sync step's request chain
            keeps busy when its processes fill the machine: the clients'
            requests and the shards' work after the dense step, all of their
            CPU over the chain's wall time over the cores
            (``probes.ps_layout_rounds`` with 2 clients and 2 servers in
            lockstep; the calibration's ``_layout_costs``; (0, 1]).
        net_latency_s: one request's round trip between two processes.
        net_bytes_per_s: bytes per second one connection carries.
        net_cpu_s_per_byte: CPU seconds (both ends together) to move one byte (for
            reference: the rate law takes the PS copies' CPU from the ``rpc_*`` and
            ``ps_*`` per-id figures, timed with the copies in them).
        cores: logical CPUs of the calibrated machine.
        ddp_stretch: wall seconds per step of a 2-process DDP group of the
            dense step on this machine over its CPU seconds per step (>= 1):
            the ranks wait on each other in the all-reduce (``_layout_costs``).
            Used only for processes sharing the calibrated machine
            (``model.predict(colocated=True)``).
        ddp_stretch_oversubscribed: wall seconds per step of a ``cores + 1``
            process DDP group over what the cores would take shared perfectly,
            ``(cores + 1) / cores`` times the 2-process group's CPU per step
            (>= 1): a rank that waits in the all-reduce for one descheduled
            leaves its core idle. Colocated only, as ``ddp_stretch``; 1.0 where
            it was not timed (a machine of one core or more than 8).
        machine: free-form notes (host, load average, versions).
        version: file format version.
    """

    parse_s_per_row: float
    hash_s_per_id: float
    lookup_s_per_id: float
    lookup_s_per_call: float
    update_s_per_id: float
    update_s_per_call: float
    dense_s_per_row: float
    dense_s_per_step: float
    dense_speedup_2: float
    bytes_per_row: float
    row_bytes: float
    embedding_dim: int
    sparse_features: int
    ids_per_row: float
    unique_coef: float
    unique_exp: float
    rpc_s_per_request: float
    rpc_s_per_id: float
    rpc_sharded_s_per_request: float
    rpc_sharded_s_per_id: float
    ps_s_per_request: float
    ps_s_per_id: float
    allreduce_s_per_step: float
    collection_s_per_row: float
    parallel_efficiency: float
    chain_utilisation: float
    net_latency_s: float
    net_bytes_per_s: float
    net_cpu_s_per_byte: float
    cores: int
    ddp_stretch: float = 1.0
    ddp_stretch_oversubscribed: float = 1.0
    machine: dict[str, Any] = field(default_factory=dict)
    version: int = COSTS_VERSION

    def validate(self, path: str = "costs") -> None:
        """Every figure finite and in range; errors name ``path.field``."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("machine", "version"):
                continue
            if not isinstance(value, int | float) or not math.isfinite(value):
                raise ConfigError(f"{path}.{f.name}", f"must be a finite number, got {value!r}")
            if value < 0:
                raise ConfigError(f"{path}.{f.name}", f"must be >= 0, got {value}")
        for name in ("cores", "embedding_dim", "sparse_features", "net_bytes_per_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{path}.{name}", "must be > 0")
        if not 1.0 <= self.dense_speedup_2 <= 2.0:
            raise ConfigError(f"{path}.dense_speedup_2", "must be in [1, 2]")
        for name in ("parallel_efficiency", "chain_utilisation"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ConfigError(f"{path}.{name}", "must be in (0, 1]")
        for name in ADDED_IN_6:
            if getattr(self, name) < 1.0:
                raise ConfigError(f"{path}.{name}", f"must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.unique_exp <= 1.0:
            raise ConfigError(f"{path}.unique_exp", "must be in (0, 1]")

    def unique_ids(self, batch_rows: float) -> float:
        """Unique ids over all features in a batch of ``batch_rows`` rows."""
        if batch_rows <= 0:
            return 0.0
        per_feature = min(
            batch_rows * self.ids_per_row / self.sparse_features,
            self.unique_coef * batch_rows**self.unique_exp,
        )
        return self.sparse_features * per_feature

    def dense_step_s(self, batch_rows: float, threads: float = 1.0) -> float:
        """Wall seconds of one dense step of ``batch_rows`` rows on ``threads`` threads."""
        return (self.dense_s_per_step + self.dense_s_per_row * batch_rows) / self.speedup(threads)

    def concurrent_efficiency(self, processes: float) -> float:
        """Work per CPU second of each of ``processes`` processes computing at once
        on this machine, relative to one alone: 1 for one, ``parallel_efficiency``
        with every core busy (``processes >= cores``), linear in between."""
        busy = min(processes, float(self.cores))
        if busy <= 1.0 or self.cores <= 1:
            return 1.0
        return 1.0 - (1.0 - self.parallel_efficiency) * (busy - 1.0) / (self.cores - 1.0)

    def speedup(self, threads: float) -> float:
        """Dense speed-up on ``threads`` threads: measured at 2, extended with the
        same parallel fraction (Amdahl) beyond."""
        if threads <= 1:
            return max(threads, 1e-9)
        parallel = 2.0 * (1.0 - 1.0 / self.dense_speedup_2)  # Amdahl's p from S(2)
        return 1.0 / ((1.0 - parallel) + parallel / threads)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "costs") -> Costs:
        """Costs from a decoded JSON object; unknown or missing keys name the field."""
        if not isinstance(data, dict):
            raise ConfigError(source, f"expected a JSON object, got {type(data).__name__}")
        names = {f.name for f in fields(cls)}
        for key in data:
            if key not in names:
                raise ConfigError(f"{source}.{key}", "unknown key")
        version = data.get("version", COSTS_VERSION)
        required = {f.name for f in fields(cls)} - {"machine", "version"}
        if version == 5:
            required -= set(ADDED_IN_6)  # a version-5 file: each at 1.0
        for key in sorted(required - set(data)):
            raise ConfigError(f"{source}.{key}", "missing")
        if version not in (5, COSTS_VERSION):
            raise ConfigError(
                f"{source}.version", f"expected {COSTS_VERSION} (or 5), got {version}"
            )
        costs = cls(**data)
        costs.validate(source)
        return costs


def save_costs(costs: Costs, path: str | Path) -> None:
    """Write ``costs`` as JSON atomically (temp file in the same folder, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(costs.to_dict(), f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_costs(path: str | Path) -> Costs:
    """Costs from a JSON file written by ``save_costs``; errors name the file and field."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(str(path), "calibration file not found") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(str(path), f"not JSON: {exc}") from None
    return Costs.from_dict(data, source=str(path))
