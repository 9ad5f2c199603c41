"""Writing synthetic hours to disk: hourly partitions, atomic files, ``_SUCCESS``
markers, and a process pool over (hour, part) tasks (formats: ``formats``).

Layout (default pattern ``{YYYY}{MM}{DD}/{HH}``)::

    ROOT/20260101/00/part-00000.tsv.gz     # renamed into place when complete
    ROOT/20260101/00/_SUCCESS              # written last, once every part is in place

A file is written as ``.part-00000.tsv.gz.tmp-PID`` and renamed, so a reader
that lists ``part-*`` never sees half a file, and one that waits for
``_SUCCESS`` never sees half a partition.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from estuary.config.errors import ConfigError
from estuary.data.synthetic.formats import EXTRA_COLUMNS, SYNTHETIC_FORMATS, chunk_table
from estuary.data.synthetic.model import generate_chunks
from estuary.data.synthetic.spec import SyntheticSpec, hour_datetime

__all__ = [
    "SUCCESS",
    "PartitionResult",
    "SynthOutput",
    "SynthReport",
    "partition_dir",
    "write_partition",
    "write_synthetic",
]

SUCCESS = "_SUCCESS"
_TOKEN = re.compile(r"\{\{?([A-Za-z]+)\}?\}")
_TOKENS = {"YYYY": "%Y", "MM": "%m", "DD": "%d", "HH": "%H"}


@dataclass(frozen=True)
class SynthOutput:
    """How synthetic hours are laid out on disk.

    Args:
        format: ``criteo_tsv`` (no header), ``csv`` (header row), ``parquet`` or
            ``jsonl``; see ``SYNTHETIC_FORMATS``.
        gzip: compress text formats as ``.gz`` (Parquet: gzip pages instead of snappy).
        gzip_level: zlib level 1-9; 1 is ~3x faster than 6 for ~5% larger files.
        path_pattern: partition folder under the root; tokens ``{YYYY} {MM} {DD}
            {HH}`` (``{{YYYY}}`` also accepted).
        files_per_hour: parts each hour is split into (``part-00000`` ...); parts
            are written in parallel.
        success_marker: write ``_SUCCESS`` (JSON: rows, files, row-id range) once a
            partition's parts are all in place.
        extra_columns: any of ``row_id``, ``event_time_ms``, appended after ``C*``.
        overwrite: rewrite hours that already have ``_SUCCESS`` (default: skip them,
            so an interrupted run resumes).
    """

    format: str = "criteo_tsv"
    gzip: bool = False
    gzip_level: int = 1
    path_pattern: str = "{YYYY}{MM}{DD}/{HH}"
    files_per_hour: int = 1
    success_marker: bool = True
    extra_columns: tuple[str, ...] = ()
    overwrite: bool = False

    def validate(self, path: str = "output") -> None:
        """Raises ``ConfigError`` naming the bad field."""
        if self.format not in SYNTHETIC_FORMATS:
            known = ", ".join(sorted(SYNTHETIC_FORMATS))
            raise ConfigError(f"{path}.format", f"unknown format {self.format!r} ({known})")
        if not 1 <= self.gzip_level <= 9:
            raise ConfigError(f"{path}.gzip_level", "must be in [1, 9]")
        if self.files_per_hour < 1:
            raise ConfigError(f"{path}.files_per_hour", "must be > 0")
        for name in _TOKEN.findall(self.path_pattern):
            if name not in _TOKENS:
                raise ConfigError(
                    f"{path}.path_pattern", f"unknown token {{{name}}} (YYYY, MM, DD, HH)"
                )
        for name in self.extra_columns:
            if name not in EXTRA_COLUMNS:
                raise ConfigError(f"{path}.extra_columns", f"unknown column {name!r}")

    def file_name(self, part: int) -> str:
        fmt = SYNTHETIC_FORMATS[self.format]
        suffix = ".gz" if self.gzip and fmt.text else ""
        return f"part-{part:05d}.{fmt.extension}{suffix}"


def partition_dir(root: Path, pattern: str, hour: int) -> Path:
    """The folder of epoch hour ``hour``: ``root / pattern`` with its tokens filled."""
    when = hour_datetime(hour)
    return root / _TOKEN.sub(lambda m: when.strftime(_TOKENS[m.group(1)]), pattern)


# -- partitions ------------------------------------------------------------------------


@dataclass(frozen=True)
class PartitionResult:
    """One hour written (or skipped because its ``_SUCCESS`` was already there)."""

    hour: int
    path: Path
    rows: int
    files: list[str]
    size_bytes: int
    skipped: bool = False


@dataclass
class SynthReport:
    """What a ``write_synthetic`` call did."""

    partitions: list[PartitionResult] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.partitions if not p.skipped)

    @property
    def files(self) -> int:
        return sum(len(p.files) for p in self.partitions if not p.skipped)

    @property
    def size_bytes(self) -> int:
        return sum(p.size_bytes for p in self.partitions if not p.skipped)

    @property
    def skipped(self) -> int:
        return sum(p.skipped for p in self.partitions)

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.wall_s if self.wall_s > 0 else 0.0


def _part_rows(spec: SyntheticSpec, output: SynthOutput, part: int) -> tuple[int, int]:
    n, parts = spec.rows_per_hour, output.files_per_hour
    return part * n // parts, (part + 1) * n // parts


def _write_part(
    spec: SyntheticSpec, output: SynthOutput, root: Path, hour: int, part: int
) -> tuple[int, int, str, int]:
    """Write one part file atomically -> (hour, part, file name, size in bytes).
    Runs in a worker process when ``workers > 1``."""
    folder = partition_dir(root, output.path_pattern, hour)
    folder.mkdir(parents=True, exist_ok=True)
    name = output.file_name(part)
    tmp = folder / f".{name}.tmp-{os.getpid()}"
    writer = SYNTHETIC_FORMATS[output.format].open(tmp, output.gzip_level if output.gzip else None)
    try:
        for chunk in generate_chunks(spec, hour, *_part_rows(spec, output, part)):
            writer.write(chunk_table(chunk, output.extra_columns))
        writer.close()
        os.replace(tmp, folder / name)  # atomic: readers see all of the file or none
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return hour, part, name, (folder / name).stat().st_size


def _finish(
    spec: SyntheticSpec, output: SynthOutput, root: Path, hour: int, files: list[str], size: int
) -> PartitionResult:
    folder = partition_dir(root, output.path_pattern, hour)
    if output.success_marker:
        marker = {
            "rows": spec.rows_per_hour,
            "files": files,
            "row_id_start": hour * spec.rows_per_hour,
            "row_id_stop": (hour + 1) * spec.rows_per_hour,
            "hour": hour_datetime(hour).strftime("%Y-%m-%dT%H"),
            "seed": spec.seed,
        }
        tmp = folder / f".{SUCCESS}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(marker, sort_keys=True) + "\n")
        os.replace(tmp, folder / SUCCESS)  # last: the partition is complete
    return PartitionResult(hour, folder, spec.rows_per_hour, files, size)


def _pending_hours(
    spec: SyntheticSpec, output: SynthOutput, root: Path, hours: list[int], report: SynthReport
) -> Iterator[int]:
    """Hours to write; those already complete are recorded as skipped (unless
    overwriting, when their old marker goes first so no reader trusts a half-new hour)."""
    for hour in hours:
        marker = partition_dir(root, output.path_pattern, hour) / SUCCESS
        if marker.exists() and output.success_marker and not output.overwrite:
            report.partitions.append(PartitionResult(hour, marker.parent, 0, [], 0, True))
            continue
        marker.unlink(missing_ok=True)
        yield hour


def write_partition(
    spec: SyntheticSpec, root: Path | str, output: SynthOutput, hour: int
) -> PartitionResult:
    """Write epoch hour ``hour`` in this process: its old ``_SUCCESS`` (if any) goes
    first, then every part, then the new ``_SUCCESS``."""
    output.validate()
    spec.validate()
    root = Path(root)
    (partition_dir(root, output.path_pattern, hour) / SUCCESS).unlink(missing_ok=True)
    results = [_write_part(spec, output, root, hour, p) for p in range(output.files_per_hour)]
    return _finish(spec, output, root, hour, [r[2] for r in results], sum(r[3] for r in results))


def write_synthetic(
    spec: SyntheticSpec,
    root: Path | str,
    output: SynthOutput | None = None,
    *,
    workers: int = 1,
    hours: list[int] | None = None,
    on_partition: Callable[[PartitionResult], None] | None = None,
) -> SynthReport:
    """Write ``spec``'s hours (or ``hours``, epoch hours) under ``root``.

    With ``workers > 1`` every (hour, part) is a task on a process pool; a
    partition's ``_SUCCESS`` is written by this process once all its parts are in
    place, so markers appear in completion order, not necessarily time order.

    Args:
        spec: what to generate.
        root: output folder (created).
        output: layout; default ``SynthOutput()`` (Criteo TSV, plain, hourly folders).
        workers: processes; 1 writes in this process.
        hours: epoch hours to write instead of ``spec.epoch_hours()``.
        on_partition: called with each finished (or skipped) partition.
    """
    output = output or SynthOutput()
    output.validate()
    spec.validate()
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    report = SynthReport()
    began = time.perf_counter()
    wanted = list(spec.epoch_hours() if hours is None else hours)
    todo = list(_pending_hours(spec, output, root, wanted, report))
    if on_partition is not None:
        for skipped in report.partitions:
            on_partition(skipped)
    parts = output.files_per_hour
    if workers <= 1:
        for hour in todo:
            report.partitions.append(write_partition(spec, root, output, hour))
            if on_partition is not None:
                on_partition(report.partitions[-1])
    else:
        done: dict[int, list[tuple[str, int]]] = {hour: [] for hour in todo}
        with ProcessPoolExecutor(max_workers=workers) as pool:
            futures: list[Future[tuple[int, int, str, int]]] = [
                pool.submit(_write_part, spec, output, root, hour, p)
                for hour in todo
                for p in range(parts)
            ]
            try:
                for future in as_completed(futures):  # blocks until the next part is written
                    hour, _, name, size = future.result()
                    done[hour].append((name, size))
                    if len(done[hour]) == parts:
                        written = sorted(done.pop(hour))
                        files, size = [n for n, _ in written], sum(s for _, s in written)
                        report.partitions.append(_finish(spec, output, root, hour, files, size))
                        if on_partition is not None:
                            on_partition(report.partitions[-1])
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)  # waits for running parts only
                raise
    report.partitions.sort(key=lambda p: p.hour)
    report.wall_s = time.perf_counter() - began
    return report
