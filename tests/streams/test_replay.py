"""``estuary replay``: rows of a file into a stream at a rate.

Rates are checked with a fake clock (timing never decides a test); the end to
end runs against real servers assert the rows that arrived, not the time taken.
"""

from __future__ import annotations

import gzip
import uuid
from pathlib import Path

import pytest

from estuary.cli import main
from estuary.config.spec import SchemaSpec
from estuary.config.streams import StreamSourceSpec
from estuary.data.decode import RowDecoder
from estuary.data.errors import DataFileError
from estuary.data.streams import StreamReader, open_publisher
from estuary.data.streams.memory import memory_stream
from estuary.data.streams.replay import TokenBucket, file_rows, replay
from estuary.testing.streams import read_rows


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def criteo_line(i: int) -> str:
    """A Criteo row whose C1 is its row number (hex)."""
    dense = [str((i * 7 + j) % 50) if j % 3 else "" for j in range(13)]
    sparse = [f"{i:08x}", *(f"{(i * 31 + j) % 97:08x}" for j in range(25))]
    return "\t".join([str(i % 2), *dense, *sparse])


def write_criteo(path: Path, rows: int) -> Path:
    path.write_bytes(gzip.compress("".join(criteo_line(i) + "\n" for i in range(rows)).encode()))
    return path


def test_token_bucket_holds_the_rate() -> None:
    clock = FakeClock()
    bucket = TokenBucket(100.0, burst=10, clock=clock, sleep=clock.sleep)
    for _ in range(30):
        bucket.take(10)
    assert clock.now == pytest.approx(3.0)  # 300 tokens at 100/s, starting empty
    with pytest.raises(ValueError, match="cannot take 11"):
        bucket.take(11)


def test_token_bucket_lets_a_slow_caller_use_the_saved_burst() -> None:
    clock = FakeClock()
    bucket = TokenBucket(100.0, burst=10, clock=clock, sleep=clock.sleep)
    clock.now += 5.0  # the caller was busy: at most `burst` tokens were saved
    bucket.take(10)
    assert clock.slept == []
    bucket.take(10)
    assert sum(clock.slept) == pytest.approx(0.1)


def test_replay_publishes_every_row_at_the_rate(tmp_path: Path) -> None:
    path = write_criteo(tmp_path / "day.tsv.gz", 250)
    clock = FakeClock()
    key = uuid.uuid4().hex
    publisher = open_publisher(f"memory://replay/{key}")
    report = replay(path, publisher, 100.0, clock=clock, sleep=clock.sleep)
    assert report.rows == 250
    assert report.rows_per_s == pytest.approx(100.0)
    stream = memory_stream("memory://replay", key)
    assert [p.decode() for _, p, _ in stream.entries] == [criteo_line(i) for i in range(250)]


def test_replay_stops_at_the_limit_and_unlimited_rate_does_not_wait(tmp_path: Path) -> None:
    path = write_criteo(tmp_path / "day.tsv.gz", 50)
    clock = FakeClock()
    report = replay(
        path, open_publisher("memory://replay/lim"), 0, limit=20, clock=clock, sleep=clock.sleep
    )
    assert (report.rows, clock.slept) == (20, [])


def test_file_rows_skip_the_csv_header_and_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "rows.csv"
    path.write_bytes(b"label,I1\r\n1,2\r\n\r\n0,3\n\n1,4")
    header, rows = file_rows(path, "csv")
    assert header == "label,I1"
    assert list(rows) == [b"1,2", b"0,3", b"1,4"]


def test_replay_refuses_formats_without_lines_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(DataFileError, match="not 'parquet'"):
        file_rows(tmp_path / "x.parquet", "parquet")
    with pytest.raises(DataFileError, match="file not found"):
        list(file_rows(tmp_path / "missing.tsv", "criteo_tsv")[1])


@pytest.mark.parametrize("kind", ["nats", "redis"])
def test_replay_cli_end_to_end(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = request.getfixturevalue(f"{kind}_server")
    path = write_criteo(tmp_path / "day.tsv.gz", 300)
    target = f"replay{uuid.uuid4().hex[:8]}"
    argv = ["replay", str(path), "--to", f"{server.url}/{target}", "--rate", "4000"]
    assert main([*argv, "--limit", "250"]) == 0
    assert "replayed 250 rows" in capsys.readouterr().out

    field = "subject" if kind == "nats" else "key"
    spec = StreamSourceSpec(kind=kind, url=server.url, poll_timeout_s=0.05, **{field: target})  # type: ignore[arg-type]
    decoder = RowDecoder(SchemaSpec(dense=["I1", "I2"], sparse=["C1", "C2"]))
    with StreamReader(spec, ["C1", *decoder.columns]).open() as reader:
        chunk = reader.read(max_messages=1000, timeout_s=1.0)
        rest, _ = read_rows(reader, 250 - chunk.num_rows)
    assert chunk.num_rows + len(rest) == 250
    expected = [f"{i:08x}".encode() for i in range(chunk.num_rows)]
    assert chunk.raw.columns["C1"].to_pylist() == expected
    decoded = decoder.decode(chunk.raw, max_examples=5)
    assert decoded.bad_count == 0 and decoded.labels.shape[0] == chunk.num_rows


def test_replay_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_criteo(tmp_path / "day.tsv.gz", 3)
    assert main(["replay", str(path), "--to", "nats://127.0.0.1:1", "--rate", "1"]) == 2
    assert "error: --to: 'nats://127.0.0.1:1' names no subject or key" in capsys.readouterr().err
    assert main(["replay", str(path), "--to", "kafka://h:1/x", "--rate", "1"]) == 2
    assert "stream kind 'kafka' is unknown" in capsys.readouterr().err
