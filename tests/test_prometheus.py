"""The Prometheus exporter: text exposition format 0.0.4 (checked by a strict
little parser below), label and help escaping, thread-safe updates, the HTTP
endpoint (``/metrics``, 404 elsewhere) and a port released on stop."""

from __future__ import annotations

import math
import re
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from estuary.config import ConfigError, load_job
from estuary.metrics.prometheus import CONTENT_TYPE, MetricsServer, Registry, format_value
from estuary.metrics.training import TrainingMetrics

Sample = tuple[str, tuple[tuple[str, str], ...]]  # (name, ((label, value), ...))

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(rf"(?P<name>{_NAME})(?:\{{(?P<labels>.*)\}})? (?P<value>\S+)\Z")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')
_HELP_TEXT = re.compile(r"(?:[^\\\n]|\\[\\n])*\Z")
_UNESCAPE = {"\\": "\\", '"': '"', "n": "\n"}


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", lambda m: _UNESCAPE[m.group(1)], text)


def _value(text: str) -> float:
    special = {"NaN": math.nan, "+Inf": math.inf, "-Inf": -math.inf}
    if text in special:
        return special[text]
    assert re.fullmatch(r"-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?", text), text
    return float(text)


def parse_exposition(text: str) -> tuple[dict[str, str], dict[str, str], dict[Sample, float]]:
    """(types, helps, samples) of a text-format 0.0.4 page; asserts every line's
    shape: HELP and TYPE once per family and before its samples, label pairs
    quoted and escaped, one sample per name and label set."""
    assert text.endswith("\n")
    types: dict[str, str] = {}
    helps: dict[str, str] = {}
    samples: dict[Sample, float] = {}
    for line in text[:-1].split("\n"):
        if line.startswith("# HELP "):
            name, _, doc = line[len("# HELP ") :].partition(" ")
            assert re.fullmatch(_NAME, name) and name not in helps, line
            assert _HELP_TEXT.match(doc), line
            helps[name] = _unescape(doc)
        elif line.startswith("# TYPE "):
            name, kind = line[len("# TYPE ") :].split(" ")
            assert name not in types and kind in ("counter", "gauge"), line
            assert not any(n == name for n, _ in samples), f"TYPE after samples: {line}"
            types[name] = kind
        else:
            match = _SAMPLE.match(line)
            assert match, f"not a sample line: {line!r}"
            name, raw = match["name"], match["labels"]
            assert name in types, f"sample before its TYPE: {line}"
            labels: list[tuple[str, str]] = []
            if raw is not None:
                pos = 0
                while pos < len(raw):
                    pair = _LABEL.match(raw, pos)
                    assert pair, f"bad labels at {raw[pos:]!r}: {line}"
                    labels.append((pair[1], _unescape(pair[2])))
                    pos = pair.end()
                    if pos < len(raw):
                        assert raw[pos] == ",", line
                        pos += 1
            key = (name, tuple(labels))
            assert key not in samples, f"duplicate sample: {line}"
            samples[key] = _value(match["value"])
    return types, helps, samples


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.headers["Content-Type"] == CONTENT_TYPE
        return str(response.read().decode("utf-8"))


def test_exposition_text_parses_with_help_type_and_samples() -> None:
    registry = Registry()
    steps = registry.counter("app_steps_total", "Steps taken.")
    rows = registry.gauge("app_rows", "Rows per table.", labels=("table",))
    registry.gauge("app_never_set", "Absent until set.")
    steps.inc()
    steps.inc(4)
    rows.set(12, table="a")
    rows.set(0.5, table="b")
    types, helps, samples = parse_exposition(registry.render())
    assert types == {"app_steps_total": "counter", "app_rows": "gauge", "app_never_set": "gauge"}
    assert helps["app_rows"] == "Rows per table."
    assert samples == {
        ("app_steps_total", ()): 5,
        ("app_rows", (("table", "a"),)): 12,
        ("app_rows", (("table", "b"),)): 0.5,
    }


def test_label_values_and_help_text_are_escaped() -> None:
    registry = Registry()
    nasty = 'quote " backslash \\ newline \n brace } comma ,'
    gauge = registry.gauge("app_x", "Help with \\ and\na newline.", labels=("table", "job"))
    gauge.set(1, table=nasty, job="")
    text = registry.render()
    assert '\\"' in text and "\\\\" in text and "\\n" in text
    assert text.count("\n") == 3  # HELP, TYPE, one sample: no raw newline leaked
    _, helps, samples = parse_exposition(text)
    assert helps["app_x"] == "Help with \\ and\na newline."
    assert samples == {("app_x", (("table", nasty), ("job", ""))): 1}


def test_values_render_as_prometheus_numbers() -> None:
    assert format_value(3) == "3" and format_value(3.0) == "3" and format_value(-2.0) == "-2"
    assert format_value(0.25) == "0.25" and float(format_value(1e-9)) == 1e-9
    assert (format_value(math.nan), format_value(math.inf), format_value(-math.inf)) == (
        "NaN",
        "+Inf",
        "-Inf",
    )
    registry = Registry()
    registry.gauge("app_auc", "AUC.").set(math.nan)
    _, _, samples = parse_exposition(registry.render())
    assert math.isnan(samples[("app_auc", ())])


def test_bad_names_labels_and_decrements_are_rejected() -> None:
    registry = Registry()
    with pytest.raises(ValueError, match="invalid metric name"):
        registry.gauge("2bad", "x")
    with pytest.raises(ValueError, match="invalid label name"):
        registry.gauge("app_a", "x", labels=("__reserved",))
    counter = registry.counter("app_b_total", "x", labels=("table",))
    with pytest.raises(ValueError, match="already registered"):
        registry.gauge("app_b_total", "x")
    with pytest.raises(ValueError, match="expected labels"):
        counter.inc(table="t", extra="u")
    with pytest.raises(ValueError, match="cannot decrease"):
        counter.inc(-1, table="t")


def test_concurrent_updates_lose_nothing_while_scraped() -> None:
    registry = Registry()
    counter = registry.counter("app_total", "x", labels=("worker",))
    per_thread, workers = 2000, 4

    def work(worker: int) -> None:
        for _ in range(per_thread):
            counter.inc(worker=worker)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
    for thread in threads:
        thread.start()
    while any(t.is_alive() for t in threads):
        parse_exposition(registry.render())  # consistent pages mid-update
    for thread in threads:
        thread.join()
    _, _, samples = parse_exposition(registry.render())
    assert [samples[("app_total", (("worker", str(w)),))] for w in range(workers)] == [
        per_thread
    ] * workers


def test_server_serves_metrics_404s_elsewhere_and_releases_its_port() -> None:
    registry = Registry()
    registry.counter("app_total", "x").inc(7)
    server = MetricsServer(registry, host="127.0.0.1", port=0).start()
    port = server.port
    assert port and server.url == f"http://127.0.0.1:{port}/metrics"
    _, _, samples = parse_exposition(scrape(f"{server.url}?x=1"))
    assert samples[("app_total", ())] == 7
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5)
    assert info.value.code == 404
    server.stop()
    server.stop()  # idempotent
    assert server.port is None
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2)
    with socket.socket() as again:  # the port is free to bind again
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))


def test_training_metrics_are_off_without_a_port() -> None:
    metrics = TrainingMetrics(port=None)
    with metrics.serving():
        assert metrics.server is None and metrics.url is None
        assert metrics.step(1, 64, 0.5) is False
    assert metrics.rows.value() == 0


def test_training_metrics_on_a_taken_port_is_a_config_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        metrics = TrainingMetrics(port=taken.getsockname()[1])
        with pytest.raises(ConfigError) as info, metrics.serving():
            pass
    assert info.value.path == "output.metrics_port"


def test_nested_serving_shares_one_server() -> None:
    metrics = TrainingMetrics(port=0)
    with metrics.serving():
        url = metrics.url
        with metrics.serving():
            assert metrics.url == url
        assert metrics.url == url  # the inner block leaves it serving
    assert metrics.url is None


JOB = """\
data:
  sources: [{path: day0.tsv}]
  schema: {dense: [I1], sparse: [C1]}
"""


def test_metrics_fields_default_off_and_validate(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(JOB)
    output = load_job(path).output
    assert output.metrics_port is None and output.metrics_host == "127.0.0.1"
    assert load_job(path, ["output.metrics_port=0"]).output.metrics_port == 0
    for override, fragment in [
        ("output.metrics_port=70000", "[0, 65535]"),
        ("output.metrics_port=-1", "[0, 65535]"),
        ("output.metrics_port=abc", "int"),
        ("output.metrics_host=' '", "empty"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_job(path, [override])
        assert info.value.path.startswith(override.split("=")[0]), info.value
        assert fragment in str(info.value)
