"""``estuary report RUN_DIR``: PNG plots of a run's time series and a small HTML
page linking them.

Reads ``RUN_DIR/timeseries.jsonl`` (``estuary.metrics.timeseries``; written while
the run trains) and ``RUN_DIR/summary.json`` when present, and writes into
``RUN_DIR/report/`` (or ``out``)::

    index.html      the run in one page: summary figures, then each plot
    loss.png        training loss (mean per sample interval) over steps
    auc.png         windowed training AUC over steps, the evaluations' AUC
    throughput.png  rows/s over wall time (restarts marked)
    stages.png      seconds per stage per interval (data, lookup, wait, fwd/bwd, ...)
    staleness.png   most sparse updates in flight; queue depths
    tables.png      embedding rows and bytes over steps, all tables
    data_lag.png    data lag per stream (data.dataset runs)
    scaling.png     trainers over time with each decision (only when the run has any)

A plot whose figures the series lacks is left out (and listed in the page).
Plots use matplotlib's Agg backend: no display needed.
"""

from __future__ import annotations

import html
import itertools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from estuary.metrics.timeseries import TIMESERIES_FILE, read_timeseries

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["Report", "RunSeries", "render_report"]

Record = dict[str, Any]


@dataclass
class RunSeries:
    """A run's records, by kind, with times relative to its first record.

    Args:
        starts, samples, checkpoints, evals, scalings, ends: the records of each kind.
        t0: time of the first record (s since 1970).
    """

    starts: list[Record] = field(default_factory=list)
    samples: list[Record] = field(default_factory=list)
    checkpoints: list[Record] = field(default_factory=list)
    evals: list[Record] = field(default_factory=list)
    scalings: list[Record] = field(default_factory=list)
    ends: list[Record] = field(default_factory=list)
    t0: float = 0.0

    @classmethod
    def read(cls, path: Path) -> RunSeries:
        series = cls()
        kinds = {
            "start": series.starts,
            "sample": series.samples,
            "checkpoint": series.checkpoints,
            "eval": series.evals,
            "scaling": series.scalings,
            "end": series.ends,
        }
        first: float | None = None
        for record in read_timeseries(path):
            if first is None:
                first = float(record.get("time", 0.0))
            target = kinds.get(str(record["kind"]))
            if target is not None:  # kinds from a newer writer are skipped
                target.append(record)
        series.t0 = first or 0.0
        return series

    def elapsed(self, records: Sequence[Record]) -> list[float]:
        """Seconds since the first record."""
        return [float(r["time"]) - self.t0 for r in records]


@dataclass(frozen=True)
class Report:
    """What ``render_report`` wrote.

    Args:
        index: the HTML page.
        images: the PNG files, in page order.
        skipped: plot name -> why it was left out.
    """

    index: Path
    images: list[Path]
    skipped: dict[str, str]


def _values(records: Sequence[Record], key: str) -> list[float]:
    return [math.nan if r.get(key) is None else float(r[key]) for r in records]


def _steps(records: Sequence[Record]) -> list[float]:
    return [float(r.get("step", 0)) for r in records]


def _finite(values: Sequence[float]) -> bool:
    return any(math.isfinite(v) for v in values)


def _mark_restarts(ax: Axes, series: RunSeries, *, by: str) -> None:
    """Vertical lines where the run was resumed (``by``: ``step`` or ``time``)."""
    for start in series.starts:
        if start.get("restarts", 0):
            x = float(start["step"]) if by == "step" else float(start["time"]) - series.t0
            ax.axvline(x, color="tab:red", linestyle="--", linewidth=1)
            ax.annotate(
                "resumed",
                (x, 1),
                xycoords=("data", "axes fraction"),
                color="tab:red",
                fontsize=8,
                rotation=90,
                va="top",
                ha="right",
            )


def _plot_loss(ax: Axes, s: RunSeries) -> str | None:
    loss = _values(s.samples, "loss")
    if not _finite(loss):
        return "no training loss recorded"
    ax.plot(_steps(s.samples), loss, marker=".", label="training loss (interval mean)")
    ax.set(xlabel="step", ylabel="log loss", title="Training loss")
    for e in s.evals:
        if e.get("logloss") is not None:
            ax.scatter(
                [e["step"]],
                [e["logloss"]],
                color="tab:green",
                zorder=3,
                label=f"eval logloss {e['logloss']:.4f}",
            )
    _mark_restarts(ax, s, by="step")
    ax.legend(loc="best", fontsize=8)
    return None


def _plot_auc(ax: Axes, s: RunSeries) -> str | None:
    auc = _values(s.samples, "auc_window")
    evals = [e for e in s.evals if e.get("auc") is not None]
    if not _finite(auc) and not evals:
        return "no windowed or evaluation AUC recorded"
    ax.plot(_steps(s.samples), auc, marker=".", label="training AUC per window")
    for e in evals:
        ax.scatter(
            [e["step"]],
            [e["auc"]],
            color="tab:green",
            zorder=3,
            label=f"eval AUC {e['auc']:.4f} ({e.get('rows', '?')} rows)",
        )
    ax.set(xlabel="step", ylabel="ROC AUC", title="AUC (windowed on training rows; eval)")
    _mark_restarts(ax, s, by="step")
    ax.legend(loc="best", fontsize=8)
    return None


def _plot_throughput(ax: Axes, s: RunSeries) -> str | None:
    rate = _values(s.samples, "rows_per_s")
    if not _finite(rate):
        return "no rows/s recorded"
    ax.plot(s.elapsed(s.samples), rate, marker=".")
    ax.set(xlabel="wall time (s)", ylabel="rows / s", title="Throughput (all trainers)")
    ax.set_ylim(bottom=0)
    _mark_restarts(ax, s, by="time")
    return None


_STAGES = ("data_s", "lookup_s", "wait_s", "forward_backward_s", "dense_step_s", "sparse_submit_s")


def _plot_stages(ax: Axes, s: RunSeries) -> str | None:
    samples = [r for r in s.samples if isinstance(r.get("stages"), dict)]
    if len(samples) < 2:
        return "fewer than two samples of stage times"
    t = s.elapsed(samples)
    gaps = [max(b - a, 1e-9) for a, b in itertools.pairwise(t)]
    labels, shares = [], []
    for stage in _STAGES:
        cumulative = [float(r["stages"].get(stage, 0.0)) for r in samples]
        # Per interval; a restart resets the cumulative figures (a drop: its value).
        per = [b - a if b >= a else b for a, b in itertools.pairwise(cumulative)]
        if any(per):
            labels.append(stage.removesuffix("_s"))
            shares.append([x / gap for x, gap in zip(per, gaps, strict=True)])
    if not shares:
        return "every stage time is zero"
    ax.stackplot(t[1:], shares, labels=labels, step="pre", alpha=0.85)
    ax.set(
        xlabel="wall time (s)",
        ylabel="share of wall time",
        title="Time per stage (training thread; prefetch stages may overlap)",
    )
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower left", fontsize=8)
    return None


def _plot_staleness(ax: Axes, s: RunSeries) -> str | None:
    staleness = _values(s.samples, "staleness_max")
    if not _finite(staleness):
        return "no staleness recorded"
    steps = _steps(s.samples)
    ax.step(steps, staleness, where="post", label="sparse staleness (max so far)")
    queues = sorted({q for r in s.samples for q in (r.get("queues") or {})})
    for queue in queues:
        depth = [float((r.get("queues") or {}).get(queue, math.nan)) for r in s.samples]
        ax.plot(steps, depth, marker=".", linestyle=":", label=f"queue {queue}")
    ax.set(xlabel="step", ylabel="updates / items", title="Staleness and queue depths")
    ax.set_ylim(bottom=0)
    ax.legend(loc="best", fontsize=8)
    return None


def _plot_tables(ax: Axes, s: RunSeries) -> str | None:
    samples = [r for r in s.samples if r.get("tables")]
    if not samples:
        return "no table figures recorded"
    steps = _steps(samples)
    rows = [sum(float(t.get("rows", 0)) for t in r["tables"].values()) for r in samples]
    admissions = [sum(float(t.get("admissions", 0)) for t in r["tables"].values()) for r in samples]
    evictions = [sum(float(t.get("evictions", 0)) for t in r["tables"].values()) for r in samples]
    megabytes = [sum(float(t.get("bytes", 0)) for t in r["tables"].values()) / 1e6 for r in samples]
    ax.plot(steps, rows, marker=".", label="rows (all tables)")
    ax.plot(steps, admissions, linestyle="--", label="admissions")
    ax.plot(steps, evictions, linestyle=":", label="evictions")
    ax.set(xlabel="step", ylabel="ids", title=f"Embedding tables ({len(samples[-1]['tables'])})")
    right = ax.twinx()
    right.plot(steps, megabytes, color="tab:purple", label="MB held")
    right.set_ylabel("MB")
    lines = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left", fontsize=8)
    return None


def _plot_data_lag(ax: Axes, s: RunSeries) -> str | None:
    streams = sorted({k for r in s.samples for k in (r.get("data_lag_s") or {})})
    if not streams:
        return "the data has no event time (data.sources)"
    t = s.elapsed(s.samples)
    for stream in streams:
        lag = [float((r.get("data_lag_s") or {}).get(stream, math.nan)) for r in s.samples]
        ax.plot(t, lag, marker=".", label=stream)
    ax.set(
        xlabel="wall time (s)",
        ylabel="seconds behind",
        title="Data lag (now - event time of the newest trained row)",
    )
    ax.legend(loc="best", fontsize=8)
    return None


def _plot_scaling(ax: Axes, s: RunSeries) -> str | None:
    if not s.scalings:
        return "no scaling decisions (the run kept its trainers)"
    t = s.elapsed(s.scalings)
    trainers = [float(r.get("trainers", math.nan)) for r in s.scalings]
    first = float(s.starts[0].get("world_size", trainers[0])) if s.starts else trainers[0]
    ax.step([0.0, *t], [first, *trainers], where="post")
    for x, record in zip(t, s.scalings, strict=True):
        label = f"{record.get('action', '?')}: {record.get('reason', '')}".strip(": ")
        ax.annotate(label, (x, float(record.get("trainers", 0))), fontsize=7, rotation=30)
    ax.set(xlabel="wall time (s)", ylabel="trainers", title="Scaling decisions")
    ax.set_ylim(bottom=0)
    return None


PLOTS: dict[str, tuple[str, Callable[[Axes, RunSeries], str | None]]] = {
    "loss": ("Training loss", _plot_loss),
    "auc": ("AUC", _plot_auc),
    "throughput": ("Throughput", _plot_throughput),
    "stages": ("Time per stage", _plot_stages),
    "staleness": ("Staleness and queues", _plot_staleness),
    "tables": ("Embedding tables", _plot_tables),
    "data_lag": ("Data lag", _plot_data_lag),
    "scaling": ("Scaling decisions", _plot_scaling),
}
"""name -> (caption, plot function); the function returns why it cannot plot, or None."""


def render_report(run_dir: Path, out: Path | None = None, *, dpi: int = 100) -> Report:
    """Plot ``run_dir``'s time series into ``out`` (default ``run_dir/report``).

    Raises:
        FileNotFoundError: the run folder has no ``timeseries.jsonl``.
        ValueError: the time series is unreadable.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    path = run_dir / TIMESERIES_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no time series (runs record one unless output.timeseries_every_s is null)"
        )
    series = RunSeries.read(path)
    out = run_dir / "report" if out is None else out
    out.mkdir(parents=True, exist_ok=True)
    images: list[Path] = []
    captions: dict[Path, str] = {}
    skipped: dict[str, str] = {}
    for name, (caption, plot) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(7, 3.6))
        try:
            why = plot(ax, series)
            if why is None:
                ax.grid(alpha=0.3)
                fig.tight_layout()
                image = out / f"{name}.png"
                fig.savefig(image, dpi=dpi)
                images.append(image)
                captions[image] = caption
            else:
                skipped[name] = why
                (out / f"{name}.png").unlink(missing_ok=True)  # from an older report
        finally:
            plt.close(fig)
    index = out / "index.html"
    index.write_text(_page(run_dir, series, images, captions, skipped), encoding="utf-8")
    return Report(index=index, images=images, skipped=skipped)


def _summary(run_dir: Path, series: RunSeries) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    start = series.starts[0] if series.starts else {}
    if start:
        rows.append(("job", str(start.get("job", ""))))
        rows.append(("mode", str(start.get("mode", ""))))
        rows.append(("trainers", str(start.get("world_size", ""))))
    rows.append(("restarts", str(max((s.get("restarts", 0) for s in series.starts), default=0))))
    if series.ends:
        end = series.ends[-1]
        rows.append(("steps", f"{end.get('step', 0):,}"))
        rows.append(("rows trained (last fit)", f"{end.get('rows', 0):,}"))
        rows.append(("rows/s (last fit)", f"{float(end.get('rows_per_s') or 0):,.0f}"))
    if series.evals:
        e = series.evals[-1]
        if e.get("auc") is not None:
            rows.append(("eval AUC", f"{e['auc']:.4f} ({e.get('rows', 0):,} rows)"))
        if e.get("logloss") is not None:
            rows.append(("eval logloss", f"{e['logloss']:.4f}"))
    if series.checkpoints:
        seconds = [float(c.get("duration_s", 0)) for c in series.checkpoints]
        rows.append(("checkpoints", f"{len(seconds)} (longest {max(seconds):.2f} s)"))
    summary = run_dir / "summary.json"
    if summary.is_file():
        try:
            data = json.loads(summary.read_text())
            rows.append(("bad rows", str(data.get("bad_rows", ""))))
        except ValueError:
            pass
    rows.append(("samples", str(len(series.samples))))
    return rows


def _page(
    run_dir: Path,
    series: RunSeries,
    images: Sequence[Path],
    captions: dict[Path, str],
    skipped: dict[str, str],
) -> str:
    esc = html.escape
    title = f"Estuary run: {run_dir.resolve().name}"
    table = "\n".join(
        f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in _summary(run_dir, series)
    )
    figures = "\n".join(
        f'<figure><img src="{esc(p.name)}" alt="{esc(captions[p])}">'
        f"<figcaption>{esc(captions[p])}</figcaption></figure>"
        for p in images
    )
    left_out = "\n".join(f"<li>{esc(PLOTS[n][0])}: {esc(why)}</li>" for n, why in skipped.items())
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{esc(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; max-width: 60em; }}
table {{ border-collapse: collapse; margin-bottom: 1em; }}
th, td {{ text-align: left; padding: 0.2em 1em 0.2em 0; }}
figure {{ margin: 1em 0; }}
img {{ max-width: 100%; border: 1px solid #ddd; }}
</style>
</head>
<body>
<h1>{esc(title)}</h1>
<p>From <code>{esc(str(run_dir / TIMESERIES_FILE))}</code>.</p>
<table>
{table}
</table>
{figures}
{"<h2>Not plotted</h2><ul>" + left_out + "</ul>" if left_out else ""}
</body>
</html>
"""
