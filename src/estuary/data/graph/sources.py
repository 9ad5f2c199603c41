"""Source operators: a window of a source -> its splits -> raw rows.

``FileSource`` reads time-partitioned files::

    path: logs/{{YYYY}}{{MM}}{{DD}}/{{HH}}/part-*.tsv   (relative to the job file)
    window 2026-01-01T13 -> logs/20260101/13/part-*.tsv, ready once
                            logs/20260101/13/_SUCCESS exists

Source kinds are found by name (``estuary.plugins.SOURCE_TYPES``);
``operators.build_operators`` turns a ``DatasetSpec`` into operators.
"""

from __future__ import annotations

import glob
import itertools
import os
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path

import pyarrow.parquet as pq

from estuary.config.dataset import PLACEHOLDERS, BatchSourceSpec
from estuary.config.errors import ConfigError
from estuary.config.spec import SourceSpec
from estuary.data.errors import DataFileError
from estuary.data.formats import RawChunk, ReadRequest, get_format
from estuary.data.graph.types import Readiness, Split, Task

__all__ = ["FileSource"]


def display_path(path: Path, base_dir: Path) -> str:
    """A file as users see it: relative to the job folder when inside it."""
    try:
        return path.relative_to(base_dir).as_posix()
    except ValueError:
        return str(path)


class FileSource:
    """Time-partitioned files (see module docstring).

    Args:
        spec: the source section.
        stream: the stream it belongs to.
        priority: the stream's priority.
        base_dir: folder relative paths resolve against.
        where: config path of the source, for errors.
        until_s: for an open-ended source, plan no window starting at or after it.
    """

    def __init__(
        self,
        spec: BatchSourceSpec,
        stream: str,
        priority: int,
        base_dir: Path,
        where: str,
        until_s: int | None = None,
    ) -> None:
        spec.validate(where)
        self.spec = spec
        self.stream = stream
        self.name = spec.name
        self.rank = -priority
        self.where = where
        self.base_dir = Path(base_dir)
        self.step_s = spec.step_s
        self.start_s = spec.start_s
        self.end_s = spec.end_s
        self.open_ended = self.end_s is None
        self.stop_s = self.end_s if self.end_s is not None else until_s
        pattern = Path(spec.path).expanduser()
        self.pattern = str(pattern if pattern.is_absolute() else self.base_dir / pattern)
        # strftime template: literal '%' escaped, then each placeholder -> its code.
        template = self.pattern.replace("%", "%%")
        for name, code in PLACEHOLDERS.items():
            template = template.replace("{{" + name + "}}", code).replace("{" + name + "}", code)
        self._template = template
        if spec.success_marker is not None and glob.has_magic(os.path.dirname(template)):
            raise ConfigError(
                f"{where}.success_marker",
                "needs the files' folder to be a plain path (no glob in it): "
                "the marker is looked for there",
            )
        self._source_spec = SourceSpec(
            path=spec.path, format=spec.format, columns=spec.columns, compression=spec.compression
        )
        get_format(spec.format, f"{where}.format")  # fail early on an unknown format

    def __repr__(self) -> str:
        return f"FileSource({self.stream}/{self.name}: {self.pattern})"

    # -- planning (no file system access: must stay fast) ----------------------

    def tasks(self) -> Iterator[Task]:
        step, rank, stream, name = self.step_s, self.rank, self.stream, self.name
        starts: Iterator[int] = (
            itertools.count(self.start_s, step)
            if self.stop_s is None
            else iter(range(self.start_s, self.stop_s, step))
        )
        new = tuple.__new__  # Task(...) without NamedTuple's Python-level __new__
        for start in starts:
            yield new(Task, (start, rank, stream, name, start + step))

    # -- partitions ---------------------------------------------------------------

    def partition_pattern(self, task: Task) -> str:
        """The file pattern of ``task``'s window (placeholders filled in)."""
        return datetime.fromtimestamp(task.start_s, UTC).strftime(self._template)

    def marker_path(self, task: Task) -> Path | None:
        if self.spec.success_marker is None:
            return None
        return Path(self.partition_pattern(task)).parent / self.spec.success_marker

    def files(self, task: Task) -> list[Path]:
        """The window's files, sorted by name (the marker and hidden files excluded)."""
        pattern = self.partition_pattern(task)
        if not glob.has_magic(pattern):
            return [Path(pattern)] if os.path.isfile(pattern) else []
        marker = self.spec.success_marker
        return sorted(
            Path(p) for p in glob.glob(pattern) if os.path.isfile(p) and Path(p).name != marker
        )

    def check_ready(self, task: Task) -> Readiness:
        marker = self.marker_path(task)
        if marker is not None:
            if marker.is_file():
                return Readiness(True)
            return Readiness(False, f"{task.id}: {display_path(marker, self.base_dir)}")
        if self.files(task):
            return Readiness(True)
        pattern = display_path(Path(self.partition_pattern(task)), self.base_dir)
        return Readiness(False, f"{task.id}: files matching {pattern}")

    def splits(self, task: Task) -> list[Split]:
        files = self.files(task)
        if not files and self.spec.success_marker is None:
            pattern = self.partition_pattern(task)
            raise DataFileError(f"{task.id}: no files match {pattern!r}")
        ranges: list[tuple[Path, str, int, int | None]] = []
        for path in files:
            shown = display_path(path, self.base_dir)
            if self.spec.split_rows is None:
                ranges.append((path, shown, 1, None))
                continue
            rows = _parquet_rows(path, shown)
            for first in range(1, max(rows, 1) + 1, self.spec.split_rows):
                stop = first + self.spec.split_rows
                ranges.append((path, f"{shown}#rows={first}-{stop - 1}", first, stop))
        return [
            Split(task, shown, str(path), i, len(ranges), first, stop)
            for i, (path, shown, first, stop) in enumerate(ranges)
        ]

    def prepare(self, task: Task) -> object:
        return None

    def read(
        self, split: Split, columns: Sequence[str], context: object, block_size_bytes: int
    ) -> Iterator[RawChunk]:
        path = Path(split.location)
        request = ReadRequest(
            path=path,
            display=display_path(path, self.base_dir),
            source=self._source_spec,
            where=self.where,
            columns=list(columns),
            block_size_bytes=block_size_bytes,
            threads=1,  # parallelism comes from reading several splits at once
        )
        return get_format(self.spec.format, f"{self.where}.format").read(request)


def _parquet_rows(path: Path, shown: str) -> int:
    try:
        return int(pq.read_metadata(str(path)).num_rows)
    except (OSError, ValueError) as exc:
        raise DataFileError(f"{shown}: cannot read the Parquet footer: {exc}") from exc
