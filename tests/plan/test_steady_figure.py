"""bench/simulate_real.py's validation figure: rows/s after the first epoch."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _simulate_real() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "simulate_real", ROOT / "bench" / "simulate_real.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(path: Path, samples: list[tuple[float, int]]) -> None:
    lines = [{"kind": "start", "time": 0.0, "step": 0}]
    lines += [{"kind": "sample", "time": t, "rows": r} for t, r in samples]
    lines.append({"kind": "end", "time": samples[-1][0] + 5.0})
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def test_the_first_epoch_is_left_out(tmp_path: Path) -> None:
    # 1000 rows an epoch; the first epoch takes 3 s (warm-up), then 1000 rows/s.
    path = tmp_path / "timeseries.jsonl"
    _write(path, [(1.0, 200), (3.0, 1000), (3.5, 1500), (4.0, 2000), (5.0, 3000)])
    assert _simulate_real().steady_window(path, 1000)[0] == 1000.0


def test_too_few_samples_after_the_first_epoch_give_none(tmp_path: Path) -> None:
    path = tmp_path / "timeseries.jsonl"
    _write(path, [(1.0, 200), (2.0, 600), (3.0, 1000)])
    assert _simulate_real().steady_window(path, 1000) is None


def test_the_window_reports_its_seconds(tmp_path: Path) -> None:
    path = tmp_path / "timeseries.jsonl"
    _write(path, [(1.0, 200), (3.0, 1000), (3.5, 1500), (4.0, 2000), (5.0, 3000)])
    assert _simulate_real().steady_window(path, 1000) == (1000.0, 2.0)
