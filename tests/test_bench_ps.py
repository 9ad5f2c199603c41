"""``bench/ps.py`` still runs and writes the ratios the PS issue names (a tiny
run: figures only, timing decides nothing here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_ps_writes_every_ratio(tmp_path: Path) -> None:
    out = tmp_path / "ps.json"
    argv = ["--rows", "20000", "--dims", "8", "--batch", "4096", "--batches", "2"]
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "ps.py"),
            *argv,
            "--repeats",
            "1",
            "--json",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    payload = json.loads(out.read_text())
    assert set(payload["ratios"]) == {
        "get_or_insert_vs_dict",
        "get_or_insert_vs_dict_index",
        "update_time_over_gather_time",
        "bytes_per_row_over_ideal",
    }
    assert all(v > 0 for v in payload["ratios"].values())
    assert payload["figures"]["R20000.D8.ideal_bytes_per_row"] == 8 * 4 * 2  # weights + accum
