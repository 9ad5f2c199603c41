"""Benchmark: Estuary's AUC/logloss against the same models outside Estuary.

    python bench/quality.py [--json PATH] [--quick] [--datasets criteo,avazu]
                            [--models dlrm,deepfm] [--seeds 0,1,2] [--contenders ...]
                            [--set dotted.key=value]... [--deepctr-lr 1e-3]

For each dataset sample in ``shared/data`` and each model, every contender trains
on the same split (the example job's: the last 10% of rows, in time order,
evaluate), the same inputs and the same number of epochs, once per seed:

  DLRM    estuary (``train.mode: sync``), estuary_hybrid (``hybrid``, staleness
          4), estuary_async; the same two with ``train.sparse_placement:
          background`` (estuary_hybrid_bg, estuary_async_bg); pytorch and
          torchrec (``bench/quality_refs.py``)
  DeepFM  estuary; pytorch and deepctr (deepctr-torch's own ``DeepFM``)

Estuary runs are the example job files (``examples/{dataset}.yaml`` for DLRM,
``examples/{dataset}_deepfm.yaml`` for DeepFM) through the Python API
(``load_job`` + ``Trainer``), with ``--set`` overrides on top. The pytorch and
torchrec references copy that job's settings (network, dim, initializer, Adagrad
lr/eps, dense optimizer, batch size, epochs, batch order), except the table lr:
each gets its own best from the same lr search (``REFERENCE_LR``). deepctr keeps
its own recipe with its own tuned lr, and takes the job's dims, MLP, batch size
and epochs. All read the rows
Estuary itself parsed and hashed; see ``quality_refs.py`` for how ids become
vocabulary indices (min count = the job's ``admission.min_count``).

Reported (mean over seeds): AUC and logloss per contender, and

  auc_gap_vs_best        best reference AUC minus Estuary's (sync), worst case
                         over datasets and models (floor: <= 0.003)
  hybrid_minus_sync_auc  Estuary DLRM hybrid minus sync, the largest |gap| over
                         datasets and both placements: the policy's choice
                         (estuary_hybrid; inline on 2 busy cores, so it trains
                         like sync) and background threads forced
                         (estuary_hybrid_bg), where updates land up to 4 steps
                         late (floor: |gap| <= 0.002)
  async_minus_sync_auc   the same for async (estuary_async, estuary_async_bg)
  rowwise_bf16_minus_fp32_auc
                         Estuary DLRM with row-wise Adagrad (``ROWWISE_OPTIMIZER``:
                         ``rowwise_adagrad_elem``, one accumulator per row)
                         and bf16 rows (estuary_rowwise_bf16) minus the example's full
                         Adagrad with fp32 rows (estuary), the lowest over
                         datasets (floor: >= -0.001); estuary_rowwise_fp32
                         separates the optimizer's share from the rows'

Everything runs in this process, one run after another (``--threads`` torch
threads): about 16 minutes for the full run on 2 shared cores, 4 with
``--quick`` (seed 0; no async, forced-background hybrid or row-wise fp32). The references need
the bench-only extras (``bash bench/install-extras.sh``); a missing one is
reported as unavailable.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # quality_refs beside this file

import quality_refs

ROOT = Path(__file__).resolve().parent.parent
DATASETS = ("criteo", "avazu")
MODELS = ("dlrm", "deepfm")
CONTENDERS = {
    "dlrm": (
        "estuary",
        "estuary_hybrid",
        "estuary_hybrid_bg",
        "estuary_async",
        "estuary_async_bg",
        "estuary_rowwise_fp32",
        "estuary_rowwise_bf16",
        "pytorch",
        "torchrec",
    ),
    "deepfm": ("estuary", "pytorch", "deepctr"),
}
QUICK_SKIPS = ("estuary_async", "estuary_hybrid_bg", "estuary_async_bg", "estuary_rowwise_fp32")
ESTUARY_MODES = {
    "estuary": "sync",
    "estuary_hybrid": "hybrid",
    "estuary_hybrid_bg": "hybrid",
    "estuary_async": "async",
    "estuary_async_bg": "async",
    "estuary_rowwise_fp32": "sync",
    "estuary_rowwise_bf16": "sync",
}
# Row-wise Adagrad (one accumulator per row) with fp32 or bf16 stored rows, against
# the example job's full Adagrad with fp32 rows (``estuary``). ``rowwise_adagrad_elem``
# (the row's accumulator for each element's past, the element's own g^2 for this
# step; state 1 float per row, as fbgemm's ``rowwise_adagrad``) was chosen over
# ``rowwise_adagrad``, SM3's row cover and factored (per-table per-dimension) forms
# on held-out seeds 3-5 (docs/results.md). Its table lr is the example job's own
# full-Adagrad lr (0.03 Criteo, 0.02 Avazu; a fresh row's first step is full
# Adagrad's): of 0.02 and 0.03, each dataset's best mean AUC on seeds 3-5 with fp32
# rows. (rowwise_adagrad's own lr search chose 0.02 on both; docs/results.md.)
ROWWISE_OPTIMIZER = "rowwise_adagrad_elem"
ROWWISE = {
    "estuary_rowwise_fp32": "fp32",
    "estuary_rowwise_bf16": "bf16",
}
ROWWISE_LR = {"criteo": 0.03, "avazu": 0.02}
# Contenders whose sparse work runs on background threads whatever the placement
# policy picks (on 2 busy cores it picks inline, where hybrid/async train like sync).
FORCED_BACKGROUND = ("estuary_hybrid_bg", "estuary_async_bg")
STALENESS = 4
REFERENCE_MODULES = {"torchrec": ("fbgemm_gpu", "torchrec"), "deepctr": ("deepctr_torch",)}
# The pytorch and torchrec references' table lr (Adagrad, the same math in both):
# the best of the lr search given Estuary (0.005 / 0.01 / 0.02 / 0.04, mean of 3
# seeds; docs/results.md) run on the pytorch reference itself; everything else
# follows the Estuary job.
REFERENCE_LR = {
    ("criteo", "dlrm"): 0.04,
    ("criteo", "deepfm"): 0.005,
    ("avazu", "dlrm"): 0.01,
    ("avazu", "deepfm"): 0.02,
}
HEADLINE = (
    "auc_gap_vs_best",
    "hybrid_minus_sync_auc",
    "async_minus_sync_auc",
    "rowwise_bf16_minus_fp32_auc",
)
INSTALL_HINT = "install with bench/install-extras.sh"


def job_path(dataset: str, model: str) -> Path:
    name = dataset if model == "dlrm" else f"{dataset}_{model}"
    return ROOT / "examples" / f"{name}.yaml"


def available(contender: str) -> bool:
    for module in REFERENCE_MODULES.get(contender, ()):
        try:
            __import__(module)
        except Exception:  # an ImportError, or a broken build raising anything else
            return False
    return True


class Runner:
    """Loads each dataset once (Estuary's reader) and runs contenders on it."""

    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.args = args
        self.out = out
        self.datasets: dict[str, Any] = {}
        self.prepared: dict[tuple[str, int], quality_refs.Prepared] = {}

    def job(self, dataset: str, model: str, contender: str, overrides: list[str]) -> Any:
        from estuary.config import load_job

        tuned = []
        if contender in ("pytorch", "torchrec"):
            tuned = [f"model.embedding.default.optimizer.lr={REFERENCE_LR[dataset, model]}"]
        return load_job(job_path(dataset, model), overrides=[*tuned, *self.args.set, *overrides])

    def dataset(self, name: str, job: Any) -> Any:
        from estuary.data import TabularDataset

        if name not in self.datasets:
            self.datasets[name] = TabularDataset(job.data, job.base_dir)
        return self.datasets[name]

    def run(self, dataset: str, model: str, contender: str, seed: int) -> quality_refs.Metrics:
        from estuary.train import Trainer

        overrides = [
            f"train.seed={seed}",
            "output.checkpoint=false",
            "output.progress=false",
            f"output.dir={self.out / f'{dataset}-{model}-{contender}-{seed}'}",
            f"train.threads={self.args.threads}",
        ]
        if contender in ESTUARY_MODES:
            overrides += [f"train.mode={ESTUARY_MODES[contender]}", f"train.staleness={STALENESS}"]
        if contender in FORCED_BACKGROUND:
            overrides.append("train.sparse_placement=background")
        if contender in ROWWISE:
            overrides += [
                f"model.embedding.default.optimizer.name={ROWWISE_OPTIMIZER}",
                f"model.embedding.default.optimizer.lr={ROWWISE_LR[dataset]}",
                f"model.embedding.default.dtype={ROWWISE[contender]}",
            ]
        job = self.job(dataset, model, contender, overrides)
        data = self.dataset(dataset, job)
        if contender in ESTUARY_MODES:
            result = Trainer(job, dataset=data).fit(progress=False)
            note = ""
            if contender != "estuary" and contender not in ROWWISE:
                note = (
                    f"sparse work {result.extra['sparse_placement']}, "
                    f"max {result.extra['max_staleness_seen']} updates behind"
                )
            return quality_refs.Metrics(auc=result.auc, logloss=result.logloss, note=note)
        min_count = job.model.embedding.default.admission.min_count
        if (dataset, min_count) not in self.prepared:
            self.prepared[dataset, min_count] = quality_refs.prepare(data, min_count)
        settings = quality_refs.settings_from_job(job)
        if contender == "deepctr":
            lr = self.args.deepctr_lr or quality_refs.DEEPCTR_LR.get(dataset, 1e-3)
            extra = {"lr": lr, "shuffle": not self.args.deepctr_no_shuffle}
            settings = quality_refs.Settings(**{**settings.__dict__, "extra": extra})
        train = quality_refs.REFERENCES[contender]
        return train(self.prepared[dataset, min_count], settings, seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write figures and gaps here")
    parser.add_argument("--quick", action="store_true", help="seed 0 only, no async run")
    parser.add_argument("--datasets", default=",".join(DATASETS))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--contenders", help="comma-separated subset (default: all)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override for the Estuary jobs (the pytorch/torchrec references follow it)",
    )
    parser.add_argument(
        "--deepctr-lr", type=float, help="deepctr's Adam lr (default: tuned, per dataset)"
    )
    parser.add_argument(
        "--deepctr-no-shuffle", action="store_true", help="deepctr in file order, not shuffled"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads, every contender")
    args = parser.parse_args()
    seeds = [0] if args.quick else [int(s) for s in args.seeds.split(",")]
    datasets = [d for d in args.datasets.split(",") if d]
    models = [m for m in args.models.split(",") if m]
    for name, given, known in (("datasets", datasets, DATASETS), ("models", models, MODELS)):
        if set(given) - set(known):
            parser.error(f"unknown {name} {sorted(set(given) - set(known))}; known: {known}")
    wanted = set(args.contenders.split(",")) if args.contenders else None

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    results: dict[tuple[str, str, str], list[quality_refs.Metrics]] = {}
    unavailable: set[str] = set()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="estuary-quality-") as tmp:
        runner = Runner(args, Path(tmp))
        for dataset in datasets:
            for model in models:
                for contender in CONTENDERS[model]:
                    if wanted is not None and contender not in wanted:
                        continue
                    if args.quick and contender in QUICK_SKIPS:
                        continue
                    if not available(contender):
                        unavailable.add(contender)
                        continue
                    for seed in seeds:
                        t0 = time.perf_counter()
                        m = runner.run(dataset, model, contender, seed)
                        results.setdefault((dataset, model, contender), []).append(m)
                        print(
                            f"{dataset:<7}{model:<7}{contender:<18} seed {seed}  "
                            f"AUC {m.auc:.4f}  logloss {m.logloss:.4f}  "
                            f"({time.perf_counter() - t0:.0f} s)",
                            file=sys.stderr,
                        )
    report(results, unavailable, seeds, args, time.perf_counter() - t_start)


def mean_auc(runs: list[quality_refs.Metrics]) -> float:
    return statistics.fmean(m.auc for m in runs)


def gaps(results: dict[tuple[str, str, str], list[quality_refs.Metrics]]) -> dict[str, Any]:
    """The headline figures; per (dataset, model) and worst case."""
    out: dict[str, Any] = {"per_model": {}}
    worst: float | None = None
    mode_gaps: dict[str, dict[str, float]] = {
        "hybrid": {},
        "hybrid_bg": {},
        "async": {},
        "async_bg": {},
        "rowwise_fp32": {},
        "rowwise_bf16": {},
    }
    cells = sorted({(d, m) for d, m, _ in results})
    for dataset, model in cells:
        ours = results.get((dataset, model, "estuary"))
        refs = {
            c: mean_auc(r)
            for (d, m, c), r in results.items()
            if (d, m) == (dataset, model) and c not in ESTUARY_MODES
        }
        if ours and refs:
            best = max(refs, key=refs.__getitem__)
            gap = refs[best] - mean_auc(ours)
            out["per_model"][f"{dataset}.{model}"] = {"best_reference": best, "auc_gap": gap}
            worst = gap if worst is None else max(worst, gap)
        for mode in mode_gaps:
            other = results.get((dataset, model, f"estuary_{mode}"))
            if ours and other:
                mode_gaps[mode][f"{dataset}.{model}"] = mean_auc(other) - mean_auc(ours)
    out["auc_gap_vs_best"] = worst
    out["mode_gaps"] = mode_gaps
    # Hybrid: the larger |gap| of the policy's placement and forced background threads.
    hybrid = [*mode_gaps["hybrid"].values(), *mode_gaps["hybrid_bg"].values()]
    out["hybrid_minus_sync_auc"] = max(hybrid, key=abs) if hybrid else None
    async_ = [*mode_gaps["async"].values(), *mode_gaps["async_bg"].values()]
    out["async_minus_sync_auc"] = max(async_, key=abs) if async_ else None
    # Row-wise Adagrad with bf16 rows minus full Adagrad with fp32 rows: the worst
    # (lowest) over datasets (floor: >= -0.001).
    rowwise = list(mode_gaps["rowwise_bf16"].values())
    out["rowwise_bf16_minus_fp32_auc"] = min(rowwise) if rowwise else None
    return out


def report(
    results: dict[tuple[str, str, str], list[quality_refs.Metrics]],
    unavailable: set[str],
    seeds: list[int],
    args: argparse.Namespace,
    wall_s: float,
) -> None:
    """Print the side-by-side table; write ``--json``."""
    print(f"seeds {','.join(map(str, seeds))}; mean AUC / logloss on each eval split")
    print(
        f"{'dataset':<8}{'model':<8}{'contender':<18}{'AUC':>8}{'logloss':>9}"
        f"{'vs estuary':>12}   AUC per seed"
    )
    for (dataset, model, contender), runs in results.items():
        auc = mean_auc(runs)
        ours = results.get((dataset, model, "estuary"))
        vs = f"{auc - mean_auc(ours):+.4f}" if ours and contender != "estuary" else ""
        logloss = statistics.fmean(m.logloss for m in runs)
        each = " ".join(f"{m.auc:.4f}" for m in runs)
        note = f"  ({runs[0].note})" if runs[0].note else ""
        name = f"{dataset:<8}{model:<8}{contender:<18}"
        print(f"{name}{auc:>8.4f}{logloss:>9.4f}{vs:>12}   {each}{note}")
    for name in sorted(unavailable):
        print(f"{name}: unavailable ({INSTALL_HINT})")
    headline = gaps(results)
    for key in HEADLINE:
        value = headline[key]
        print(f"{key:<30}{'-' if value is None else f'{value:+.4f}'}")
    for cell, info in headline["per_model"].items():
        print(f"  {cell}: best reference {info['best_reference']}, gap {info['auc_gap']:+.4f}")
    print(f"wall {wall_s:.0f} s")
    if args.json:
        payload = {
            "config": {
                "seeds": seeds,
                "threads": args.threads,
                "staleness": STALENESS,
                "rowwise_optimizer": ROWWISE_OPTIMIZER,
                "rowwise_lr": ROWWISE_LR,
                "set": args.set,
                "deepctr_lr": args.deepctr_lr or quality_refs.DEEPCTR_LR,
                "deepctr_shuffle": not args.deepctr_no_shuffle,
            },
            **{k: headline[k] for k in HEADLINE},
            "ratios": {k: headline[k] for k in HEADLINE},
            "per_model": headline["per_model"],
            "minus_sync_auc": headline["mode_gaps"],
            "figures": {
                f"{d}.{m}.{c}": {
                    "auc": mean_auc(runs),
                    "logloss": statistics.fmean(x.logloss for x in runs),
                    "auc_per_seed": [x.auc for x in runs],
                    "logloss_per_seed": [x.logloss for x in runs],
                }
                for (d, m, c), runs in results.items()
            },
            "unavailable": sorted(unavailable),
            "wall_s": wall_s,
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
