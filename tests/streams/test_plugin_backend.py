"""A stream backend that is not built in declares its own section's fields: a job
file names it with them and trains, and a stream section's fields are checked
against the named backend's declaration, for the built-ins and the plugin."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from estuary import plugins
from estuary.config import ConfigError, job_from_dict, load_job
from estuary.config.streams import MemorySection, StreamSourceSpec
from estuary.data.streams import register_backend
from estuary.data.streams.memory import MemoryBackend, MemoryConnector, memory_stream
from estuary.train import Trainer

from .test_dataset_stream import rows, stream_job


@dataclass(frozen=True)
class TaggedSection(MemorySection):
    """The memory backend's ``key`` and a field of its own."""

    tag: str
    replicas: int = 1

    def validate(self, path: str) -> None:
        super().validate(path)
        if self.replicas < 1:
            raise ConfigError(f"{path}.replicas", "must be >= 1")


SEEN: list[tuple[str, str, int]] = []


class TaggedConnector(MemoryConnector):
    kind = "tagged"

    def __init__(self, spec: StreamSourceSpec) -> None:
        super().__init__(spec)
        section: TaggedSection = spec.section
        SEEN.append((section.key, section.tag, section.replicas))


class TaggedBackend(MemoryBackend):
    """An in-process backend registered in Python, its fields on ``section``."""

    name = "tagged"
    section = TaggedSection

    def connector(self, spec: StreamSourceSpec) -> TaggedConnector:
        return TaggedConnector(spec)


@pytest.fixture
def tagged() -> Iterator[None]:
    register_backend(TaggedBackend())
    try:
        yield
    finally:
        plugins.STREAM_BACKENDS.unregister("tagged")
        SEEN.clear()


@pytest.mark.usefixtures("tagged")
def test_a_plugin_backend_named_in_a_job_file_reads_its_own_fields_and_trains(
    tmp_path: Path,
) -> None:
    url = "tagged://plugin-train"
    payloads, good = rows(120)
    memory_stream(url, "clicks").append(payloads)
    stream = {"kind": "tagged", "url": url, "key": "clicks", "tag": "eu", "replicas": 2}
    job = load_job(stream_job(tmp_path, "tagged", stream, seed=0))
    spec = job.data.dataset.streams["s"].sources[0].stream  # type: ignore[union-attr]
    assert spec is not None and spec.section == TaggedSection("clicks", "eu", 2)
    assert spec.display_name == "clicks"  # its first own field, as for memory

    result = Trainer(job).fit(progress=False)
    assert result.train_rows == len(good)
    assert SEEN and set(SEEN) == {("clicks", "eu", 2)}  # the fields reached the connector


def live_job(stream: dict[str, Any]) -> dict[str, Any]:
    source = {"name": "live", "type": "stream", "window_s": 60, "stream": stream}
    schema = {"dense": ["I1"], "sparse": ["C1"]}
    columns = ["label", "I1", "C1"]
    stream.update(format="csv", columns=columns)
    return {"data": {"schema": schema, "dataset": {"streams": {"live": {"sources": [source]}}}}}


WHERE = "data.dataset.streams.live.sources[0].stream"
NATS = {"kind": "nats", "url": "nats://127.0.0.1:4222", "subject": "clicks"}
REDIS = {"kind": "redis", "url": "redis://127.0.0.1:6379/0", "key": "clicks"}
TAGGED = {"kind": "tagged", "url": "tagged://h", "key": "clicks", "tag": "eu"}


@pytest.mark.usefixtures("tagged")
@pytest.mark.parametrize(
    ("stream", "message"),
    [
        (
            {**NATS, "key": "x"},
            "key: not a field of stream kind 'nats' (its fields: subject, stream)",
        ),
        (
            {**NATS, "payload_field": "row"},
            "payload_field: not a field of stream kind 'nats' (its fields: subject, stream)",
        ),
        (
            {**REDIS, "stream": "x"},
            "stream: not a field of stream kind 'redis' (its fields: key, payload_field)",
        ),
        (
            {**REDIS, "topic": "x"},
            "topic: not a field of stream kind 'redis' (its fields: key, payload_field)",
        ),
        (
            {**TAGGED, "subject": "x"},
            "subject: not a field of stream kind 'tagged' (its fields: key, tag, replicas)",
        ),
        ({**TAGGED, "tag": None}, "tag: expected str, got null"),
        ({k: v for k, v in TAGGED.items() if k != "tag"}, "tag: kind 'tagged' needs tag"),
        ({**TAGGED, "replicas": "two"}, "replicas: expected int, got str 'two'"),
        ({**TAGGED, "replicas": 0}, "replicas: must be >= 1"),
        ({**TAGGED, "tga": "eu"}, "tga: unknown key (did you mean 'tag'?)"),
    ],
)
def test_a_stream_field_is_checked_against_the_named_backends_own(
    stream: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        job_from_dict(live_job(stream))
    assert str(err.value) == f"{WHERE}.{message}"


@pytest.mark.usefixtures("tagged")
def test_the_stream_sections_round_trip_and_keep_their_keys() -> None:
    from estuary.config import to_dict

    for stream in (NATS, REDIS, TAGGED):
        job = job_from_dict(live_job(dict(stream)))
        again = job_from_dict(to_dict(job))
        assert again.data == job.data
        written = to_dict(job)["data"]["dataset"]["streams"]["live"]["sources"][0]["stream"]
        # The former flat fields are written as before (null when unset), then the rest.
        assert list(written)[:6] == ["kind", "url", "subject", "stream", "key", "payload_field"]
        assert all(written[key] == value for key, value in stream.items())
    spec = StreamSourceSpec(kind="nats", url="nats://h:1", subject="clicks", key=None)
    assert spec == StreamSourceSpec(kind="nats", url="nats://h:1", options={"subject": "clicks"})
