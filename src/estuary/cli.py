"""Command line: ``estuary train``, ``eval``, ``report``, ``render``, ``synth``,
``replay``, ``export``, ``serve`` and ``plan``.

    estuary train  JOB.yaml [--set dotted.key=value]... [--output DIR] [--profile] [--nproc W]
                   [--resume]
    estuary eval   JOB.yaml --checkpoint PATH [--stream NAME] [--set dotted.key=value]...
                   [--predictions PATH]
    estuary report RUN_DIR [--out DIR]
    estuary render k8s|yarn JOB.yaml [--output PATH] [--set dotted.key=value]... [--name NAME]
                   [--entrypoint CMD] [--image IMAGE] [--namespace NS]  (k8s)
                   [--env-archive PATH] [--queue QUEUE]                  (yarn)
    estuary export CHECKPOINT --output DIR [--rows float32|float16|bfloat16|int8] [--onnx]
    estuary serve  DIR | --follow RUN_DIR [--host H] [--port P] [--ray --replicas N]
    estuary plan   JOB.yaml --nodes N [--ids 1e10] [--costs PATH] [--save-costs PATH]
    estuary --version

Every command takes ``--log-level [COMPONENT=]LEVEL`` (repeatable), ``--quiet`` /
``--verbose`` and ``--log-format text|json`` (see docs/observability.md).

Known errors (bad job file, bad data over the limit, bad checkpoint) print one
``error: ...`` line naming what and where, and exit with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import yaml


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    import estuary

    try:
        installed = version("estuary")
    except PackageNotFoundError:
        installed = "not installed"
    where = Path(estuary.__file__).resolve().parent
    return f"estuary {installed} ({where})"


def _logging_options() -> argparse.ArgumentParser:
    """The options every command takes (a parent parser)."""
    p = argparse.ArgumentParser(add_help=False)
    group = p.add_argument_group("logging")
    group.add_argument(
        "--log-level",
        dest="log_levels",
        action="append",
        default=[],
        metavar="[COMPONENT=]LEVEL",
        help="level for every estuary component (DEBUG, INFO, WARNING, ERROR) or for one, "
        "e.g. estuary.ps=DEBUG or data.graph=INFO (repeatable; later wins)",
    )
    group.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="INFO messages (-vv: DEBUG)",
    )
    group.add_argument(
        "-q", "--quiet", action="store_true", help="errors only, and no progress bar"
    )
    group.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="json: one object per line with time, level, component, rank, step, message",
    )
    return p


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="estuary", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=_version())
    logs = _logging_options()
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

    train = sub.add_parser("train", parents=[logs], help="train a job, evaluate, checkpoint")
    common(train)
    train.add_argument("--output", type=Path, help="output folder (overrides output.dir)")
    train.add_argument("--profile", action="store_true", help="print per-stage timings")
    train.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue from the output folder's latest checkpoint, if any: data.dataset jobs "
        "at the exact row, data.sources jobs at the next batch of the epoch (mid-epoch with "
        "output.checkpoint_every_steps)",
    )
    train.add_argument(
        "--nproc",
        type=int,
        metavar="W",
        help="trainer processes (sets runtime.trainers and runtime.roles.trainer.count; "
        "W > 1: DDP + a parameter server)",
    )

    ev = sub.add_parser(
        "eval", parents=[logs], help="evaluate a saved checkpoint on the job's eval split"
    )
    common(ev)
    ev.add_argument("--checkpoint", type=Path, required=True, help="checkpoint or run folder")
    ev.add_argument(
        "--stream",
        metavar="NAME",
        help="data.dataset jobs: the stream to evaluate (default: data.dataset.eval_stream)",
    )
    ev.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    ev.add_argument(
        "--predictions",
        type=Path,
        metavar="PATH",
        help="also write each eval row's prediction, one JSON object a line "
        '({"row": ..., "label": ..., "prediction": ...}, in eval order)',
    )

    rep = sub.add_parser(
        "report", parents=[logs], help="plot a run's time series into PNGs and an HTML page"
    )
    rep.add_argument("run_dir", type=Path, help="the run's output folder (output.dir)")
    rep.add_argument("--out", type=Path, help="where to write (default RUN_DIR/report)")

    ren = sub.add_parser(
        "render",
        parents=[logs],
        help="write a cluster manifest for the job: k8s (KubeRay RayJob) or yarn (Skein)",
    )
    ren.add_argument("target", help="k8s or yarn (estuary.plugins.RENDERERS)")
    common(ren)
    ren.add_argument("--output", type=Path, help="file to write (default: stdout)")
    ren.add_argument("--name", help="application name (default: the job's name)")
    ren.add_argument("--entrypoint", help="driver command instead of estuary train on Ray")
    ren.add_argument("--image", help="k8s: container image with estuary[ray] installed")
    ren.add_argument("--namespace", help="k8s: namespace of the objects")
    ren.add_argument("--env-archive", help="yarn: packed Python environment (.tar.gz)")
    ren.add_argument("--queue", help="yarn: the YARN queue")

    from estuary.data.synthetic import DRIFT_KINDS, SYNTHETIC_FORMATS, SyntheticSpec, parse_hour

    default = SyntheticSpec()
    syn = sub.add_parser(
        "synth", parents=[logs], help="write synthetic CTR data in hourly partitions"
    )
    syn.add_argument("out_dir", type=Path, help="output root (ROOT/YYYYMMDD/HH/part-*)")
    syn.add_argument("--rows-per-hour", type=int, default=default.rows_per_hour)
    syn.add_argument("--hours", type=int, default=default.hours)
    syn.add_argument("--format", choices=sorted(SYNTHETIC_FORMATS), default="criteo_tsv")
    syn.add_argument("--gzip", action="store_true", help="gzip text files (parquet: gzip pages)")
    syn.add_argument("--seed", type=int, default=default.seed)
    syn.add_argument("--start", type=parse_hour, default=default.start, help="e.g. 2026-01-01T00")
    syn.add_argument("--drift", type=float, default=default.drift, help="0 = stationary")
    syn.add_argument("--drift-fraction", type=float, default=default.drift_fraction)
    syn.add_argument("--drift-period-hours", type=float, default=default.drift_period_hours)
    syn.add_argument("--drift-kind", choices=DRIFT_KINDS, default=default.drift_kind)
    syn.add_argument("--drift-at", type=parse_hour, help="scenario change hour, e.g. 2026-01-02T00")
    syn.add_argument("--drift-span-hours", type=float, default=default.drift_span_hours)
    syn.add_argument("--burst-at", type=parse_hour, help="first hour of a burst of new ids")
    syn.add_argument("--burst-hours", type=int, default=default.burst_hours)
    syn.add_argument("--burst-share", type=float, default=default.burst_share)
    syn.add_argument("--workers", type=int, default=1, help="processes")
    syn.add_argument("--num-dense", type=int, default=default.num_dense)
    syn.add_argument("--num-sparse", type=int, help="sparse columns (default 26)")
    syn.add_argument(
        "--vocab-sizes",
        type=lambda text: [int(v) for v in text.split(",")],
        help="comma list, repeated to --num-sparse (default: Criteo's)",
    )
    syn.add_argument("--zipf", type=float, default=default.zipf_exponent, help="Zipf exponent")
    syn.add_argument("--base-ctr", type=float, default=default.base_ctr)
    syn.add_argument("--label-noise", type=float, default=default.label_noise)
    syn.add_argument("--files-per-hour", type=int, default=1)
    syn.add_argument("--path-pattern", default="{YYYY}{MM}{DD}/{HH}")
    syn.add_argument("--with-ids", action="store_true", help="add row_id, event_time_ms columns")
    syn.add_argument("--no-success", action="store_true", help="no _SUCCESS markers")
    syn.add_argument("--overwrite", action="store_true", help="rewrite finished hours")

    play = sub.add_parser(
        "replay", parents=[logs], help="replay a file's rows into a stream at a rate"
    )
    play.add_argument("file", type=Path, help="line-format file (.gz/.zst by suffix)")
    play.add_argument(
        "--to", required=True, help="nats://HOST:PORT/SUBJECT or redis://HOST:PORT/KEY"
    )
    play.add_argument("--rate", type=float, required=True, help="rows per second (0 = no limit)")
    play.add_argument("--format", default="criteo_tsv", help="criteo_tsv, csv, tsv or jsonl")
    play.add_argument("--limit", type=int, help="stop after N rows")
    _serving_parsers(sub, logs)
    from estuary.plan.cli import add_parser as add_plan_parser

    add_plan_parser(sub, [logs])
    return parser


def nproc_overrides(trainers: int) -> list[str]:
    """``--nproc W``: the trainer count under both of its keys, so it replaces the
    job file's count whichever key (``runtime.trainers`` or
    ``runtime.roles.trainer.count``) the file uses, and never disagrees with it."""
    return [f"runtime.trainers={trainers}", f"runtime.roles.trainer.count={trainers}"]


def _serving_parsers(sub: Any, logs: argparse.ArgumentParser) -> None:
    """``estuary export`` and ``estuary serve`` (docs/serving.md)."""
    exp = sub.add_parser(
        "export", parents=[logs], help="write a checkpoint as a folder a server loads"
    )
    exp.add_argument("checkpoint", type=Path, help="checkpoint, checkpoints root or run folder")
    exp.add_argument("--output", type=Path, required=True, help="the export folder (new)")
    exp.add_argument(
        "--rows",
        choices=("float32", "float16", "bfloat16", "int8"),
        default="float32",
        help="how embedding rows are stored (smaller files; see docs/serving.md for the AUC cost)",
    )
    exp.add_argument(
        "--onnx",
        action="store_true",
        help="also write the dense network as dense.onnx (pip install 'estuary[onnx]')",
    )
    srv = sub.add_parser("serve", parents=[logs], help="serve predictions over HTTP")
    srv.add_argument("export_dir", type=Path, nargs="?", help="an `estuary export` folder")
    srv.add_argument(
        "--follow",
        type=Path,
        metavar="RUN_DIR",
        help="serve a training run's newest checkpoint and apply new ones as they land",
    )
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    srv.add_argument("--port", type=int, default=8080, help="TCP port")
    srv.add_argument("--max-batch-rows", type=int, default=1024, help="rows per forward pass")
    srv.add_argument(
        "--max-wait-ms", type=float, default=1.0, help="how long a batch waits for more requests"
    )
    srv.add_argument(
        "--max-body-bytes", type=int, default=8 << 20, help="larger request bodies get 413"
    )
    srv.add_argument(
        "--poll-s", type=float, default=0.1, help="--follow: seconds between checks for new ones"
    )
    srv.add_argument(
        "--dense-every-s",
        type=float,
        default=0.0,
        help="--follow: least seconds between dense swaps (0: every checkpoint; "
        "table deltas apply at every checkpoint)",
    )
    srv.add_argument(
        "--prepare",
        choices=("process", "thread"),
        default="process",
        help="--follow: prepare updates in a child process (default; the server only swaps "
        "them in) or on a thread of the server",
    )
    srv.add_argument(
        "--prepare-timeout-s",
        type=float,
        default=60.0,
        help="--prepare process: a child that makes no progress this long while a "
        "checkpoint is pending is killed and replaced",
    )
    srv.add_argument(
        "--threads", type=int, default=1, help="torch threads for the forward (1: lowest latency)"
    )
    srv.add_argument("--ray", action="store_true", help="deploy on Ray Serve")
    srv.add_argument("--replicas", type=int, default=1, help="--ray: replicas")


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_json_atomic(path: Path, data: Any) -> None:
    _write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def _cmd_train(args: argparse.Namespace) -> int:
    from estuary import runtime
    from estuary.config import load_job, to_dict
    from estuary.train import TrainingStopped

    overrides = list(args.overrides)
    if args.output is not None:
        overrides.append(f"output.dir={args.output.resolve()}")
    if args.nproc is not None:
        overrides += nproc_overrides(args.nproc)
    job = load_job(args.job, overrides)
    show = not (args.no_progress or args.quiet) and job.output.progress
    stop = runtime.StopRequest()
    try:
        # Bad rows skipped while loading are reported (logged) by the data layer.
        with _stop_on_signals(stop.request):
            result = runtime.run(job, resume=args.resume, stop=stop, progress=show)
    except TrainingStopped as stopped:
        print(f"{stopped}; continue with --resume", file=sys.stderr)
        return 128 + runtime.StopRequest.signal_number(stopped.reason)
    out_dir = job.resolve(job.output.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = result.summary()
    _write_json_atomic(out_dir / "summary.json", summary)
    resolved = yaml.safe_dump(to_dict(job, resolve_paths=True), sort_keys=False)
    (out_dir / "job.resolved.yaml").write_text(resolved)
    if result.eval_rows:
        metrics = f"eval AUC {result.auc:.4f}  logloss {result.logloss:.4f}"
        head = f"{metrics}  ({result.eval_rows} eval rows; "
    else:
        where = "data.dataset.eval_stream" if job.data.dataset is not None else "data.eval_fraction"
        head = f"no eval rows (set {where} to evaluate)  ("
    print(
        f"{head}{result.train_rows} train rows at "
        f"{result.samples_per_s:,.0f} rows/s; {result.bad_rows} bad rows)"
    )
    print(f"summary: {out_dir / 'summary.json'}")
    if result.checkpoint is not None:
        print(f"checkpoint: {result.checkpoint}")
    if "progressive" in result.extra:
        from estuary.metrics.progressive import format_report

        print(format_report(result.extra["progressive"]))
    if args.profile:
        print("profile (seconds per stage):")
        for key, value in result.profile.items():
            print(f"  {key:>20}: {value}")
    return 0


@contextlib.contextmanager
def _stop_on_signals(request_stop: Callable[[str], None]) -> Iterator[None]:
    """While training: the first SIGTERM or SIGINT calls ``request_stop(name)`` (the
    runtime's ``StopRequest``: the run stops after a step and checkpoints it); a
    second one acts as usual (SIGINT raises KeyboardInterrupt, SIGTERM ends the
    process)."""
    signals = (signal.SIGTERM, signal.SIGINT)
    previous = {sig: signal.getsignal(sig) for sig in signals}

    def handle(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        print(
            f"{name}: stopping after this step with a checkpoint ({name} again: at once)",
            file=sys.stderr,
        )
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        request_stop(name)

    for sig in signals:
        signal.signal(sig, handle)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _cmd_eval(args: argparse.Namespace) -> int:
    import numpy as np

    from estuary.config import ConfigError, load_job
    from estuary.data.types import Batch
    from estuary.train import Trainer

    job = load_job(args.job, args.overrides)
    if args.stream is not None and job.data.dataset is None:
        raise ConfigError("data.dataset", "--stream needs a data.dataset job")
    trainer = Trainer(job)
    trainer.load_checkpoint(args.checkpoint)
    show = not (args.no_progress or args.quiet) and job.output.progress
    rows: list[str] = []

    def record(batch: Batch, probabilities: np.ndarray) -> None:
        ids = batch.row_ids if batch.row_ids is not None else [None] * batch.num_rows
        for row, label, p in zip(ids, batch.labels, probabilities, strict=True):
            line = {"row": None if row is None else int(row), "label": float(label)}
            rows.append(json.dumps({**line, "prediction": float(p)}))

    sink = record if args.predictions is not None else None
    if job.data.dataset is not None:  # a held-out stream, read once in order
        from estuary.train.dataset_eval import evaluate_stream

        result = evaluate_stream(trainer, args.stream, progress=show, sink=sink)
    else:  # the last data.eval_fraction of the rows, as in training
        result = trainer.evaluate(progress=show, sink=sink)
    if args.predictions is not None:
        _write_text_atomic(args.predictions, "".join(f"{line}\n" for line in rows))
    print(f"eval AUC {result.auc:.4f}  logloss {result.logloss:.4f}  ({result.rows} eval rows)")
    print(
        json.dumps(
            {"auc": result.auc, "logloss": result.logloss, "eval_rows": result.rows},
            sort_keys=True,
        )
    )
    return 0


def _cmd_synth(args: argparse.Namespace) -> int:
    from estuary.data.synthetic import (
        CRITEO_VOCAB_SIZES,
        PartitionResult,
        SyntheticSpec,
        SynthOutput,
        write_synthetic,
    )

    sizes = args.vocab_sizes or list(CRITEO_VOCAB_SIZES)
    num_sparse = args.num_sparse or (len(sizes) if args.vocab_sizes and len(sizes) > 1 else 26)
    spec = SyntheticSpec(
        rows_per_hour=args.rows_per_hour,
        hours=args.hours,
        start=args.start,
        num_dense=args.num_dense,
        vocab_sizes=tuple(sizes[i % len(sizes)] for i in range(num_sparse)),
        zipf_exponent=args.zipf,
        base_ctr=args.base_ctr,
        drift=args.drift,
        drift_fraction=args.drift_fraction,
        drift_period_hours=args.drift_period_hours,
        drift_kind=args.drift_kind,
        drift_at=args.drift_at,
        drift_span_hours=args.drift_span_hours,
        burst_at=args.burst_at,
        burst_hours=args.burst_hours,
        burst_share=args.burst_share,
        label_noise=args.label_noise,
        seed=args.seed,
    )
    output = SynthOutput(
        format=args.format,
        gzip=args.gzip,
        path_pattern=args.path_pattern,
        files_per_hour=args.files_per_hour,
        success_marker=not args.no_success,
        extra_columns=("row_id", "event_time_ms") if args.with_ids else (),
        overwrite=args.overwrite,
    )

    def progress(part: PartitionResult) -> None:
        done = "exists, skipped" if part.skipped else f"{part.rows:,} rows"
        print(f"  {part.path}: {done}", file=sys.stderr)

    report = write_synthetic(
        spec, args.out_dir, output, workers=args.workers, on_partition=progress
    )
    print(
        f"wrote {report.rows:,} rows ({report.files} files, {report.size_bytes / 1e6:,.1f} MB; "
        f"{report.skipped} hours skipped) in {report.wall_s:.1f} s: {report.rows_per_s:,.0f} rows/s"
    )
    return 0


def _cmd_replay(args: argparse.Namespace) -> int:
    from estuary.data.streams import open_publisher
    from estuary.data.streams.replay import replay

    publisher = open_publisher(args.to)
    try:
        report = replay(args.file, publisher, args.rate, format=args.format, limit=args.limit)
    finally:
        publisher.close()
    if report.header is not None:
        print(f"skipped the header row: {report.header}", file=sys.stderr)
    target = f" (target {args.rate:,.0f})" if args.rate > 0 else ""
    print(
        f"replayed {report.rows:,} rows to {args.to} in {report.wall_s:.1f} s: "
        f"{report.rows_per_s:,.0f} rows/s{target}"
    )
    return 0


def _cmd_render(args: argparse.Namespace) -> int:
    from estuary.config import load_job
    from estuary.deploy import RenderOptions, render

    # The rendered cluster runs the job on Ray (the entrypoint sets it too): load it
    # so, and a job with Ray-only roles (data executors) renders from a local file.
    job = load_job(args.job, ["runtime.backend=ray", *args.overrides])
    options = RenderOptions(
        name=args.name,
        image=args.image,
        namespace=args.namespace,
        entrypoint=args.entrypoint,
        env_archive=args.env_archive,
        queue=args.queue,
    )
    text = render(args.target, job, options)
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.write_text(text, encoding="utf-8")
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from estuary.metrics.report import render_report

    report = render_report(args.run_dir, args.out)
    for name, why in report.skipped.items():
        print(f"  {name}: not plotted ({why})", file=sys.stderr)
    print(f"{len(report.images)} plots: {report.index}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from estuary.serve.export import export_checkpoint

    result = export_checkpoint(args.checkpoint, args.output, rows=args.rows, onnx=args.onnx)
    rows = ", ".join(f"{name} {count:,}" for name, count in result.rows.items())
    print(
        f"exported {result.version} to {result.path} ({result.size_bytes / 1e6:,.2f} MB; "
        f"rows: {rows}; stored as {args.rows})"
    )
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from estuary.config import ConfigError
    from estuary.serve.server import ServeOptions, open_served, run_server

    if (args.export_dir is None) == (args.follow is None):
        raise ConfigError("serve", "give either an export folder or --follow RUN_DIR")
    options = ServeOptions(
        host=args.host,
        port=args.port,
        max_body_bytes=args.max_body_bytes,
        max_batch_rows=args.max_batch_rows,
        max_wait_s=args.max_wait_ms / 1000,
        poll_s=args.poll_s,
        dense_every_s=args.dense_every_s,
        threads=args.threads,
        prepare=args.prepare,
        prepare_timeout_s=args.prepare_timeout_s,
    )
    what = args.follow if args.follow is not None else args.export_dir
    if args.ray:
        from estuary.serve.ray_serve import run_on_ray

        print(
            f"serving {what} on Ray Serve, {args.replicas} replicas: http://{args.host}:{args.port}"
        )
        run_on_ray(args.export_dir, args.follow, options, args.replicas)
        return 0
    served = open_served(args.export_dir, args.follow, options)
    print(f"serving {served.model.version} from {what} on http://{args.host}:{args.port}")
    sys.stdout.flush()
    run_server(served, options)
    return 0


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """Warnings as one ``warning: ...`` line on stderr (no Python source lines);
    the data layer's messages already name the file."""
    print(f"warning: {message}", file=sys.stderr if file is None else file)


def _cmd_plan(args: argparse.Namespace) -> int:
    from estuary.plan.cli import run

    return run(args)


COMMANDS = {
    "train": _cmd_train,
    "eval": _cmd_eval,
    "report": _cmd_report,
    "render": _cmd_render,
    "synth": _cmd_synth,
    "replay": _cmd_replay,
    "export": _cmd_export,
    "serve": _cmd_serve,
    "plan": _cmd_plan,
}


def main(argv: Sequence[str] | None = None) -> int:
    from estuary.config import ConfigError
    from estuary.data import DataError
    from estuary.metrics.logs import ENV_VAR, LogSettings
    from estuary.ps import PSError
    from estuary.runtime.launcher import DistributedError
    from estuary.serve.export import ExportError
    from estuary.train import CheckpointError

    args = _parser().parse_args(argv)
    exported = os.environ.get(ENV_VAR)
    try:
        verbosity = -1 if args.quiet else args.verbose
        settings = LogSettings.parse(args.log_levels, verbosity=verbosity, fmt=args.log_format)
        settings.apply()
        settings.export()  # trainer processes of a multi-trainer run log the same way
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            return COMMANDS[args.command](args)
    except (
        ConfigError,
        DataError,
        CheckpointError,
        DistributedError,
        PSError,
        ExportError,
        FileNotFoundError,
    ) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:  # main() may run again in this process (tests) with other settings
        if exported is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = exported


if __name__ == "__main__":
    sys.exit(main())
