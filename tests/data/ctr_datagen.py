"""Synthetic CTR files for the data-layer tests, and a pure-Python row decoder to
check the fast path against."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import numpy as np

from estuary.config.spec import DataSpec, SchemaSpec, SourceSpec

from .xxh64_reference import xxh64_reference

CRITEO_COLUMNS = ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]
CRITEO_DENSE = CRITEO_COLUMNS[1:14]
CRITEO_SPARSE = CRITEO_COLUMNS[14:]

AVAZU_COLUMNS = [
    "id", "click", "hour", "C1", "banner_pos", "site_id", "site_domain", "site_category",
    "app_id", "app_domain", "app_category", "device_id", "device_ip", "device_model",
    "device_type", "device_conn_type", "C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21",
]  # fmt: skip
AVAZU_SPARSE = [c for c in AVAZU_COLUMNS if c not in ("id", "click")]

Row = list[str]


def criteo_rows(n: int, seed: int = 0) -> list[Row]:
    """n valid Criteo-like rows: label, 13 counts (some empty, I2 may be -1), 26 hex."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        row = [str(rng.randint(0, 1))]
        for j in range(13):
            if rng.random() < 0.2:
                row.append("")
            elif j == 1 and rng.random() < 0.3:
                row.append("-1")
            else:
                row.append(str(rng.randint(0, 5000)))
        for _ in range(26):
            row.append("" if rng.random() < 0.1 else f"{rng.getrandbits(32):08x}")
        rows.append(row)
    return rows


def avazu_rows(n: int, seed: int = 0) -> list[Row]:
    """n valid Avazu-like rows (24 columns, hour YYMMDDHH in Oct 2014)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        hour = f"1410{rng.randint(21, 30):02d}{rng.randint(0, 23):02d}"
        row = [str(10**18 + i), str(rng.randint(0, 1)), hour, str(rng.choice([1005, 1002]))]
        row.append(str(rng.randint(0, 7)))  # banner_pos
        row += [f"{rng.getrandbits(32):08x}" for _ in range(9)]  # site_id .. device_model
        row += [str(rng.randint(0, 5)), str(rng.randint(0, 3))]
        row += [str(rng.randint(15000, 25000)) for _ in range(8)]
        rows.append(row)
    return rows


def join_rows(rows: Sequence[Row], sep: str, header: Sequence[str] | None = None) -> str:
    lines = ([sep.join(header)] if header else []) + [sep.join(r) for r in rows]
    return "".join(line + "\n" for line in lines)


def criteo_spec(*paths: str, **overrides: object) -> DataSpec:
    schema = SchemaSpec(dense=list(CRITEO_DENSE), sparse=list(CRITEO_SPARSE))
    fields: dict[str, object] = {
        "sources": [SourceSpec(path=p) for p in paths],
        "schema": schema,
        "eval_fraction": 0.0,
    }
    fields.update(overrides)
    return DataSpec(**fields)  # type: ignore[arg-type]


def ref_seed(name: str) -> int:
    return xxh64_reference(name.encode(), 0)


def ref_id(value: str, feature: str) -> int:
    u = xxh64_reference(value.encode(), ref_seed(feature))
    return u - (1 << 64) if u >= 1 << 63 else u


def ref_decode(
    row: Row, columns: Sequence[str], dense: Sequence[str], sparse: Sequence[str], label: str
) -> tuple[float, list[float], list[int]]:
    """The slow, obvious decoding of one good row: (label, dense log1p, ids)."""
    values = dict(zip(columns, row, strict=True))

    def log1p(text: str) -> float:
        x = float(text) if text else 0.0
        return math.copysign(math.log1p(abs(x)), x) if x else 0.0

    return (
        float(values[label]),
        [float(np.float32(log1p(values[c]))) for c in dense],
        [ref_id(values[c], c) for c in sparse],
    )
