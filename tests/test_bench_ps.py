"""``bench/ps.py`` still runs and writes the ratios the PS and memory issues name
(a tiny run: figures only, timing decides nothing here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_ps_writes_every_ratio(tmp_path: Path) -> None:
    out = tmp_path / "ps.json"
    argv = ["--rows", "20000", "--dims", "8", "--batch", "4096", "--batches", "2"]
    argv += ["--optimizer", "adagrad", "rowwise_adagrad", "--dtypes", "fp32", "bf16"]
    argv += ["--tiered-rows", "20000"]  # the disk tier: a table 4x its memory budget
    argv += ["--clock", "cpu"]  # the process's CPU time (a shared machine)
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
    assert payload["config"]["clock"] == "cpu"
    assert set(payload["ratios"]) == {
        "get_or_insert_vs_dict",
        "get_or_insert_vs_dict_index",
        "update_time_over_gather_time",
        "bytes_per_row_over_ideal",
        "bytes_per_row_over_budget",
        "bf16_rowwise_vs_fp32_ids_per_s",
        "tiered_vs_memory_ids_per_s",
    }
    assert all(v > 0 for v in payload["ratios"].values())
    figures = payload["figures"]
    assert figures["R20000.D8.ideal_bytes_per_row"] == 8 * 4 * 2  # weights + accum
    # Each configuration's own layout: bf16 weights + float32 state.
    assert figures["R20000.D8.adagrad.bf16.ideal_bytes_per_row"] == 8 * 2 + 8 * 4
    assert figures["R20000.D8.rowwise_adagrad.bf16.ideal_bytes_per_row"] == 8 * 2 + 4
    assert figures["R20000.D8.rowwise_adagrad.fp32.budget_bytes_per_row"] == 1.1 * 36 + 24
    worst = max(
        figures[f"R20000.D8.{c}.bytes_per_row"] / figures[f"R20000.D8.{c}.budget_bytes_per_row"]
        for c in ("adagrad.fp32", "adagrad.bf16", "rowwise_adagrad.fp32", "rowwise_adagrad.bf16")
    )
    assert payload["ratios"]["bytes_per_row_over_budget"] == worst
