"""Redis Streams (a real ``redis-server``) passes the conformance suite."""

from __future__ import annotations

import pytest

from estuary.config.streams import StreamSourceSpec
from estuary.data.streams import StreamError, StreamReader
from estuary.testing.streams import COLUMNS, StreamConformance, new_target, row, row_ids

from .conftest import Server


class TestRedisConformance(StreamConformance):
    kind = "redis"
    target_field = "key"

    @pytest.fixture
    def broker(self, redis_server: Server) -> Server:
        return redis_server

    @pytest.fixture
    def fresh_broker(self, fresh_redis: Server) -> Server:
        return fresh_redis


def test_an_entry_without_the_payload_field_is_a_bad_row(redis_server: Server) -> None:
    import redis

    key = new_target()
    client = redis.Redis(port=redis_server.port)
    ids = [
        client.xadd(key, {"data": row(0)}),
        client.xadd(key, {"other": b"x", "more": b"y"}),
        client.xadd(key, {"data": row(2)}),
    ]
    client.close()
    spec = StreamSourceSpec(
        kind="redis", url=redis_server.url, key=key, format="csv", columns=COLUMNS
    )
    with StreamReader(spec, COLUMNS).open() as reader:
        chunk = reader.read(timeout_s=0.5)
    assert row_ids(chunk) == [0, 2]
    (bad,) = chunk.bad_rows(chunk.raw.invalid)
    assert str(bad) == (
        f"source {key!r} offset {ids[1].decode()}: entry has no 'data' field (fields: more, other)"
    )


def test_an_unreachable_server_is_a_stream_error_after_the_timeout() -> None:
    spec = StreamSourceSpec(
        kind="redis", url="redis://127.0.0.1:1", key="x", reconnect_timeout_s=0.3
    )
    with pytest.raises(StreamError, match="unreachable"):
        StreamReader(spec, ["label"]).open()


def test_a_custom_payload_field(redis_server: Server) -> None:
    import redis

    key = new_target()
    client = redis.Redis(port=redis_server.port)
    client.xadd(key, {"row": row(5)})
    client.close()
    spec = StreamSourceSpec(
        kind="redis",
        url=redis_server.url,
        key=key,
        payload_field="row",
        format="csv",
        columns=COLUMNS,
    )
    with StreamReader(spec, COLUMNS).open() as reader:
        assert row_ids(reader.read(timeout_s=0.5)) == [5]


def test_entries_deleted_before_reading_are_warned_about(redis_server: Server) -> None:
    import redis

    from estuary.config.streams import StartPosition
    from estuary.data.errors import DataWarning
    from estuary.testing.streams import read_rows

    key = new_target()
    client = redis.Redis(port=redis_server.port)
    ids = [client.xadd(key, {"data": row(i)}).decode() for i in range(10)]
    client.xtrim(key, maxlen=5, approximate=False)  # deletes entries 0..4
    client.close()
    spec = StreamSourceSpec(
        kind="redis", url=redis_server.url, key=key, format="csv", columns=COLUMNS
    )
    reader = StreamReader(spec, COLUMNS)
    with pytest.warns(DataWarning, match=f"trimmed past {ids[1]}: entries before {ids[5]}"):
        reader.open(StartPosition.after(ids[1]))
    with reader:
        assert read_rows(reader, 5)[0] == [5, 6, 7, 8, 9]
    client = redis.Redis(port=redis_server.port)
    client.xdel(key, ids[7])
    client.close()
    with pytest.warns(DataWarning, match=f"entries after {ids[6]} \\(up to {ids[7]}\\) were"):
        StreamReader(spec, COLUMNS).open(StartPosition.after(ids[6])).close()


def test_a_key_that_is_not_a_stream_is_a_clear_error(redis_server: Server) -> None:
    import redis

    key = new_target()
    client = redis.Redis(port=redis_server.port)
    client.set(key, b"a string")
    client.close()
    spec = StreamSourceSpec(kind="redis", url=redis_server.url, key=key, start="latest")
    with pytest.raises(StreamError, match="WRONGTYPE"):
        StreamReader(spec, ["label"]).open()
