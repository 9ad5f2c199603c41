"""The feature pipeline a server runs: raw feature values -> a model-ready ``Batch``.

Clients send what they log, rows of raw values named as in the job's schema
(``{"I1": 3, "C1": "68fd1e64", ...}``); the server parses, transforms and hashes
them with the training code itself: the JSON Lines reader's value conversion
(``object_columns``: integers as decimal text, ``true`` as ``1``, ...) and the
job's ``RowDecoder`` (dense transform, hashing seeds, shared-table names,
derived features). So a row gets the same ids and dense values online as in a
``jsonl`` training file, and the same as in a TSV file holding the same text.

A request's shape is checked when it arrives (``check``: keys only); its values
when it is decoded, together with the other requests of its micro-batch
(``parse_many``: one decode per batch, whose cost is per column, not per row).
A request's first problem is a ``RequestError`` naming the row and the field,
e.g. ``instances[3]: field I5: 'abc' is not a number``; one bad request does not
fail the others of its batch.

The pipeline is stored in an export as ``pipeline.json``: the schema (plain
data, as in the job file), the hashing names and, for readers, the feature
and dense column order. Loading it never runs code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from estuary.config import ConfigError, JobSpec, SchemaSpec
from estuary.config.build import build_dataclass, plain, suggest
from estuary.data.decode import RowDecoder
from estuary.data.formats.jsonl import object_columns
from estuary.data.formats.types import RawChunk
from estuary.data.types import Batch
from estuary.train.plan import shared_names

__all__ = ["PIPELINE_FORMAT", "FeaturePipeline", "RequestError"]

PIPELINE_FORMAT = "estuary.pipeline/1"


class RequestError(ValueError):
    """A request the server refuses with a 4xx; the message names what was wrong.

    Args:
        message: what was wrong, naming the row and field.
        status: the HTTP status (400 bad value, 413 too large, 422 valid JSON of
            the wrong shape).
    """

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _kind(value: object) -> str:
    """A JSON value's kind, as messages name it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


class FeaturePipeline:
    """Raw rows -> ``Batch``, as training decodes them.

    Args:
        schema: the job's ``data.schema``.
        hash_names: feature -> hashing name (``shared_names(job)``: features of a
            shared table hash with the group's name).
        max_rows: the most rows one request may hold (more: 413).
    """

    def __init__(
        self, schema: SchemaSpec, hash_names: Mapping[str, str], *, max_rows: int = 4096
    ) -> None:
        self.schema = schema
        self.hash_names = dict(hash_names)
        self.decoder = RowDecoder(schema, self.hash_names)
        self.max_rows = max_rows
        # The keys a row must have: every column the decoder reads but the label.
        self.fields = [c for c in self.decoder.columns if c != schema.label]
        self._known = {*self.fields, schema.label}  # a row may carry its label; unused

    @classmethod
    def from_job(cls, job: JobSpec) -> FeaturePipeline:
        """The pipeline of ``job``'s schema."""
        return cls(job.data.schema, shared_names(job))

    def to_json(self) -> dict[str, Any]:
        """``pipeline.json``'s content (plain data)."""
        return {
            "format": PIPELINE_FORMAT,
            "schema": plain(self.schema),
            "hash_names": self.hash_names,
            "fields": self.fields,
            "features": self.decoder.features,
            "dense": self.decoder.dense,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str = "pipeline.json") -> FeaturePipeline:
        """The pipeline ``to_json`` wrote; a bad file raises ``ConfigError`` naming
        the field under ``where``."""
        if data.get("format") != PIPELINE_FORMAT:
            raise ConfigError(
                f"{where}.format", f"expected {PIPELINE_FORMAT!r}, found {data.get('format')!r}"
            )
        schema = build_dataclass(SchemaSpec, data.get("schema", {}), f"{where}.schema")
        hash_names = data.get("hash_names", {})
        if not isinstance(hash_names, dict):
            raise ConfigError(f"{where}.hash_names", "expected a mapping feature -> name")
        return cls(schema, hash_names)

    def check(self, instances: Any) -> list[dict[str, Any]]:
        """The rows of a request's ``instances``, checked for shape: a non-empty
        list of at most ``max_rows`` objects, each with every field and no
        unknown one (cheap: keys only; values are checked by ``parse_many``).

        Raises:
            RequestError: naming the row and field.
        """
        if not isinstance(instances, list):
            raise RequestError(
                f"instances: expected a list of rows, got a JSON {_kind(instances)}", 422
            )
        if not instances:
            raise RequestError("instances: expected at least one row", 422)
        if len(instances) > self.max_rows:
            raise RequestError(
                f"instances: {len(instances)} rows, more than the limit of {self.max_rows}", 413
            )
        for i, row in enumerate(instances):
            self._check_row(i, row)
        return instances

    def parse(self, instances: Any) -> Batch:
        """One request's ``instances`` -> a Batch of its B rows (labels 0; dense
        (B, Dd); sparse ids in model order).

        Raises:
            RequestError: as ``check``, or a value the training reader would reject
                (naming row and field).
        """
        batch, (outcome,) = self.parse_many([self.check(instances)])
        if isinstance(outcome, RequestError):
            raise outcome
        return batch

    def parse_many(
        self, requests: Sequence[list[dict[str, Any]]]
    ) -> tuple[Batch, list[slice | RequestError]]:
        """Several checked requests' rows in one pass (the per-call cost of
        decoding is per column, so a micro-batch pays it once, not per request).

        Returns:
            the batch of every row that decodes (request order), and per request
            either the slice of the batch holding its rows or the ``RequestError``
            of its first bad row (its good rows are in the batch, unused).
        """
        rows = [row for request in requests for row in request]
        n = len(rows)
        reasons: dict[int, str] = {}  # row -> why it is bad
        columns = object_columns(self.fields, rows, reasons)
        columns[self.schema.label] = pa.array(np.zeros(n, np.int64))
        lines = np.arange(1, n + 1, dtype=np.int64)  # row i is "line" i + 1
        chunk = RawChunk(file="request", columns=columns, line_numbers=lines, invalid=[])
        decoded = self.decoder.decode(chunk, max_examples=n)  # every bad row, with its reason
        dropped = np.zeros(n, dtype=bool)  # rows the decoder left out of ``decoded``
        for example in decoded.bad_examples:
            dropped[example.line - 1] = True
            reasons.setdefault(example.line - 1, example.reason)
        position = np.cumsum(~dropped) - 1  # row -> its index among the decoded rows
        outcomes: list[slice | RequestError] = []
        start = 0
        for request in requests:
            end = start + len(request)
            bad = [i for i in reasons if start <= i < end]
            if bad:
                first = min(bad)
                outcomes.append(RequestError(f"instances[{first - start}]: {reasons[first]}"))
            else:
                outcomes.append(slice(int(position[start]), int(position[start]) + len(request)))
            start = end
        batch = self.decoder.batch(decoded.labels, decoded.dense, decoded.ids, decoded.jagged)
        return batch, outcomes

    def _check_row(self, i: int, row: Any) -> None:
        if not isinstance(row, dict):
            raise RequestError(
                f"instances[{i}]: expected an object of feature values, got a JSON {_kind(row)}"
            )
        for key in row:  # first: a misspelt field is reported as such, not as missing
            if key not in self._known:
                hint = suggest(str(key), self.fields)
                raise RequestError(f"instances[{i}]: unknown field {key!r}{hint}")
        missing = [f for f in self.fields if f not in row]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise RequestError(f"instances[{i}]: missing field {missing[0]!r}{more}")
