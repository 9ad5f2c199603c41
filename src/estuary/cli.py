"""Command line: ``estuary train`` and ``estuary eval``.

    estuary train JOB.yaml [--set dotted.key=value]... [--output DIR] [--profile]
    estuary eval  JOB.yaml --checkpoint PATH [--set dotted.key=value]...

Known errors (bad job file, bad data over the limit, bad checkpoint) print one
``error: ...`` line naming what and where, and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="estuary", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("job", type=Path, help="job file (YAML)")
        p.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a job field, e.g. --set train.epochs=3 (repeatable)",
        )

    train = sub.add_parser("train", help="train a job, evaluate, checkpoint")
    common(train)
    train.add_argument("--output", type=Path, help="output folder (overrides output.dir)")
    train.add_argument("--profile", action="store_true", help="print per-stage timings")
    train.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    ev = sub.add_parser("eval", help="evaluate a saved checkpoint on the job's eval split")
    common(ev)
    ev.add_argument("--checkpoint", type=Path, required=True, help="checkpoint or run folder")
    return parser


def _write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _cmd_train(args: argparse.Namespace) -> int:
    from estuary.config import load_job, to_dict
    from estuary.train import Trainer

    overrides = list(args.overrides)
    if args.output is not None:
        overrides.append(f"output.dir={args.output.resolve()}")
    job = load_job(args.job, overrides)
    trainer = Trainer(job)
    bad = trainer.dataset.bad_rows
    if bad.count:
        print(f"skipped {bad.count} bad rows of {bad.rows_read} read; first ones:", file=sys.stderr)
        for row in bad.examples:
            print(f"  {row.file}:{row.line}: {row.reason}", file=sys.stderr)
    result = trainer.fit(progress=not args.no_progress and job.output.progress)
    out_dir = job.resolve(job.output.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = result.summary()
    _write_json_atomic(out_dir / "summary.json", summary)
    resolved = yaml.safe_dump(to_dict(job, resolve_paths=True), sort_keys=False)
    (out_dir / "job.resolved.yaml").write_text(resolved)
    print(
        f"eval AUC {result.auc:.4f}  logloss {result.logloss:.4f}  "
        f"({result.eval_rows} eval rows; {result.train_rows} train rows at "
        f"{result.samples_per_s:,.0f} rows/s; {result.bad_rows} bad rows)"
    )
    print(f"summary: {out_dir / 'summary.json'}")
    if result.checkpoint is not None:
        print(f"checkpoint: {result.checkpoint}")
    if args.profile:
        print("profile (seconds per stage):")
        for key, value in result.profile.items():
            print(f"  {key:>20}: {value}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from estuary.config import load_job
    from estuary.train import Trainer

    job = load_job(args.job, args.overrides)
    trainer = Trainer(job)
    trainer.load_checkpoint(args.checkpoint)
    result = trainer.evaluate()
    print(f"eval AUC {result.auc:.4f}  logloss {result.logloss:.4f}  ({result.rows} eval rows)")
    print(
        json.dumps(
            {"auc": result.auc, "logloss": result.logloss, "eval_rows": result.rows},
            sort_keys=True,
        )
    )
    return 0


COMMANDS = {"train": _cmd_train, "eval": _cmd_eval}


def main(argv: Sequence[str] | None = None) -> int:
    from estuary.config import ConfigError
    from estuary.data import DataError
    from estuary.train import CheckpointError

    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (ConfigError, DataError, CheckpointError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
