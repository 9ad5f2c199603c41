"""Logging set-up for the command line and its trainer processes: levels per
component, text or JSON lines, and the rank and step on every record.

::

    settings = LogSettings.parse(["estuary.ps=DEBUG", "data=INFO"], verbosity=0, fmt="json")
    settings.apply(rank=0)          # this process
    settings.export(os.environ)     # spawned trainer processes: LogSettings.from_env()

A component is a logger name under ``estuary`` (``estuary.ps``, ``estuary.data.graph``;
the ``estuary.`` may be left out). ``LOG_CONTEXT`` holds this process's rank and
the training step; the fit loop sets the step after each one (an attribute
write), and ``ContextFilter`` copies both onto each record, so a JSON line reads::

    {"time": "2026-12-01T16:41:45.123Z", "level": "INFO", "component": "estuary.data.graph.timer",
     "rank": 0, "step": 1200, "message": "waiting for data/20260101/13/_SUCCESS"}
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from tqdm import tqdm

from estuary.config.errors import ConfigError

__all__ = [
    "ENV_VAR",
    "LOG_CONTEXT",
    "LOG_FORMATS",
    "ContextFilter",
    "JsonFormatter",
    "LogContext",
    "LogSettings",
]

ENV_VAR = "ESTUARY_LOGGING"
"""Carries ``LogSettings`` to spawned trainer processes (JSON)."""

LOG_FORMATS = ("text", "json")
_ROOT = "estuary"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_LEVELS_SET: set[str] = set()  # loggers whose level the last ``apply`` set


@dataclass
class LogContext:
    """What every record of this process is stamped with.

    Args:
        rank: the trainer's rank (0 in a one-trainer run and in the launcher).
        step: the global step last finished (``None`` before training).
    """

    rank: int = 0
    step: int | None = None


LOG_CONTEXT = LogContext()
"""This process's context; the fit loop updates ``step``."""


class ContextFilter(logging.Filter):
    """Copies ``LOG_CONTEXT`` onto each record (``record.rank``, ``record.step``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = LOG_CONTEXT.rank
        record.step = LOG_CONTEXT.step
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ms), level, component (the logger's
    name), rank, step, message, and ``exception`` when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.fromtimestamp(record.created, UTC)
        line: dict[str, Any] = {
            "time": when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z",
            "level": record.levelname,
            "component": record.name,
            "rank": getattr(record, "rank", LOG_CONTEXT.rank),
            "step": getattr(record, "step", LOG_CONTEXT.step),
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class _StderrHandler(logging.StreamHandler):
    """A stream handler on the current ``sys.stderr`` (tests swap it per test);
    records go through ``tqdm.write``, so a line never lands on a progress bar's."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        """``StreamHandler.__init__`` assigns one; stderr is looked up at each record."""


def _component(name: str) -> str:
    name = name.strip()
    if name in ("", _ROOT):
        return _ROOT
    return name if name.startswith(_ROOT + ".") else f"{_ROOT}.{name}"


@dataclass(frozen=True)
class LogSettings:
    """How this run logs.

    Args:
        levels: logger name -> level name; ``estuary`` is the default for every
            component not named.
        fmt: ``text`` (``LEVEL component: message``) or ``json`` (one object a line).
    """

    levels: Mapping[str, str] = field(default_factory=lambda: {_ROOT: "WARNING"})
    fmt: str = "text"

    @classmethod
    def parse(cls, items: Sequence[str], *, verbosity: int = 0, fmt: str = "text") -> LogSettings:
        """From ``--log-level`` items (``LEVEL`` for every component, or
        ``COMPONENT=LEVEL``), ``--verbose`` (+1: INFO, +2: DEBUG) / ``--quiet``
        (-1: ERROR) and ``--log-format``. The port line of the metrics server
        (``estuary.metrics``, INFO) shows unless a level hides it.

        Raises:
            ConfigError: an unknown level or format (path ``--log-level`` / ``--log-format``).
        """
        if fmt not in LOG_FORMATS:
            known = ", ".join(LOG_FORMATS)
            raise ConfigError("--log-format", f"must be one of {known}; got {fmt!r}")
        default = {-1: "ERROR", 0: "WARNING", 1: "INFO"}.get(max(-1, verbosity), "DEBUG")
        levels = {_ROOT: default}
        if verbosity >= 0:
            levels[f"{_ROOT}.metrics"] = "DEBUG" if verbosity >= 2 else "INFO"
        for item in items:
            name, _, level = item.rpartition("=")
            level = level.strip().upper()
            if level not in _LEVELS:
                raise ConfigError(
                    "--log-level",
                    f"{item!r}: level must be one of {', '.join(_LEVELS)} "
                    "(as LEVEL or COMPONENT=LEVEL, e.g. estuary.ps=DEBUG)",
                )
            component = _component(name)
            if component == _ROOT:  # a default for all: components set before it yield
                levels = {n: v for n, v in levels.items() if n != f"{_ROOT}.metrics"}
            levels[component] = level
        return cls(levels=levels, fmt=fmt)

    def apply(self, *, rank: int = 0) -> logging.Handler:
        """Configure the ``estuary`` loggers of this process (replacing the handler
        a previous ``apply`` installed); returns the handler, which writes to
        whatever ``sys.stderr`` is when a record comes. Records still propagate
        to the root logger (which has no handler unless an embedding program
        added one)."""
        LOG_CONTEXT.rank = rank
        root = logging.getLogger(_ROOT)
        for old in [h for h in root.handlers if isinstance(h, _StderrHandler)]:
            root.removeHandler(old)
        handler = _StderrHandler()
        handler.addFilter(ContextFilter())
        if self.fmt == "json":
            handler.setFormatter(JsonFormatter())
        else:
            handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
        for name in _LEVELS_SET - set(self.levels):  # a previous apply's, not ours
            logging.getLogger(name).setLevel(logging.NOTSET)
        for name, level in self.levels.items():
            logging.getLogger(name).setLevel(level)
        _LEVELS_SET.clear()
        _LEVELS_SET.update(self.levels)
        return handler

    def to_json(self) -> str:
        return json.dumps({"levels": dict(self.levels), "format": self.fmt})

    def export(self, environ: MutableMapping[str, str] | None = None) -> None:
        """Hand these settings to processes started from this one (``ENV_VAR``)."""
        (os.environ if environ is None else environ)[ENV_VAR] = self.to_json()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LogSettings | None:
        """The settings a parent process exported, if any."""
        text = (os.environ if environ is None else environ).get(ENV_VAR)
        if not text:
            return None
        data = json.loads(text)
        return cls(levels=dict(data["levels"]), fmt=str(data["format"]))
