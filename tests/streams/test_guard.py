"""The offset guard (a reader never hands out a message at or before where it
was opened, nor out of order) and the stream order of a resumed task's splits
(never the text order of a checkpoint's JSON keys)."""

from __future__ import annotations

import itertools
import uuid
from pathlib import Path

import numpy as np
import pytest

from estuary.config.dataset import BatchSourceSpec
from estuary.config.streams import StartPosition, StreamSourceSpec
from estuary.data.graph import Progress
from estuary.data.graph.streams import StreamSource, parse_split_name, split_name
from estuary.data.graph.types import Task
from estuary.data.streams import StreamError, StreamMessage, StreamReader, get_backend
from estuary.data.streams.guard import GuardedConnector
from estuary.data.streams.memory import MemoryConnector, memory_stream
from estuary.testing.streams import COLUMNS, row


class Replaying(MemoryConnector):
    """A broken broker: after a reopen it hands out what it already gave."""

    def __init__(self, spec: StreamSourceSpec, rewind: int) -> None:
        super().__init__(spec)
        self.rewind = rewind

    def open(self, start: StartPosition) -> None:
        super().open(start)
        self.at = self._cursor

    def read(self, max_messages: int, timeout_s: float) -> list[StreamMessage]:
        self._cursor = self.at - self.rewind  # what a consumer built from a stale view does
        return super().read(max_messages, timeout_s)


def _spec() -> StreamSourceSpec:
    key = uuid.uuid4().hex
    memory_stream("memory://guard", key).append([row(i) for i in range(1, 21)])
    return StreamSourceSpec(
        kind="memory", url="memory://guard", key=key, name="clicks", format="csv", columns=COLUMNS
    )


def test_a_message_at_or_before_the_committed_offset_is_refused() -> None:
    spec = _spec()
    reader = StreamReader(spec, COLUMNS, connector=Replaying(spec, rewind=4))
    reader.open(StartPosition.after(10))
    with pytest.raises(StreamError) as error:
        reader.read()
    message = str(error.value)
    assert "source 'clicks'" in message
    assert "opened after:10 (the committed offset)" in message
    assert "handed out offset 7, at or before it" in message


def test_a_message_out_of_stream_order_is_refused() -> None:
    spec = _spec()
    connector = Replaying(spec, rewind=0)
    guard = GuardedConnector(connector, get_backend("memory"), source="clicks")
    guard.open(StartPosition.after(10))
    assert [m.offset for m in guard.read(3, 0.1)] == [11, 12, 13]
    connector.at, connector.rewind = 14, 3  # the next read starts again at 12
    with pytest.raises(StreamError, match=r"handed out offset 12 after offset 13: out of stream"):
        guard.read(3, 0.1)


def test_a_good_reader_passes_through_the_guard() -> None:
    spec = _spec()
    with StreamReader(spec, COLUMNS) as reader:
        reader.open(StartPosition.after(15))
        assert reader.read().row_offsets() == [16, 17, 18, 19, 20]


def test_offset_keys_order_redis_ids_by_number() -> None:
    pytest.importorskip("redis")
    key = get_backend("redis").offset_key
    assert key("1700000000000-9") < key("1700000000000-10") < key("1700000000001-0")
    assert get_backend("memory").offset_key("10") > get_backend("memory").offset_key(9)
    with pytest.raises(ValueError):
        key("not-an-id")


def _stream_source(kind: str, **stream: str) -> StreamSource:
    spec = BatchSourceSpec(
        name="live",
        type="stream",
        window_s=60,
        stream=StreamSourceSpec(kind=kind, format="csv", columns=COLUMNS, **stream),
    )
    return StreamSource(spec, "s", 0, Path("."), "data.dataset.streams.s.sources[0]")


@pytest.mark.parametrize(
    ("kind", "offsets"),
    [
        ("memory", [0, *range(5, 125, 10), 125]),  # 13 splits: "after 95" sorts after "after 115"
        ("redis", ["0-0", *(f"1700000000000-{i}" for i in range(1, 14))]),  # -9 < -10 as numbers
    ],
)
def test_a_resumed_task_takes_its_splits_in_stream_order(kind: str, offsets: list) -> None:
    if kind == "redis":
        pytest.importorskip("redis")
        source = _stream_source("redis", url="redis://127.0.0.1:1", key="k")
    else:
        source = _stream_source("memory", url="memory://order", key="k")
    names = [
        split_name(a, b, 1 if kind == "redis" else (b - a)) for a, b in itertools.pairwise(offsets)
    ]
    task = Task(1_800_000_000, 0, "s", "live", 1_800_000_060)
    progress = Progress()
    progress.task_listed(task, sorted(names))  # the order a checkpoint's JSON gives
    progress = Progress.from_json(progress.to_json())
    source.attach(progress)
    assert [s.name for s in source.splits(task)] == names
    # Listed, read and trained (as the driver does), the task commits its last
    # message as the source's position.
    progress.task_listed(task, names)
    for name in names:
        code = progress.open_split(task, name)
        count = parse_split_name(name)[2]
        progress.split_ended(code, count)
        progress.record(np.arange(1, count + 1, dtype=np.int64) | (code << 32))
    assert progress.stream_offsets["s/live"]["offset"] == offsets[-1]


def test_a_resumed_task_whose_splits_do_not_chain_is_an_error() -> None:
    source = _stream_source("memory", url="memory://order", key="k")
    task = Task(1_800_000_000, 0, "s", "live", 1_800_000_060)
    progress = Progress()
    progress.task_listed(task, [split_name(0, 10, 10), split_name(20, 30, 10)])
    with pytest.raises(StreamError, match=r"split 'after 20 through 30 \(10 messages\)' does not"):
        source.attach(progress)
