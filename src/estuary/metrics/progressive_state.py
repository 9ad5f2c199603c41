"""``ProgressiveStats`` as named arrays and back, for checkpoints.

The arrays are plain numeric ones (safetensors holds them, no pickle): an
``index`` (uint8, UTF-8 JSON) lists the groups, windows and origins with their
exact sums, and per group either its kept rows (``g<i>.labels`` int8 (N,),
``g<i>.probs`` float32 (N,)) or its histogram (``g<i>.counts`` int64 (2, bins));
lags are ``lag.counts`` and ``lag<i>.counts`` int64 (bins,). Size: the stats'
own (``ProgressiveStats.size_bytes``) plus the JSON.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import numpy.typing as npt

from estuary.metrics.histograms import LagHistogram, ScoreHistogram
from estuary.metrics.progressive import ProgressiveStats
from estuary.metrics.progressive_groups import GroupScores

__all__ = ["FORMAT", "restore_stats", "stats_arrays"]

FORMAT = 1
"""Version of the layout; ``restore_stats`` refuses another."""

Arrays = dict[str, npt.NDArray[Any]]


def _group(i: int, scores: GroupScores, out: Arrays) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "rows": scores.rows,
        "loss_sum": scores.loss_sum,
        "bins": scores.bins,
        "auc_at": None if scores.auc_at is None else list(scores.auc_at),
    }
    if scores.histogram is None:
        scores._merge()
        empty = (np.zeros(0, np.int8), np.zeros(0, np.float32))
        labels, probs = (scores.labels[0], scores.probs[0]) if scores.labels else empty
        out[f"g{i}.labels"], out[f"g{i}.probs"] = labels.copy(), probs.copy()
    else:
        out[f"g{i}.counts"] = scores.histogram.counts.copy()
    return entry


def _lag(name: str, histogram: LagHistogram, out: Arrays) -> dict[str, Any]:
    out[f"{name}.counts"] = histogram.counts.copy()
    return {"low": histogram.low, "high": histogram.high}


def stats_arrays(stats: ProgressiveStats) -> Arrays:
    """A copy of ``stats`` (taken under its lock) as named arrays."""
    out: Arrays = {}
    groups: list[dict[str, Any]] = []
    with stats.lock:
        for folded, part in ((False, stats.windows.open), (True, stats.windows.folded)):
            for (start, end), scores in part.items():  # open: oldest record first
                entry = _group(len(groups), scores, out)
                groups.append({**entry, "window": [start, end], "folded": folded})
        for name, scores in stats.origins.items():
            groups.append({**_group(len(groups), scores, out), "origin": name})
        origin_lags = [
            {"origin": name, **_lag(f"lag{i}", h, out)}
            for i, (name, h) in enumerate(stats.origin_lags.items())
        ]
        index = {
            "format": FORMAT,
            "groups": groups,
            "lag": _lag("lag", stats.lags, out),
            "origin_lags": origin_lags,
        }
    out["index"] = np.frombuffer(json.dumps(index).encode(), np.uint8).copy()
    return out


def _array(arrays: Arrays, name: str, dtype: type) -> npt.NDArray[Any]:
    if name not in arrays:
        raise ValueError(f"progressive state: array {name!r} is missing")
    array = np.asarray(arrays[name])
    if array.dtype != dtype:
        raise ValueError(f"progressive state: array {name!r} is {array.dtype}, not {dtype}")
    return array


def _restored_group(i: int, entry: dict[str, Any], arrays: Arrays) -> GroupScores:
    scores = GroupScores(int(entry["bins"]))
    scores.rows, scores.loss_sum = int(entry["rows"]), float(entry["loss_sum"])
    if entry["auc_at"] is not None:
        rows, auc = entry["auc_at"]
        scores.auc_at = (int(rows), float(auc))
    if f"g{i}.counts" in arrays:
        counts = _array(arrays, f"g{i}.counts", np.int64)
        histogram = ScoreHistogram(int(counts.shape[1]))
        histogram.counts = counts.copy()
        scores.histogram = histogram
    else:
        labels = _array(arrays, f"g{i}.labels", np.int8)
        probs = _array(arrays, f"g{i}.probs", np.float32)
        if labels.shape[0] != scores.rows or probs.shape[0] != scores.rows:
            raise ValueError(f"progressive state: group {i} has {scores.rows} rows, not arrays")
        if scores.rows:
            scores.labels, scores.probs = [labels.copy()], [probs.copy()]
    return scores


def _restored_lag(name: str, entry: dict[str, Any], arrays: Arrays) -> LagHistogram:
    histogram = LagHistogram()
    counts = _array(arrays, f"{name}.counts", np.int64)
    if counts.shape != histogram.counts.shape:
        raise ValueError(f"progressive state: {name}.counts has shape {counts.shape}")
    histogram.counts = counts.copy()
    histogram.low, histogram.high = float(entry["low"]), float(entry["high"])
    return histogram


def restore_stats(stats: ProgressiveStats, arrays: Arrays) -> None:
    """Replace the figures of ``stats`` by those saved in ``arrays``
    (``stats_arrays``); its scope stays.

    Raises:
        ValueError: the arrays are not a state of this ``FORMAT`` (names what).
    """
    index = json.loads(_array(arrays, "index", np.uint8).tobytes().decode())
    if index.get("format") != FORMAT:
        raise ValueError(f"progressive state: format {index.get('format')!r}, not {FORMAT}")
    try:
        restored = _restored(stats.scope, index, arrays)
    except (KeyError, TypeError, IndexError) as exc:
        raise ValueError(f"progressive state: index entry missing or malformed ({exc!r})") from exc
    with stats.lock:
        stats.windows, stats.origins = restored.windows, restored.origins
        stats.lags, stats.origin_lags = restored.lags, restored.origin_lags


def _restored(scope: str, index: dict[str, Any], arrays: Arrays) -> ProgressiveStats:
    restored = ProgressiveStats(scope)
    for i, entry in enumerate(index["groups"]):
        scores = _restored_group(i, entry, arrays)
        if "origin" in entry:
            restored.origins[str(entry["origin"])] = scores
            continue
        window = (int(entry["window"][0]), int(entry["window"][1]))
        part = restored.windows.folded if entry["folded"] else restored.windows.open
        part[window] = scores
    keys = [*restored.windows.open, *restored.windows.folded]
    restored.windows.newest_key = max(keys) if keys else None
    restored.lags = _restored_lag("lag", index["lag"], arrays)
    restored.origin_lags = {
        str(e["origin"]): _restored_lag(f"lag{i}", e, arrays)
        for i, e in enumerate(index["origin_lags"])
    }
    return restored
