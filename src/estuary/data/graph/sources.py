"""Source operators: a window of a source -> its splits -> raw rows.

``FileSource`` reads time-partitioned files::

    path: logs/{{YYYY}}{{MM}}{{DD}}/{{HH}}/part-*.tsv   (relative to the job file)
    window 2026-01-01T13 -> logs/20260101/13/part-*.tsv, ready once
                            logs/20260101/13/_SUCCESS exists

Source kinds are found by name (``register_source_type``); ``build_operators``
turns a ``DatasetSpec`` into one operator per task-producing source (a joined
stream gives one ``Joiner``; either of its sides may be files or a stream).
"""

from __future__ import annotations

import glob
import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path

import pyarrow.parquet as pq

from estuary.config.dataset import PLACEHOLDERS, BatchSourceSpec, DatasetSpec, parse_time
from estuary.config.errors import ConfigError
from estuary.config.spec import SourceSpec
from estuary.data.errors import DataFileError
from estuary.data.formats import RawChunk, ReadRequest, get_format
from estuary.data.graph.types import Readiness, SourceOperator, Split, Task
from estuary.plugins import SOURCE_TYPES

__all__ = ["FileSource", "build_operators", "register_source_type"]

SourceFactory = Callable[[BatchSourceSpec, str, int, Path, str, "int | None"], SourceOperator]


def register_source_type(name: str, factory: SourceFactory) -> None:
    """Make ``type: name`` sources buildable: ``factory(spec, stream, priority,
    base_dir, where, until_s)`` returns the operator (``estuary.plugins.SOURCE_TYPES``)."""
    SOURCE_TYPES.register(name, factory)


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


register_source_type("files", FileSource)


def build_operators(
    spec: DatasetSpec, base_dir: Path, label: str, streams: Sequence[str] | None = None
) -> list[SourceOperator]:
    """One operator per task-producing source of ``streams`` (default: the training
    streams): a ``FileSource`` per source, a ``Joiner`` per joined stream.

    Args:
        spec: ``data.dataset``.
        base_dir: the job file's folder.
        label: ``data.schema.label`` (a join writes it).
        streams: stream names to build.
    """
    from estuary.data.graph.joiner import Joiner  # joiner imports this module
    from estuary.data.graph.streams import StreamSource  # so does streams

    until_s = None if spec.timer.until is None else parse_time(spec.timer.until, "until")
    operators: list[SourceOperator] = []
    for stream_name in spec.train_streams() if streams is None else streams:
        if stream_name not in spec.streams:
            raise ValueError(f"no stream {stream_name!r} in data.dataset.streams")
        stream = spec.streams[stream_name]
        where = f"data.dataset.streams.{stream_name}"
        built: dict[str, SourceOperator] = {}
        for i, source in enumerate(stream.sources):
            factory: SourceFactory = SOURCE_TYPES.get(source.type, f"{where}.sources[{i}].type")
            built[source.name] = factory(
                source, stream_name, stream.priority, base_dir, f"{where}.sources[{i}]", until_s
            )
        if stream.join is None:
            operators.extend(built.values())
            continue
        left, right = built[stream.join.left], built[stream.join.right]
        for side, op in (("left", left), ("right", right)):
            if not isinstance(op, FileSource | StreamSource):
                raise ConfigError(
                    f"{where}.join.{side}", f"joins take file or stream sources, not {op!r}"
                )
        assert isinstance(left, FileSource | StreamSource)
        assert isinstance(right, FileSource | StreamSource)
        operators.append(Joiner(stream.join, left, right, label, f"{where}.join"))
    return operators
