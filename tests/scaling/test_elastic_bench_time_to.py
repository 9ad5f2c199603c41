"""``bench/elastic.py``'s time to 90%: a trailing window over rows per second,
so two policies are told apart by the second, not by the 3-s scaling interval."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("ray", reason="bench/elastic.py runs on Ray")

BENCH = Path(__file__).resolve().parents[2] / "bench" / "elastic.py"


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_elastic", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_time_to_is_the_end_of_the_first_trailing_window_at_the_target() -> None:
    time_to = load_bench().time_to
    per_second = [100, 100, 900, 1000, 1000, 1000]
    assert time_to(per_second, 900, 1) == 3  # second [2, 3) alone reaches it
    assert time_to(per_second, 900, 3) == 5  # [2, 5): 966; [1, 4): 666
    assert time_to(per_second, 1001, 1) is None
    assert time_to([], 1, 3) is None
