"""The plan of a training job: which tables exist, with which specs and seeds,
which features read which table, and how stale a sparse update may be.

One object, resolved once from the job, used by everything that must agree on
it: the trainer builds its in-process tables from it, the runtime hosts the same
tables on a parameter server (``hosted_tables``), and checkpoints name the
features it lists. So a table on a server starts with exactly the rows a local
one would.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from estuary.config import JobSpec
from estuary.config.spec import TableSpec, TrainSpec
from estuary.ps import HostedTable

__all__ = ["TrainPlan", "server_staleness", "shared_names"]

TABLE_SEED_STRIDE = 1_000_003
"""Table i of a job with ``train.seed`` s draws its initial rows from seed
``s * TABLE_SEED_STRIDE + i``."""


def shared_names(job: JobSpec) -> dict[str, str]:
    """Feature -> its ``model.embedding.shared`` group, for the features in one.
    Such features hash their values with the group's name, so equal values meet."""
    return {m: g for g, members in job.model.embedding.shared.items() for m in members}


def server_staleness(train: TrainSpec) -> int | None:
    """The server's staleness bound for ``train.mode``: sync 0, hybrid
    ``train.staleness``, async none."""
    return {"sync": 0, "hybrid": train.staleness, "async": None}[train.mode]


@dataclass(frozen=True)
class TrainPlan:
    """A job's tables and features, resolved once.

    Args:
        features: sparse feature names in model order (F of them).
        feature_tables: feature -> the table it reads (its own name, or its
            ``shared`` group's).
        tables: table name -> its spec (``job.table_spec``), in creation order.
        seeds: table name -> the seed its initial rows are drawn from.
        shared: feature -> shared group, for features in a group (hash names).
        staleness: the parameter server's staleness bound (``server_staleness``).
    """

    features: tuple[str, ...]
    feature_tables: Mapping[str, str]
    tables: Mapping[str, TableSpec]
    seeds: Mapping[str, int]
    shared: Mapping[str, str]
    staleness: int | None

    @classmethod
    def from_job(cls, job: JobSpec, features: Sequence[str] | None = None) -> TrainPlan:
        """The job's plan; ``features`` default to the schema's sparse features and
        ``data.schema.features``, in that order (what a dataset of the job yields)."""
        shared = shared_names(job)
        if features is None:
            schema = job.data.schema
            features = [*schema.sparse, *(f.name for f in schema.features)]
        feature_tables = {f: shared.get(f, f) for f in features}
        names = list(dict.fromkeys(feature_tables.values()))
        return cls(
            features=tuple(features),
            feature_tables=feature_tables,
            tables={name: job.table_spec(name) for name in names},
            seeds={name: job.train.seed * TABLE_SEED_STRIDE + i for i, name in enumerate(names)},
            shared=shared,
            staleness=server_staleness(job.train),
        )

    def hosted_tables(self) -> dict[str, HostedTable]:
        """The tables as a parameter server hosts them (same specs and seeds)."""
        return {
            name: HostedTable(spec, seed=self.seeds[name]) for name, spec in self.tables.items()
        }
