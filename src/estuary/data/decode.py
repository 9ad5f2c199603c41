"""Raw text rows -> model-ready columns: labels, dense floats, hashed ids.

``RowDecoder.decode`` takes one ``RawChunk`` (R rows of raw field text) and
returns the G good rows of it (G <= R)::

    labels  float32 (G,)        0.0 / 1.0
    dense   float32 (G, Dd)     missing -> 0, then ``dense_transform``
    ids     int64   (G, F)      one id per single-valued sparse feature (see ``hashing``)
    jagged  {name: JaggedIds}   several ids per row (``sequence`` features)

Derived features (``data.schema.features``, see ``estuary.data.features``)
follow ``data.schema.sparse``: single-valued ones as extra columns of ``ids``,
sequence ones in ``jagged``; ``RowDecoder.features`` is the model order of all.

Every row gets at most one reason, from the first failing field in this order:
label, dense columns (schema order), transformed sparse columns (schema order),
derived features (declaration order).
Checks are vectorised per column; reasons are rendered only for the few rows
that will be reported. A delimited-text chunk (``tokenize.TextColumns``) is read
in place: numbers parsed and values hashed from the block's field spans, row by
row in one pass each, without building Arrow arrays (same results).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from estuary.config.errors import ConfigError
from estuary.config.spec import SchemaSpec
from estuary.data.badrows import BadRow
from estuary.data.dense import (
    DENSE_TRANSFORMS,
    MISSING,
    NOT_A_NUMBER,
    NOT_FINITE,
    OK,
    parse_number_spans,
    parse_numbers,
)
from estuary.data.features import compile_features
from estuary.data.formats.tokenize import TextColumns
from estuary.data.formats.types import RawChunk
from estuary.data.formats.values import to_text
from estuary.data.hashing import feature_seed, hash_array, hash_spans
from estuary.data.transforms import resolve_transforms
from estuary.data.types import Batch, Float32Array, Int64Array, JaggedIds

__all__ = ["DecodedChunk", "RowDecoder"]

# Reason codes of a failing field (0 = the row is fine so far).
_LABEL, _NAN, _NONFINITE, _OVERFLOW, _TRANSFORM = 1, 2, 3, 4, 5
_REASONS = {
    _LABEL: "is not 0 or 1",
    _NAN: "is not a number",
    _NONFINITE: "is not a finite number",
    _OVERFLOW: "is out of float32 range",
}
_MAX_SHOWN_CHARS = 60


@dataclass(frozen=True)
class DecodedChunk:
    """The good rows of one RawChunk plus its bad-row accounting.

    Args:
        labels: float32 (G,).
        dense: float32 (G, Dd).
        ids: int64 (G, F), columns in ``RowDecoder.sparse`` order.
        rows_read: data rows in the chunk, good + bad.
        bad_count: bad rows skipped (reader-rejected + decode-rejected).
        bad_examples: the first bad rows in line order (at most ``max_examples``).
        jagged: sequence feature -> ids of the G rows (CSR), ``RowDecoder.sequences``.
    """

    labels: Float32Array
    dense: Float32Array
    ids: Int64Array
    rows_read: int
    bad_count: int
    bad_examples: list[BadRow]
    jagged: dict[str, JaggedIds] = field(default_factory=dict)


class RowDecoder:
    """Interprets raw rows according to a ``SchemaSpec``.

    Args:
        schema: label, dense and sparse columns, transforms.
        hash_names: sparse feature -> name whose seed hashes it (default: the
            feature itself). Features reading one shared table should share a name
            so equal values get equal ids.

    Attributes:
        sparse: single-valued features, the columns of ``DecodedChunk.ids``:
            ``schema.sparse`` then the non-sequence derived features.
        sequences: sequence features, the keys of ``DecodedChunk.jagged``.
        features: every sparse feature in model order: ``schema.sparse`` then the
            derived features in declaration order.
    """

    def __init__(self, schema: SchemaSpec, hash_names: Mapping[str, str] | None = None) -> None:
        hash_names = dict(hash_names or {})
        derived = [f.name for f in schema.features]
        unknown = sorted(set(hash_names) - set(schema.sparse) - set(derived))
        if unknown:
            raise ConfigError("data.schema.sparse", f"hash_names for unknown features {unknown}")
        try:
            self.dense_transform = DENSE_TRANSFORMS[schema.dense_transform]
        except KeyError:
            raise ConfigError(
                "data.schema.dense_transform",
                f"unknown {schema.dense_transform!r} (known: {', '.join(DENSE_TRANSFORMS)})",
            ) from None
        self.label = schema.label
        self.dense = list(schema.dense)
        self.transforms = resolve_transforms(schema.transforms, list(schema.sparse))
        self.seeds = [feature_seed(hash_names.get(f, f)) for f in schema.sparse]
        self.derived = compile_features(schema.features, hash_names)
        self.sparse = [*schema.sparse, *(f.name for f in self.derived if not f.jagged)]
        self.sequences = [f.name for f in self.derived if f.jagged]
        self.features = [*schema.sparse, *derived]
        # Columns to read from the files; a column may serve several roles.
        inputs = [c for f in schema.features for c in f.columns]
        self.columns = list(dict.fromkeys([self.label, *self.dense, *schema.sparse, *inputs]))

    def batch(
        self,
        labels: Float32Array,
        dense: Float32Array,
        ids: Int64Array,
        jagged: Mapping[str, JaggedIds],
        row_ids: Int64Array | None = None,
    ) -> Batch:
        """B decoded rows as a model-ready ``Batch``, features in model order.

        Args:
            labels: float32 (B,).
            dense: float32 (B, Dd).
            ids: int64 (B, F) in ``sparse`` order (``DecodedChunk.ids``).
            jagged: every ``sequences`` feature's ids of the B rows.
            row_ids: int64 (B,) the rows' positions, when known.
        """
        ids = np.ascontiguousarray(ids.T)  # (F, B): one transposing copy, features contiguous
        # One id per row: the single-valued features share one offsets array (B + 1,).
        offsets = np.arange(labels.shape[0] + 1, dtype=np.int64)
        offsets.flags.writeable = False
        bags = {name: JaggedIds(ids[f], offsets) for f, name in enumerate(self.sparse)}
        bags.update(jagged)
        return Batch(
            labels=labels,
            dense=dense,
            sparse={name: bags[name] for name in self.features},  # model order
            row_ids=row_ids,
        )

    def decode(self, chunk: RawChunk, max_examples: int) -> DecodedChunk:
        """The good rows of ``chunk`` and its bad-row counts (see module docstring)."""
        n = chunk.num_rows
        cols = chunk.columns
        field = np.full(n, -1, dtype=np.int32)  # index into `fields` of the first bad field
        code = np.zeros(n, dtype=np.uint8)
        # (name, raw values or None for ``cols[name]``, transform words)
        fields: list[tuple[str, pa.Array | None, str]] = []

        def flag(
            name: str, raw: pa.Array | None, mask: np.ndarray, reason: int, words: str = ""
        ) -> None:
            new = mask & (field < 0)
            if new.any():
                field[new] = len(fields)
                code[new] = reason
            fields.append((name, raw, words))

        numbers = self._numbers(cols)
        values, codes = numbers(self.label)
        flag(self.label, None, (codes != OK) | ((values != 0.0) & (values != 1.0)), _LABEL)
        labels = values.astype(np.float32)

        # Checks cost one pass each on clean columns (the common case); the masks
        # are built only for a column that has a bad value. A skipped ``flag`` would
        # have flagged no row, so the first failing field of every row is unchanged.
        columns = np.empty((len(self.dense), n), dtype=np.float32)  # (Dd, R)
        for j, name in enumerate(self.dense):
            values, codes = numbers(name)
            if codes.max(initial=OK) > MISSING:  # NOT_A_NUMBER or NOT_FINITE somewhere
                flag(name, None, codes == NOT_A_NUMBER, _NAN)
                flag(name, None, codes == NOT_FINITE, _NONFINITE)
            columns[j] = out = self.dense_transform(values)  # a contiguous write
            finite = np.isfinite(out)
            if not finite.all():
                flag(name, None, ~finite, _OVERFLOW)
        dense = np.ascontiguousarray(columns.T)  # (R, Dd): one transposing copy

        # (R, F): row-major so a shuffled batch gathers whole rows (one cache line
        # or so per row) instead of F scattered reads per row.
        ids = np.empty((n, len(self.sparse)), dtype=np.int64)
        in_place: set[int] = set()  # features hashed straight from a text block's spans
        if isinstance(cols, TextColumns):
            hashed = [
                f
                for f, name in enumerate(self.sparse[: len(self.seeds)])
                if name not in self.transforms
            ]
            hash_spans(
                cols.data,
                cols.starts,
                cols.ends,
                [cols.index[self.sparse[f]] for f in hashed],
                [self.seeds[f] for f in hashed],
                ids,
                hashed,
            )
            in_place = set(hashed)
        for f, name in enumerate(self.sparse[: len(self.seeds)]):
            if f in in_place:
                continue
            values = cols[name]
            transform = self.transforms.get(name)
            if transform is not None:
                raw = to_text(values)  # plain binary text (columns may be int64 or dictionary)
                values = transform(raw)
                present = pc.binary_length(raw).fill_null(0).to_numpy(zero_copy_only=False) > 0
                invalid = values.is_null().to_numpy(zero_copy_only=False) & present
                flag(
                    name, raw, invalid, _TRANSFORM, f"is not {transform.expects} ({transform.name})"
                )
            hash_array(values, self.seeds[f], out=ids[:, f])  # strided, in place

        jagged: dict[str, JaggedIds] = {}
        f = len(self.seeds)
        for feature in self.derived:
            made = feature.compute(cols)
            if made.invalid is not None and made.raw is not None:
                flag(feature.spec.columns[0], made.raw, made.invalid, _TRANSFORM, made.reason)
            if made.offsets is not None:
                jagged[feature.name] = JaggedIds(values=made.ids, offsets=made.offsets)
            else:
                ids[:, f] = made.ids
                f += 1

        good = field < 0
        bad_rows = np.flatnonzero(~good)
        examples = self._examples(chunk, bad_rows, field, code, fields, max_examples)
        if bad_rows.shape[0]:
            labels, dense, ids = labels[good], dense[good], ids[good]
            kept = np.flatnonzero(good)
            jagged = {name: bag.take(kept) for name, bag in jagged.items()}
        return DecodedChunk(
            labels=labels,
            dense=dense,
            ids=ids,
            rows_read=chunk.rows_read,
            bad_count=len(chunk.invalid) + int(bad_rows.shape[0]),
            bad_examples=examples,
            jagged=jagged,
        )

    def _numbers(
        self, cols: Mapping[str, pa.Array]
    ) -> Callable[[str], tuple[np.ndarray, np.ndarray]]:
        """name -> ``parse_numbers(cols[name])`` for the label and dense columns; a
        text block's are parsed in place, all in one pass, before the first call."""
        if not isinstance(cols, TextColumns):
            return lambda name: parse_numbers(cols[name])
        names = [self.label, *self.dense]
        values, codes = parse_number_spans(
            cols.data, cols.starts, cols.ends, [cols.index[c] for c in names]
        )  # (1 + Dd, R) each
        row = {c: j for j, c in enumerate(names)}
        return lambda name: (values[row[name]], codes[row[name]])

    @staticmethod
    def _examples(
        chunk: RawChunk,
        bad_rows: np.ndarray,
        field: np.ndarray,
        code: np.ndarray,
        fields: list[tuple[str, pa.Array | None, str]],
        limit: int,
    ) -> list[BadRow]:
        """The first ``limit`` bad rows of the chunk (reader's and ours) in line order."""
        if limit <= 0:
            return []
        ours = []
        for row in bad_rows[:limit]:
            name, raw, words = fields[field[row]]
            if raw is None:
                raw = chunk.columns[name]  # a text block's column is built here, if at all
            reason = words or _REASONS[int(code[row])]
            ours.append(
                BadRow(
                    chunk.file,
                    int(chunk.line_numbers[row]),
                    f"field {name}: {_show(raw[int(row)].as_py())} {reason}",
                )
            )
        merged = sorted([*chunk.invalid[:limit], *ours], key=lambda bad: bad.line)
        return merged[:limit]


def _show(value: bytes | str | int | None) -> str:
    """A raw value quoted for a message, shortened; invalid UTF-8 shown as ``\\xff``."""
    if value is None:
        return "''"
    text = value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else str(value)
    if len(text) > _MAX_SHOWN_CHARS:
        text = text[:_MAX_SHOWN_CHARS] + "..."
    return f"'{text}'"
