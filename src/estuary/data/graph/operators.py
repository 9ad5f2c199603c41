"""``build_operators``: a ``DatasetSpec`` -> one operator per task-producing
source. Each source is built by its kind's factory, found by name in
``estuary.plugins.SOURCE_TYPES`` (``files``: ``FileSource``, ``stream``:
``StreamSource``; ``register_source_type`` adds more); a joined stream gives one
``Joiner`` over its two sources (either side may be files or a stream).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from estuary.config.dataset import BatchSourceSpec, DatasetSpec, parse_time
from estuary.config.errors import ConfigError
from estuary.data.graph.joiner import Joiner
from estuary.data.graph.sources import FileSource
from estuary.data.graph.streams import StreamSource
from estuary.data.graph.types import SourceOperator
from estuary.plugins import SOURCE_TYPES

__all__ = ["SourceFactory", "build_operators", "register_source_type"]

SourceFactory = Callable[[BatchSourceSpec, str, int, Path, str, "int | None"], SourceOperator]
"""``factory(spec, stream, priority, base_dir, where, until_s)`` -> the operator."""


def register_source_type(name: str, factory: SourceFactory) -> None:
    """Make ``type: name`` sources buildable: ``factory(spec, stream, priority,
    base_dir, where, until_s)`` returns the operator (``estuary.plugins.SOURCE_TYPES``)."""
    SOURCE_TYPES.register(name, factory)


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
