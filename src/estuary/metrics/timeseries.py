"""A run's time series: ``RUN_DIR/timeseries.jsonl``, one JSON object a line,
appended by rank 0 while it trains and read by ``estuary report``.

Records (every one has ``kind`` and ``time``, s since 1970)::

    {"kind": "start", "step": 0, "world_size": 2, "mode": "sync", "job": "criteo-dlrm",
     "restarts": 0}                                      a fit starts (a resume: restarts > 0)
    {"kind": "sample", "step": 120, "rows": 15360,       0.25 s .. timeseries_every_s apart
     "loss": 0.47, "rows_per_s": 24000.0,                 loss: mean over the interval's steps
     "auc_window": 0.74, "staleness_max": 0, "bad_rows": 0,
     "stages": {"data_s": 0.1, "lookup_s": 0.2, ...},     cumulative seconds per stage
     "tables": {"C1": {"rows": 812, "bytes": 60000, "admissions": 812, "evictions": 0}},
     "data_lag_s": {"clicks": 42.0}, "queues": {"sparse_updates": 0}}
    {"kind": "checkpoint", "step": 200, "duration_s": 0.31}
    {"kind": "eval", "step": 270, "auc": 0.75, "logloss": 0.47, "rows": 3457}
    {"kind": "scaling", "step": 500, "action": "grow", "trainers": 4, "reason": "..."}
    {"kind": "end", "step": 270, "rows": 31121, "rows_per_s": 23000.0}

``scaling`` records are written by a runtime that resizes a run (none of the
built-in ones does yet); the report plots them when there are any.

Cost: a line is written and flushed (no fsync) per sample, about 30 us plus
the table stats the sample reads; a resumed run appends to the same file.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["TIMESERIES_FILE", "TimeSeriesWriter", "read_timeseries"]

TIMESERIES_FILE = "timeseries.jsonl"


def _clean(value: Any) -> Any:
    """NaN and infinities as ``null`` (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    return value


class TimeSeriesWriter:
    """Appends records to ``folder/timeseries.jsonl`` (created on first write).

    Args:
        folder: the run folder (``output.dir``).
    """

    def __init__(self, folder: Path) -> None:
        self.path = folder / TIMESERIES_FILE
        self._file: IO[str] | None = None
        # Records come from the training thread and an asynchronous checkpoint's writer.
        self._lock = threading.Lock()

    def write(self, kind: str, **fields: Any) -> None:
        """One record (``kind``, ``time`` now, then ``fields``), flushed; any thread."""
        record = {"kind": kind, "time": round(time.time(), 3), **_clean(fields)}
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = self.path.open("a", encoding="utf-8")
            self._file.write(line)
            self._file.flush()  # a report (or a crash) sees every line written so far

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_timeseries(path: Path) -> Iterator[dict[str, Any]]:
    """The records of a ``timeseries.jsonl`` in order; a torn last line (a run
    killed mid-write) is skipped.

    Raises:
        ValueError: a line before the last is not a JSON object (names the line).
    """
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):
                return  # the writer was killed mid-line
            raise ValueError(f"{path}:{number}: not a JSON line ({exc})") from exc
        if not isinstance(record, dict) or "kind" not in record:
            raise ValueError(f"{path}:{number}: not a time series record")
        yield record
