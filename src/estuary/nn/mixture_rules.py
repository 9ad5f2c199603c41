"""Which rows update what in a mixture model (``model.params.update``).

A batch is **history** or **stream** by its origin (``Batch.origin``,
``"stream/source"`` of a ``data.dataset`` batch): history when its stream is in
``history_streams``; a batch without an origin (``data.sources`` runs, rows that
mix sources) takes ``unknown_origin``. Each kind has a ``Rule``: learning-rate
scales for the memory tower, the adapt tower, the gate and the embedding tables;
0 freezes that part for the batch. ``estuary.train.mixture`` turns a rule into
the step's ``UpdatePlan``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from estuary.errors import ConfigError

__all__ = ["PARTS", "MixtureRules", "RowKind", "Rule"]

RowKind = Literal["history", "stream"]
PARTS = ("memory", "adapt", "gate", "embeddings")
"""The parts a rule scales: the two towers' and the gate's parameters (submodule
names of ``MixtureModel``), and every embedding table."""


@dataclass(frozen=True)
class Rule:
    """Learning-rate scales of one kind of rows (0: frozen for those rows)."""

    memory: float = 1.0
    adapt: float = 1.0
    gate: float = 1.0
    embeddings: float = 1.0

    @classmethod
    def parse(cls, data: Any, path: str, default: Rule) -> Rule:
        if data is None:
            return default
        if not isinstance(data, Mapping):
            raise ConfigError(path, f"expected a mapping of {list(PARTS)} -> scale")
        values = {p: getattr(default, p) for p in PARTS}
        for key, scale in data.items():
            if key not in PARTS:
                raise ConfigError(f"{path}.{key}", f"unknown part; known: {list(PARTS)}")
            if isinstance(scale, bool) or not isinstance(scale, int | float):
                raise ConfigError(f"{path}.{key}", f"expected a number, got {scale!r}")
            if not (math.isfinite(scale) and scale >= 0):
                raise ConfigError(f"{path}.{key}", f"a scale must be finite and >= 0, got {scale}")
            values[key] = float(scale)
        return cls(**values)


HISTORY_DEFAULT = Rule()
STREAM_DEFAULT = Rule(memory=0.0, adapt=1.0, gate=1.0, embeddings=0.1)


@dataclass(frozen=True)
class MixtureRules:
    """The update rules of a mixture job.

    Args:
        history_streams: ``data.dataset`` streams whose rows are history.
        unknown_origin: the kind of a batch without an origin.
        history: scales for history rows (default: everything at 1).
        stream: scales for stream rows (default: memory tower frozen, adapt
            tower and gate at 1, embeddings at 0.1).
    """

    history_streams: tuple[str, ...] = ("history",)
    unknown_origin: RowKind = "history"
    history: Rule = HISTORY_DEFAULT
    stream: Rule = STREAM_DEFAULT

    @classmethod
    def parse(cls, data: Any, path: str = "model.params.update") -> MixtureRules:
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise ConfigError(path, "expected a mapping")
        known = ("history_streams", "unknown_origin", "history", "stream")
        for key in data:
            if key not in known:
                raise ConfigError(f"{path}.{key}", f"unknown field; known: {list(known)}")
        streams = data.get("history_streams", ["history"])
        if isinstance(streams, str) or not all(isinstance(s, str) for s in streams):
            raise ConfigError(f"{path}.history_streams", "expected a list of stream names")
        unknown = data.get("unknown_origin", "history")
        if unknown not in ("history", "stream"):
            raise ConfigError(
                f"{path}.unknown_origin", f"expected history or stream, got {unknown!r}"
            )
        return cls(
            history_streams=tuple(streams),
            unknown_origin=unknown,
            history=Rule.parse(data.get("history"), f"{path}.history", HISTORY_DEFAULT),
            stream=Rule.parse(data.get("stream"), f"{path}.stream", STREAM_DEFAULT),
        )

    def kind(self, origin: str | None) -> RowKind:
        """History or stream, for a batch of ``origin`` (``"stream/source"``)."""
        if origin is None:
            return self.unknown_origin
        return "history" if origin.split("/", 1)[0] in self.history_streams else "stream"

    def rule(self, kind: RowKind) -> Rule:
        return self.history if kind == "history" else self.stream
