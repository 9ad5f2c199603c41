"""``StreamSourceSpec`` and ``StartPosition``: valid specs load, mistakes name the field."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from estuary.config.errors import ConfigError
from estuary.config.loader import to_dict
from estuary.config.streams import StartPosition, StreamSourceSpec, stream_source_from_dict

NATS = {"kind": "nats", "url": "nats://127.0.0.1:4222", "subject": "clicks"}
REDIS = {"kind": "redis", "url": "redis://127.0.0.1:6379/0", "key": "clicks"}


def test_a_nats_source_loads_with_defaults() -> None:
    spec = stream_source_from_dict(NATS)
    assert (spec.format, spec.start, spec.batch_max_messages) == ("criteo_tsv", "earliest", 1024)
    assert spec.display_name == "clicks"
    assert spec.start_position == StartPosition.earliest()
    assert stream_source_from_dict(to_dict(spec)) == spec  # round trip


def test_a_redis_csv_source_with_every_field() -> None:
    spec = stream_source_from_dict(
        {
            **REDIS,
            "payload_field": "row",
            "name": "clicks-eu",
            "format": "csv",
            "columns": ["label", "I1"],
            "start": "after:1700000000000-3",
            "batch_max_messages": 10,
            "poll_timeout_s": 0,
            "reconnect_timeout_s": 5,
        }
    )
    assert spec.display_name == "clicks-eu"
    assert spec.start_position == StartPosition.after("1700000000000-3")
    assert spec.poll_timeout_s == 0.0


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"url": "redis://h:1"}, r"^stream\.url: expected a nats:// URL for kind 'nats'"),
        ({"subject": None}, r"^stream\.subject: kind 'nats' needs subject"),
        (
            {"key": "k"},
            r"^stream\.key: not a field of stream kind 'nats' \(its fields: subject, stream\)$",
        ),
        ({"subject": ""}, r"^stream\.subject: must not be empty"),
        ({"format": "csv"}, r"^stream\.columns: format 'csv' needs the message's column names"),
        ({"format": "jsonl", "columns": ["a"]}, r"^stream\.columns: not used by format 'jsonl'"),
        ({"columns": ["a", "b", "a"]}, r"^stream\.columns: duplicate column names \['a'\]"),
        ({"start": "yesterday"}, r"^stream\.start: expected earliest, latest, an ISO 8601"),
        ({"start": "after:"}, r"^stream\.start: 'after:' needs an offset"),
        ({"batch_max_messages": 0}, r"^stream\.batch_max_messages: must be >= 1"),
        ({"poll_timeout_s": -1}, r"^stream\.poll_timeout_s: must be >= 0"),
        ({"reconnect_timeout_s": 0}, r"^stream\.reconnect_timeout_s: must be > 0"),
        ({"kind": "kafka"}, r"^stream\.kind: must be one of 'nats', 'redis', 'memory'"),
        ({"subjct": "x"}, r"^stream\.subjct: unknown key \(did you mean 'subject'\?\)"),
        ({"poll_timeout_s": "1s"}, r"^stream\.poll_timeout_s: expected float, got str"),
    ],
)
def test_mistakes_name_the_field(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        stream_source_from_dict({**NATS, **changes})


def test_redis_refuses_nats_fields() -> None:
    with pytest.raises(
        ConfigError,
        match=r"^s\.subject: not a field of stream kind 'redis' \(its fields: key, payload_fi",
    ):
        stream_source_from_dict({**REDIS, "subject": "x"}, "s")


def test_a_spec_built_in_code_is_validated_by_the_reader() -> None:
    from estuary.data.streams import StreamReader

    spec = StreamSourceSpec(kind="redis", url="redis://h:1")  # no key
    with pytest.raises(ConfigError, match=r"^stream\.key: kind 'redis' needs key"):
        StreamReader(spec, ["label"])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("earliest", StartPosition.earliest()),
        ("latest", StartPosition.latest()),
        ("after:1234", StartPosition.after(1234)),
        ("after:1700000000000-0", StartPosition.after("1700000000000-0")),
        (
            "2026-01-31T08:00:00Z",
            StartPosition.at_time(datetime(2026, 1, 31, 8, tzinfo=UTC)),
        ),
        ("2026-01-31T08:00:00", StartPosition.at_time(datetime(2026, 1, 31, 8, tzinfo=UTC))),
        ("2026-01-31T09:00:00+01:00", StartPosition.at_time(1769846400000)),
    ],
)
def test_start_positions_parse_and_print_back(text: str, expected: StartPosition) -> None:
    position = StartPosition.parse(text)
    assert position == expected
    assert StartPosition.parse(str(position)) == position


def test_start_position_fields_must_match_the_kind() -> None:
    with pytest.raises(ValueError, match="timestamp_ms"):
        StartPosition("timestamp")
    with pytest.raises(ValueError, match="offset"):
        StartPosition("earliest", offset=3)


def test_the_built_in_fields_still_read_as_attributes() -> None:
    nats = stream_source_from_dict({"kind": "nats", "url": "nats://h:1", "subject": "x"}, "s")
    redis = stream_source_from_dict({"kind": "redis", "url": "redis://h:1/0", "key": "k"}, "s")
    assert (nats.subject, nats.stream, nats.key) == ("x", None, None)
    assert (redis.key, redis.payload_field, redis.subject) == ("k", None, None)
    assert nats.section.subject == "x" and redis.section.key == "k"
