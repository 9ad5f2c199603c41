"""One conformance suite for ``StreamConnector``: every backend subclasses it.

    from estuary.testing.streams import StreamConformance

    class TestKafkaConformance(StreamConformance):
        kind = "kafka"              # the registered backend name
        target_field = "topic"      # the StreamSourceSpec field naming the target

        @pytest.fixture
        def broker(self): ...       # .url, .kill(), .start()

        @pytest.fixture
        def fresh_broker(self): ... # one the test may SIGKILL and restart

A subclass sets ``kind`` and ``target_field`` and provides two fixtures:
``broker`` (shared by the tests of a session) and ``fresh_broker`` (its own,
for the tests that SIGKILL and restart it). Rows carry their id in the first
column (``row_id,label,I1,C1``), so every test checks row accounting: the ids
read back are exactly the ids published, in order, none twice.
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import pytest

from estuary.config.spec import SchemaSpec
from estuary.config.streams import StartPosition, StreamSourceSpec
from estuary.data.decode import RowDecoder
from estuary.data.streams import (
    Offset,
    StreamChunk,
    StreamError,
    StreamReader,
    get_backend,
    open_publisher,
)

COLUMNS = ["row_id", "label", "I1", "C1"]
SCHEMA = SchemaSpec(label="label", dense=["I1"], sparse=["C1"])
READ_DEADLINE_S = 20.0


class Broker(Protocol):
    url: str

    def kill(self) -> None: ...

    def start(self) -> None: ...


def row(i: int) -> bytes:
    """Row ``i``: ``row_id,label,I1,C1``."""
    return f"{i},{i % 2},{i % 10},c{i % 7}".encode()


def row_ids(chunk: StreamChunk) -> list[int]:
    return [int(v) for v in chunk.raw.columns["row_id"].to_pylist()]


def read_rows(reader: StreamReader, count: int, **read: Any) -> tuple[list[int], list[Offset]]:
    """Read until ``count`` rows came (or the deadline): (row ids, their offsets)."""
    ids: list[int] = []
    offsets: list[Offset] = []
    deadline = time.monotonic() + READ_DEADLINE_S
    while len(ids) < count and time.monotonic() < deadline:
        chunk = reader.read(**read)
        ids += row_ids(chunk)
        offsets += chunk.row_offsets()
    return ids, offsets


def new_target() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


class StreamConformance:
    kind: ClassVar[str]
    target_field: ClassVar[str]  # "subject" (nats) or "key"
    restartable: ClassVar[bool] = True

    # -- helpers -----------------------------------------------------------------------

    def spec(self, broker: Broker, target: str, **changes: Any) -> StreamSourceSpec:
        fields: dict[str, Any] = {
            "kind": self.kind,
            "url": broker.url,
            self.target_field: target,
            "format": "csv",
            "columns": COLUMNS,
            "batch_max_messages": 64,
            "poll_timeout_s": 0.05,
            "reconnect_timeout_s": 20.0,
        }
        fields.update(changes)
        return StreamSourceSpec(**fields)

    def publish(self, broker: Broker, target: str, payloads: Sequence[bytes]) -> list[Offset]:
        publisher = open_publisher(f"{broker.url}/{target}")
        try:
            return publisher.publish(payloads)
        finally:
            publisher.close()

    def publish_rows(self, broker: Broker, target: str, ids: Sequence[int]) -> list[Offset]:
        return self.publish(broker, target, [row(i) for i in ids])

    def reader(
        self, broker: Broker, target: str, start: StartPosition | None = None, **changes: Any
    ) -> StreamReader:
        return StreamReader(self.spec(broker, target, **changes), COLUMNS).open(start)

    # -- reading in order --------------------------------------------------------------

    def test_reads_published_rows_in_order_with_their_offsets(self, broker: Broker) -> None:
        target = new_target()
        published = self.publish_rows(broker, target, range(150))
        published += self.publish_rows(broker, target, range(150, 200))
        with self.reader(broker, target) as reader:
            ids, offsets = read_rows(reader, 200)
            assert ids == list(range(200))
            assert offsets == published
            assert reader.position() == published[-1]
            assert reader.read(timeout_s=0.05).num_messages == 0  # nothing more

    def test_chunks_carry_broker_timestamps_and_their_position(self, broker: Broker) -> None:
        target = new_target()
        before_ms = int(time.time() * 1000) - 1000
        published = self.publish_rows(broker, target, range(10))
        with self.reader(broker, target) as reader:
            chunk = reader.read(max_messages=4)
            assert chunk.offsets == published[:4]
            assert chunk.position == published[3]
            assert (chunk.timestamps_ms >= before_ms).all()
            assert (chunk.timestamps_ms <= int(time.time() * 1000) + 1000).all()

    def test_empty_stream_read_returns_nothing(self, broker: Broker) -> None:
        target = new_target()
        self.publish(broker, target, [])  # nats: creates the stream
        with self.reader(broker, target) as reader:
            start = reader.position()
            chunk = reader.read(timeout_s=0.05)
            assert chunk.num_messages == 0 and chunk.position == start

    # -- start positions ---------------------------------------------------------------

    def test_start_latest_reads_only_what_comes_after_opening(self, broker: Broker) -> None:
        target = new_target()
        old = self.publish_rows(broker, target, range(10))
        with self.reader(broker, target, StartPosition.latest()) as reader:
            assert reader.position() == old[-1]
            assert reader.read(timeout_s=0.05).num_messages == 0
            self.publish_rows(broker, target, range(10, 15))
            assert read_rows(reader, 5)[0] == list(range(10, 15))

    def test_start_at_a_time_begins_at_the_first_message_stored_then(self, broker: Broker) -> None:
        target = new_target()
        self.publish_rows(broker, target, range(10))
        time.sleep(0.05)  # broker clocks are in ms: leave a clear gap either side
        start = StartPosition.at_time(int(time.time() * 1000))
        time.sleep(0.05)
        self.publish_rows(broker, target, range(10, 20))
        with self.reader(broker, target, start) as reader:
            assert read_rows(reader, 10)[0] == list(range(10, 20))

    def test_start_after_a_checkpointed_offset_resumes_exactly(self, broker: Broker) -> None:
        target = new_target()
        published = self.publish_rows(broker, target, range(50))
        with self.reader(broker, target) as reader:
            first = reader.read(max_messages=20)
            saved = json.dumps({"position": first.position})  # goes into the checkpoint
        position = json.loads(saved)["position"]
        assert position == published[19]
        with self.reader(broker, target, StartPosition.after(position)) as reader:
            ids, offsets = read_rows(reader, 30)
        assert row_ids(first) + ids == list(range(50))
        assert offsets == published[20:]

    def test_start_after_from_the_job_file_text(self, broker: Broker) -> None:
        target = new_target()
        published = self.publish_rows(broker, target, range(5))
        spec = self.spec(broker, target, start=f"after:{published[2]}")
        with StreamReader(spec, COLUMNS).open() as reader:
            assert read_rows(reader, 2)[0] == [3, 4]

    def test_a_bad_offset_is_refused(self, broker: Broker) -> None:
        backend = get_backend(self.kind)
        with pytest.raises(ValueError):
            backend.parse_offset("not-an-offset")
        target = new_target()
        self.publish_rows(broker, target, range(1))
        reader = StreamReader(self.spec(broker, target), COLUMNS)
        with pytest.raises(StreamError, match=r"offset|sequence|id"):
            reader.open(StartPosition.after("nonsense"))
        reader.close()

    # -- checkpoints -------------------------------------------------------------------

    def test_commit_records_what_was_read_and_refuses_more(self, broker: Broker) -> None:
        target = new_target()
        published = self.publish_rows(broker, target, range(10))
        with self.reader(broker, target) as reader:
            assert reader.connector.committed() is None
            chunk = reader.read(max_messages=5)
            reader.commit(chunk.position)
            assert reader.connector.committed() == published[4]
            with pytest.raises(StreamError, match="commit"):
                reader.commit(published[7])

    @pytest.mark.parametrize("seed", [0, 1, 2])
    def test_crash_and_resume_from_checkpoints_loses_and_repeats_nothing(
        self, broker: Broker, seed: int
    ) -> None:
        """A consumer crashes at seeded random points while a producer publishes;
        each restart resumes after the last saved position. The rows recorded by
        the checkpoints are exactly the rows published, once each, in order."""
        rng = random.Random(seed)
        target, total = new_target(), 300
        self.publish(broker, target, [])

        def produce() -> None:
            for begin in range(0, total, 25):
                self.publish_rows(broker, target, range(begin, begin + 25))
                time.sleep(0.005)

        producer = threading.Thread(target=produce)
        producer.start()
        checkpoint = json.dumps({"position": None, "rows": []})
        reader = self.reader(broker, target, batch_max_messages=rng.randint(7, 40))
        since: list[int] = []  # rows trained since the last checkpoint
        crashes = 0
        deadline = time.monotonic() + READ_DEADLINE_S
        try:
            while len(json.loads(checkpoint)["rows"]) < total and time.monotonic() < deadline:
                chunk = reader.read()
                since += row_ids(chunk)
                if rng.random() < 0.3:  # save model + rows + position together
                    saved = json.loads(checkpoint)
                    checkpoint = json.dumps(
                        {"position": chunk.position, "rows": saved["rows"] + since}
                    )
                    reader.commit(chunk.position)
                    since = []
                elif rng.random() < 0.2:  # crash: the work since the checkpoint is lost
                    reader.close()
                    crashes += 1
                    since = []
                    position = json.loads(checkpoint)["position"]
                    start = None if position is None else StartPosition.after(position)
                    reader = self.reader(broker, target, start)
        finally:
            reader.close()
            producer.join()
        assert crashes > 0
        assert json.loads(checkpoint)["rows"] == list(range(total))

    # -- faults ------------------------------------------------------------------------

    def test_server_restart_mid_read_loses_and_repeats_nothing(self, fresh_broker: Broker) -> None:
        if not self.restartable:
            pytest.skip(f"{self.kind}: no server process to restart")
        target = new_target()
        published = self.publish_rows(fresh_broker, target, range(300))
        reader = self.reader(fresh_broker, target, batch_max_messages=50)
        try:
            ids, offsets = read_rows(reader, 100)
            assert len(ids) == 100
            fresh_broker.kill()  # SIGKILL
            restart = threading.Timer(0.3, fresh_broker.start)
            restart.start()  # reads below retry while the server is down
            try:
                more, more_offsets = read_rows(reader, 200)
            finally:
                restart.join()
            published += self.publish_rows(fresh_broker, target, range(300, 350))
            rest, rest_offsets = read_rows(reader, 50)
        finally:
            reader.close()
        assert ids + more + rest == list(range(350))
        assert offsets + more_offsets + rest_offsets == published

    # -- bad messages ------------------------------------------------------------------

    def test_malformed_messages_are_counted_bad_rows_with_their_offsets(
        self, broker: Broker
    ) -> None:
        target = new_target()
        payloads = [
            row(0),
            b"1,x",  # too few fields
            b"\xff\xfe",  # not text, one field
            b"",  # empty
            row(4),
            b"5,1,notanumber,c",  # the decoder rejects I1
            b"6,2,1,c",  # label 2
            row(7) + b"\n",  # a trailing newline is fine
        ]
        offsets = self.publish(broker, target, payloads)
        decoder = RowDecoder(SCHEMA)
        with self.reader(broker, target) as reader:
            chunk = reader.read()
        assert chunk.num_messages == 8 and chunk.raw.rows_read == 8
        assert row_ids(chunk) == [0, 4, 5, 6, 7]
        decoded = decoder.decode(chunk.raw, max_examples=10)
        assert (decoded.rows_read, decoded.bad_count, decoded.labels.shape[0]) == (8, 5, 3)
        bad = [str(b) for b in chunk.bad_rows(decoded.bad_examples)]
        where = [f"source {target!r} offset {offsets[i]}: " for i in (1, 2, 3, 5, 6)]
        assert bad == [
            where[0] + "expected 4 fields, found 2",
            where[1] + "expected 4 fields, found 1",
            where[2] + "empty message",
            where[3] + "field I1: 'notanumber' is not a number",
            where[4] + "field label: '2' is not 0 or 1",
        ]
