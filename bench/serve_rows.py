"""Benchmark: what each export row encoding costs in AUC and saves in serving memory.

    python bench/serve_rows.py [--job examples/criteo.yaml] [--json PATH]

Trains ``--job`` (default: DLRM on the shipped Criteo DAC sample, one epoch),
exports its final checkpoint with ``--rows`` float32, float16, bfloat16 and int8,
loads each export as the server does (``load_export``: rows kept in their
encoding, ``FrozenTable``) and predicts the held-out rows (the file's last
``data.eval_fraction``, in file order: the job's eval split) through the
server's feature pipeline. Per encoding: AUC, the tables' resident bytes
(``ServingModel.table_bytes``: ids, rows as stored, int8 scales, unknown rows),
the rows' bytes alone, and the table files' bytes. Also the resident bytes of the
same checkpoint's tables as a followed run holds them (``EmbeddingTable``s:
float32 rows, optimizer slots, hash index; one copy, without the standby).

JSON: ``rows.<encoding>.{auc, auc_delta, table_bytes, row_bytes, file_bytes}``,
``follow_table_bytes``, ``eval_rows``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent


def held_out(job: dict[str, Any], job_dir: Path) -> tuple[list[dict[str, Any]], np.ndarray]:
    """The last ``eval_fraction`` of the (single, Criteo TSV) source's rows as request
    instances, and their labels."""
    (source,) = job["data"]["sources"]
    path = (job_dir / source["path"]).resolve()
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        lines = f.read().splitlines()
    tail = lines[len(lines) - int(len(lines) * job["data"]["eval_fraction"]) :]
    dense, sparse = job["data"]["schema"]["dense"], job["data"]["schema"]["sparse"]
    rows, labels = [], []
    for line in tail:
        values = line.split("\t")
        labels.append(int(values[0]))
        row: dict[str, Any] = {}
        for name, value in zip(dense, values[1 : 1 + len(dense)], strict=True):
            row[name] = int(value) if value else None
        for name, value in zip(sparse, values[1 + len(dense) :], strict=True):
            row[name] = value or None
        rows.append(row)
    return rows, np.array(labels, np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", type=Path, default=ROOT / "examples" / "criteo.yaml")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()

    from estuary.cli import main as cli
    from estuary.metrics.evaluation import evaluate_predictions
    from estuary.serve.checkpoints import model_from_checkpoint
    from estuary.serve.export import ROW_ENCODINGS, export_checkpoint, load_export
    from estuary.serve.frozen_table import FrozenTable
    from estuary.train.checkpoint import load_checkpoint

    job_path = args.job.resolve()
    job = yaml.safe_load(job_path.read_text())
    work = Path(tempfile.mkdtemp(prefix="estuary-bench-rows-"))
    try:
        run = work / "run"
        job["output"] = {**job.get("output", {}), "dir": str(run), "progress": False}
        job_copy = job_path.parent / f".bench-rows-{job_path.name}"
        job_copy.write_text(yaml.safe_dump(job))  # beside the original: its paths resolve
        try:
            assert cli(["train", str(job_copy), "-q"]) == 0
        finally:
            job_copy.unlink()
        rows, labels = held_out(job, job_path.parent)
        follow = model_from_checkpoint(load_checkpoint(run))
        out: dict[str, Any] = {}
        for name in ROW_ENCODINGS:
            folder = export_checkpoint(run, work / f"export-{name}", rows=name).path
            model = load_export(folder)
            chunks = [rows[i : i + 4096] for i in range(0, len(rows), 4096)]  # the row limit
            parts = [model.predict(model.pipeline.parse(c)).probabilities for c in chunks]
            auc = evaluate_predictions(labels, np.concatenate(parts)).auc
            weights = [
                t.weights.nbytes for t in model.tables.values() if isinstance(t, FrozenTable)
            ]
            out[name] = {
                "auc": round(float(auc), 5),
                "table_bytes": model.table_bytes,
                "row_bytes": sum(weights),
                "file_bytes": sum(f.stat().st_size for f in (folder / "tables").iterdir()),
            }
        for name in out:
            out[name]["auc_delta"] = round(out[name]["auc"] - out["float32"]["auc"], 5)
        result = {
            "job": str(args.job),
            "eval_rows": len(rows),
            "rows": out,
            "follow_table_bytes": follow.table_bytes,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
