"""The scaling manager's log: every snapshot, every decision with its trigger
and its measured effect (the next interval's figures against the one that
triggered it), written as ``scaling.json`` plus a plot ``scaling.png``.

``scaling.json``::

    {"policy": "estuary", "interval_s": 5.0,
     "snapshots": [{"interval": 1, "t": 5.0, "executors": 1, "rows_per_s": ...}, ...],
     "decisions": [{"interval": 3, "t": 15.0, "knob": "executors", "old": 1, "new": 6,
                    "trigger": "...", "metrics": {...}, "applied": true,
                    "effect": {"rows_per_s_before": ..., "rows_per_s_after": ...}},
                   {"knob": "hot_shard:0", ..., "migration": {"slots": 310, "rows": ...,
                    "pause_ms": ..., "to": 1, ...},
                    "effect": {"load_share_before": 0.81, "load_share_after": 0.52, ...}},
                   {"knob": "ps_shards", "old": 1, "new": 2, "migration": {"kind": "split",
                    "rows": ..., "pause_ms": ..., "memory_bytes_after": [...], ...},
                    "effect": {"shards_after": 2, "max_shard_memory_after": ..., ...}},
                   ...],
     "n_scale_actions": 1, "reversed_actions": 0}
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from estuary.runtime.scaling.metrics import Snapshot
from estuary.runtime.scaling.policy import Decision

__all__ = ["Timeline", "reversed_actions"]


def reversed_actions(decisions: list[dict[str, Any]], hold: int) -> int:
    """Applied decisions that moved a knob back within ``hold`` intervals of its
    previous move."""
    last: dict[str, tuple[int, int]] = {}
    count = 0
    for d in decisions:
        if not d["applied"] or d["knob"].startswith("hot_shard"):
            continue
        direction = (d["new"] > d["old"]) - (d["new"] < d["old"])
        prev = last.get(d["knob"])
        if prev is not None and d["interval"] - prev[0] <= hold and direction != prev[1]:
            count += 1
        last[d["knob"]] = (d["interval"], direction)
    return count


class Timeline:
    """See the module docstring."""

    def __init__(self, policy: str, interval_s: float) -> None:
        self.policy = policy
        self.interval_s = interval_s
        self.snapshots: list[dict[str, Any]] = []
        self.decisions: list[dict[str, Any]] = []
        self._pending: list[dict[str, Any]] = []  # applied, effect not measured yet

    def observe(self, interval: int, snapshot: Snapshot) -> None:
        row = {"interval": interval, **snapshot.as_dict()}
        previous = self.snapshots[-1] if self.snapshots else None
        self.snapshots.append(row)
        # The effect: the first interval run wholly at the new size (every
        # executor up since the interval before it began).
        settled = not row["executors_starting"] and not (
            previous is not None and previous["executors_starting"]
        )
        if not settled:
            return
        for decision in self._pending:
            effect = _effect(decision["before"], row)
            knob, _, shard = decision["knob"].partition(":")
            if knob == "hot_shard":
                effect.update(_load_shares(int(shard), decision["before"], row))
            if knob == "ps_shards":
                effect.update(_shard_memory(decision["before"], row))
            decision["effect"] = {"interval": interval, **effect}
            del decision["before"]
        self._pending = []

    def decide(
        self,
        interval: int,
        t: float,
        decision: Decision,
        why_not: str | None,
        detail: dict[str, Any] | None = None,
    ) -> None:
        """Log ``decision`` (``why_not``: it was not applied; ``detail``: what the
        actuator did, e.g. a migration's rows and pause)."""
        row: dict[str, Any] = {"interval": interval, "t": round(t, 3), **decision.as_dict()}
        row["applied"] = why_not is None
        if detail:
            row.update(detail)
        if why_not is not None:
            row["not_applied"] = why_not
        else:
            row["before"] = self.snapshots[-1]
            self._pending.append(row)
        self.decisions.append(row)

    def refuse(self, interval: int, t: float, decision: Decision) -> None:
        row = {"interval": interval, "t": round(t, 3), **decision.as_dict()}
        row.update(applied=False, not_applied="would reverse a recent decision (hysteresis)")
        self.decisions.append(row)

    @property
    def n_scale_actions(self) -> int:
        return sum(
            1 for d in self.decisions if d["applied"] and not d["knob"].startswith("hot_shard")
        )

    def as_dict(self, hold: int = 2) -> dict[str, Any]:
        decisions = [{k: v for k, v in d.items() if k != "before"} for d in self.decisions]
        return {
            "policy": self.policy,
            "interval_s": self.interval_s,
            "snapshots": self.snapshots,
            "decisions": decisions,
            "n_scale_actions": self.n_scale_actions,
            "reversed_actions": reversed_actions(self.decisions, hold),
        }

    def write(self, folder: Path, name: str = "scaling") -> Path:
        """``NAME.json`` (atomic) and ``NAME.png`` in ``folder``; returns the JSON's path."""
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{name}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.as_dict(), indent=1))
        os.replace(tmp, path)
        self.plot(folder / f"{name}.png")
        return path

    def plot(self, path: Path) -> None:
        """Rows/s, executors and shard memory over time; decisions as vertical lines."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        t = [s["t"] for s in self.snapshots]
        shards = {sh["shard"] for s in self.snapshots for sh in s["shards"]}
        executors = any(s["executors"] for s in self.snapshots)
        fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
        axes[0].plot(t, [s["rows_per_s"] for s in self.snapshots], label="rows/s")
        axes[0].set_ylabel("rows/s")
        axes[1].step(t, [s["executors"] for s in self.snapshots], where="post", label="executors")
        waits = [s["trainer_wait"] for s in self.snapshots]
        if any(w is not None for w in waits):
            twin = axes[1].twinx()
            twin.plot(t, [w if w is not None else float("nan") for w in waits], "r:")
            twin.set_ylabel("trainer wait", color="r")
        axes[1].set_ylabel("executors" if executors else "executors (none here)")
        for p in sorted(shards):
            mem = [
                next((sh["memory_bytes"] / 2**20 for sh in s["shards"] if sh["shard"] == p), 0.0)
                for s in self.snapshots
            ]
            axes[2].plot(t, mem, label=f"shard {p}")
            budgets = [sh["budget_bytes"] for s in self.snapshots for sh in s["shards"]]
            budget = next((b for b in budgets if b), None)
            if budget and p == min(shards):
                axes[2].axhline(budget / 2**20, color="k", linestyle="--", linewidth=0.8)
        axes[2].set_ylabel("PS memory (MiB)" if shards else "PS memory (none here)")
        axes[2].set_xlabel("seconds")
        for d in self.decisions:
            if d["applied"]:
                for ax in axes:
                    ax.axvline(d["t"], color="g", alpha=0.4)
        axes[0].set_title(f"scaling ({self.policy}): green lines = applied decisions")
        fig.tight_layout()
        fig.savefig(path, dpi=80)
        plt.close(fig)


def _load_shares(shard: int, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    # A rebalanced shard's share of the ids looked up, the interval before and after.
    def share(row: dict[str, Any]) -> float | None:
        loads = {s["shard"]: s["load"] for s in row["shards"]}
        total = sum(loads.values())
        return round(loads.get(shard, 0.0) / total, 4) if total > 0 else None

    return {"load_share_before": share(before), "load_share_after": share(after)}


def _shard_memory(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    # A split or merge: the shard count and the largest shard's memory, before and after.
    def largest(row: dict[str, Any]) -> int:
        return max((s["memory_bytes"] for s in row["shards"]), default=0)

    return {
        "shards_before": len(before["shards"]),
        "shards_after": len(after["shards"]),
        "max_shard_memory_before": largest(before),
        "max_shard_memory_after": largest(after),
    }


def _effect(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    effect: dict[str, Any] = {
        "rows_per_s_before": before["rows_per_s"],
        "rows_per_s_after": after["rows_per_s"],
        "trainer_wait_before": before["trainer_wait"],
        "trainer_wait_after": after["trainer_wait"],
    }
    mem_before = sum(s["memory_bytes"] for s in before["shards"])
    mem_after = sum(s["memory_bytes"] for s in after["shards"])
    if before["shards"]:
        effect.update(memory_bytes_before=mem_before, memory_bytes_after=mem_after)
    if before.get("executor_memory") and after.get("executor_memory"):
        effect.update(
            executor_peak_bytes_before=before["executor_memory"]["peak_bytes"],
            executor_peak_bytes_after=after["executor_memory"]["peak_bytes"],
        )
    return effect
