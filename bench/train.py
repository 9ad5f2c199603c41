"""Benchmark: Estuary's training loop against plain PyTorch, TorchRec and a dense-only bound.

    python bench/train.py [--json PATH] [--batches 50] [--warmup 5] [--rounds 5] [--threads 2]
                          [--contenders hybrid,sync,pytorch,torchrec,dense[,hybrid_bg,hybrid_bf16,
                                        hybrid_obs,local_2x2,ray_2x2]]

One model, one data set, every contender in the same run:

  hybrid     Estuary ``Trainer.fit`` with ``train.mode: hybrid`` (``--staleness``)
  sync       Estuary ``Trainer.fit`` with ``train.mode: sync``
  pytorch    26 ``nn.EmbeddingBag(num, 16, mode="sum", sparse=True)``, sparse
             Adagrad for the tables, Adam for the MLPs; ids pre-mapped to dense
             vocabulary indices and batches pre-built as tensors (its best case)
  torchrec   fbgemm's fused table-batched embedding (``SplitTableBatchedEmbedding
             BagsCodegen``, host memory, CPU compute, fused exact Adagrad) + the
             same MLPs with Adam; batches pre-built
  hybrid_bg  (only when asked for) hybrid with its sparse work forced onto
             background threads (``train.sparse_placement: background``),
             whatever the placement policy would choose
  hybrid_bf16 (only when asked for) hybrid with ``train.precision: bf16``: the
             dense forward/backward under bfloat16 autocast
  hybrid_obs (only when asked for) hybrid with observability on: Prometheus
             metrics served (``output.metrics_port: 0``) and scraped every
             second by a thread in the process (15x a usual scrape interval), and
             the time series written at its default cadence (every 0.25 s in a
             run this short); the other Estuary contenders run with both off
  local_2x2  (only when asked for) 2 trainers and 2 PS shards as local processes
             (``runtime.run``, hybrid, batch_size / 2 per trainer) over the
             warm-up and measured rows; rank 0's rows/s of its training loop
  ray_2x2    (only when asked for) the same as Ray actors on a local Ray instance
  ray_2x2_actor (only when asked for) ray_2x2 with the actor data plane
             (``runtime.ray.data_plane: actor``: Ray actor calls to the PS shards)
  ray_2x2_ew (only when asked for) ray_2x2 with an embedding worker per trainer
             (``runtime.embedding_workers``: pooled blocks instead of rows)
             ``--bag-len L`` (cluster contenders only): every sparse feature a
             bag of L ids, sum-pooled (multi-hot), the workload where a
             worker's pooling shrinks what travels to the trainer
  dense      the upper bound: the MLPs + interaction fed a fixed random (B, F, D)
             tensor (its gradient is computed, as every contender must), no
             embedding work at all

Model: DLRM (``estuary.nn.models.DLRM`` for every contender), 26 sparse features x
dim 16, bottom MLP 13-512-256-16, top MLP 512-256-1, batch 2048. Sparse
optimizer Adagrad lr 0.05, dense Adam lr 1e-3, BCE loss.

Data: synthetic Criteo-like rows made in-process from ``--seed``: 26 features
with vocabularies log-spaced from 1e3 to 1e6 ids, each feature's ids Zipf(a)
distributed over a random permutation of its vocabulary; 13 log-normal counts
(log1p-transformed); 0/1 labels. Estuary reads them from a Criteo TSV (so its
run includes its data path: hashing, ``TabularDataset.take``); the torch
contenders get the same rows' vocabulary indices.

Method: each contender runs in its own subprocess (fresh interpreter, same
``torch.set_num_threads``), one after another; ``--rounds`` rounds interleave
the contenders and each figure is the contender's best round (other processes on
a shared machine only slow a run down; each round also shows how many cores
others kept busy meanwhile, ~0 on a quiet machine; on a shared VM runs still
differ by ~10% at 0, hence 5 rounds, ~15 minutes in all). The torch contenders
time ``--batches`` steps after ``--warmup`` untimed ones; Estuary fits the
warm-up rows with one trainer, hands its tables, weights and optimizer state to a
second one (``state_dict``/``load_state_dict``) and times that one's
``Trainer.fit`` over the measured rows. So Estuary's figure includes its data
path, inserting the ids the warm-up did not see (the Zipf tail keeps bringing
new ones) and the final flush of in-flight sparse updates. Hybrid runs its sparse
work on background threads only where a core is free for them, else inline
(``estuary.train.placement``); the report says which it was.

TorchRec is a bench-only extra; install it with ``bash bench/install-extras.sh``:

    pip install --no-deps fbgemm-gpu-cpu==1.8.0 torchrec==1.8.0 -c <(echo torch==2.13.0)
    pip install tensordict torchmetrics==1.0.3 tqdm pyre-extensions iopath \\
        -c <(echo torch==2.13.0)

(never a plain ``pip install torchrec``: it pulls the CUDA builds). Without it the
torchrec contender is reported as unavailable and its ratio is left out.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

NUM_DENSE = 13
NUM_SPARSE = 26
DIM = 16
BOTTOM_MLP = (512, 256, DIM)
TOP_MLP = (512, 256)
SPARSE_LR = 0.05
DENSE_LR = 1e-3
# Plain PyTorch's sparse-gradient optimizers, by ``--pytorch-optimizer`` (torch.optim names).
SPARSE_OPTIMIZERS = {"adagrad": "Adagrad", "sparseadam": "SparseAdam"}
# Flags the driver hands on to each worker.
WORKER_ARGS = (
    "batches",
    "warmup",
    "batch_size",
    "threads",
    "staleness",
    "seed",
    "pytorch_optimizer",
    "checkpoint_every",
    "bag_len",
)
CONTENDERS = ("hybrid", "sync", "pytorch", "torchrec", "dense")
# Not run by default (``--contenders ...,hybrid_bg``): hybrid with its sparse work
# forced onto background threads, to check the placement policy's choice; the
# multi-process runtimes (2 trainers and 2 PS shards, local processes or Ray actors).
EXTRA_CONTENDERS = (
    "hybrid_bg",
    "hybrid_bf16",
    "hybrid_obs",
    "local_2x2",
    "ray_2x2",
    "ray_2x2_actor",
    "ray_2x2_ew",
)
# name -> (runtime.backend, runtime.ray.data_plane, embedding workers, times checkpoints too)
CLUSTER_CONTENDERS = {
    "local_2x2": ("local", "socket", False, True),
    "ray_2x2": ("ray", "socket", False, True),
    "ray_2x2_actor": ("ray", "actor", False, False),
    "ray_2x2_ew": ("ray", "socket", True, False),
}
INSTALL_HINT = "install with bench/install-extras.sh"


# -- data ------------------------------------------------------------------------------


def vocab_sizes() -> list[int]:
    """F vocabulary sizes, log-spaced from 1e3 to 1e6."""
    return [round(v) for v in np.geomspace(1e3, 1e6, NUM_SPARSE)]


def zipf_column(vocab: int, a: float, rows: int, rng: np.random.Generator) -> np.ndarray:
    """int64 (rows,) ids in [0, vocab): rank r drawn with probability ~ r**-a, ranks
    mapped to ids by a random permutation (hot ids are scattered, as after hashing)."""
    cdf = np.cumsum(np.arange(1, vocab + 1, dtype=np.float64) ** -a)
    cdf /= cdf[-1]
    ranks = np.minimum(np.searchsorted(cdf, rng.random(rows)), vocab - 1)
    return rng.permutation(vocab)[ranks].astype(np.int64)


def make_data(
    folder: Path, rows: int, warmup_rows: int, zipf_a: float, seed: int, bag_len: int = 1
) -> None:
    """Write the rows twice: ``rows.npz`` (vocabulary indices, transformed dense,
    labels) for the torch contenders, and Criteo TSVs for Estuary (``warm.tsv`` =
    the first ``warmup_rows``, ``measure.tsv`` = the rest). With ``bag_len`` L > 1
    only ``all.tsv`` for the cluster contenders: every sparse column a bag of L
    ids (``id|id|...``, each drawn as a single id is)."""
    rng = np.random.default_rng(seed)
    if bag_len > 1:
        bags = [
            zipf_column(v, zipf_a, rows * bag_len, rng).reshape(rows, bag_len)
            for v in vocab_sizes()
        ]
        counts = np.floor(rng.lognormal(mean=1.0, sigma=1.5, size=(rows, NUM_DENSE)))
        labels = (rng.random(rows) < 0.25).astype(np.int64)
        with (folder / "all.tsv").open("w") as out:
            for i in range(rows):
                fields = [str(labels[i]), *(str(int(c)) for c in counts[i])]
                fields += ["|".join(map(str, bag[i].tolist())) for bag in bags]
                out.write("\t".join(fields) + "\n")
        return
    ids = np.stack([zipf_column(v, zipf_a, rows, rng) for v in vocab_sizes()], axis=1)  # (R, F)
    counts = np.floor(rng.lognormal(mean=1.0, sigma=1.5, size=(rows, NUM_DENSE)))  # (R, Dd)
    labels = (rng.random(rows) < 0.25).astype(np.int64)
    dense = (np.sign(counts) * np.log1p(np.abs(counts))).astype(np.float32)  # Estuary's log1p
    np.savez(folder / "rows.npz", ids=ids, dense=dense, labels=labels.astype(np.float32))
    table = np.concatenate([labels[:, None], counts.astype(np.int64), ids], axis=1)  # (R, 40)
    np.savetxt(folder / "warm.tsv", table[:warmup_rows], fmt="%d", delimiter="\t")
    np.savetxt(folder / "measure.tsv", table[warmup_rows:], fmt="%d", delimiter="\t")


# -- contenders (each runs in a worker subprocess) -------------------------------------


def estuary_job(
    tsv: Path,
    out: Path,
    mode: str,
    args: argparse.Namespace,
    output: dict[str, Any] | None = None,
    **train: str,
) -> Any:
    from estuary.config import job_from_dict

    columns = [f"C{i}" for i in range(1, NUM_SPARSE + 1)]
    schema: dict[str, Any] = {
        "label": "label",
        "dense": [f"I{i}" for i in range(1, NUM_DENSE + 1)],
        "sparse": columns,
        "dense_transform": "log1p",
    }
    if args.bag_len > 1:  # multi-hot: each column a bag of ids, sum-pooled
        schema["sparse"] = []
        schema["features"] = [
            {"name": f"S{c[1:]}", "kind": "sequence", "columns": [c], "max_length": args.bag_len}
            for c in columns
        ]
    return job_from_dict(
        {
            "name": f"bench-{mode}",
            "data": {
                "sources": [{"path": str(tsv), "format": "criteo_tsv"}],
                "schema": schema,
                "eval_fraction": 0.0,
            },
            "model": {
                "type": "dlrm",
                "params": {"bottom_mlp": list(BOTTOM_MLP), "top_mlp": list(TOP_MLP)},
                "embedding": {
                    "default": {"dim": DIM, "optimizer": {"name": "adagrad", "lr": SPARSE_LR}}
                },
            },
            "train": {
                "batch_size": args.batch_size,
                "epochs": 1,
                "seed": args.seed,
                "mode": mode,
                "staleness": args.staleness,
                "threads": args.threads,
                "dense_optimizer": {"name": "adam", "lr": DENSE_LR},
                **train,
            },
            "output": {
                "dir": str(out),
                "checkpoint": False,
                "progress": False,
                "timeseries_every_s": None,
                **(output or {}),
            },
        }
    )


def run_estuary(
    mode: str,
    data: Path,
    args: argparse.Namespace,
    output: dict[str, Any] | None = None,
    **train: str,
) -> dict[str, Any]:
    """``Trainer.fit`` on the measured rows, continuing from a fit on the warm-up
    rows (tables, weights and optimizer handed over with the public
    ``state_dict``/``load_state_dict``, as a resumed run would). With
    ``output.metrics_port`` set, a thread scrapes ``/metrics`` every second
    while the measured fit runs."""
    import threading
    import urllib.request

    from estuary.data import TabularDataset
    from estuary.train import Trainer

    trainers = []
    for name in ("warm", "measure"):
        job = estuary_job(data / f"{name}.tsv", data / "out", mode, args, output, **train)
        trainers.append(Trainer(job, dataset=TabularDataset(job.data, job.base_dir)))
    warm, measured = trainers
    warm.fit(progress=False)
    for table_name, table in warm.tables.items():
        measured.tables[table_name].load_state_dict(table.state_dict())
    measured.model.load_state_dict(warm.model.state_dict())
    measured.optimizer.load_state_dict(warm.optimizer.state_dict())
    done, scrapes = threading.Event(), []

    def scrape() -> None:
        while not done.wait(1.0):
            url = measured.metrics.url
            if url is not None:
                try:
                    with urllib.request.urlopen(url, timeout=5) as response:
                        scrapes.append(len(response.read()))
                except OSError:  # the fit ended (the server closed) mid-scrape
                    return

    scraper = threading.Thread(target=scrape, daemon=True)
    if measured.job.output.metrics_port is not None:
        scraper.start()
    try:
        result = measured.fit(progress=False)
    finally:
        done.set()
        if scraper.is_alive():
            scraper.join()  # Blocking wait: at most one scrape's time
    return {
        "scrapes": len(scrapes),
        "placement": result.extra["sparse_placement"],
        "samples_per_s": result.samples_per_s,
        "steps": result.extra["steps"],
        "profile": result.profile,
        "max_staleness_seen": result.extra["max_staleness_seen"],
    }


def run_cluster(
    backend: str,
    plane: str,
    embedding_workers: bool,
    checkpoints: bool,
    data: Path,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """``estuary.runtime.run`` with 2 trainers (hybrid, ``--batch-size / 2`` rows
    each, so a step is still ``--batch-size`` rows; one torch thread each) and 2 PS
    shards, on the ``local`` or ``ray`` backend, over the warm-up and the measured
    rows together. The figure is rank 0's ``samples_per_s`` of a run without
    checkpoints: rows over the training loop's wall time, so process start-up
    (Ray's included) is not in it, while the first steps are, in both
    contenders alike. Two more runs checkpoint every ``--checkpoint-every`` steps,
    blocking and asynchronous (``output.checkpoint_async``): their mean training
    time per checkpoint is ``blocking_checkpoint_s`` and ``async_stall_s``."""
    from dataclasses import replace

    from estuary import runtime

    tsv = data / "all.tsv"
    if not tsv.exists():
        tsv.write_bytes((data / "warm.tsv").read_bytes() + (data / "measure.tsv").read_bytes())
    if backend == "ray":  # one local instance for the three runs (RayRuntime joins it)
        import ray

        ray.init(
            address="local", num_cpus=8, include_dashboard=False, logging_level=logging.WARNING
        )
    base = estuary_job(tsv, data / f"out-{backend}", "hybrid", args)
    job = replace(
        base,
        train=replace(base.train, batch_size=args.batch_size // 2, threads=1),
        runtime=replace(
            base.runtime,
            backend=backend,
            trainers=2,
            ps_shards=2,
            embedding_workers=embedding_workers,
            ray=replace(base.runtime.ray, data_plane=plane),
        ),
    )
    result = runtime.run(job, progress=False)
    per_checkpoint: dict[str, float] = {}
    for mode in ("blocking", "async") if checkpoints else ():
        output = replace(
            job.output,
            checkpoint=True,
            checkpoint_every_steps=args.checkpoint_every,
            checkpoint_async=mode == "async",
            dir=str(data / f"ckpt-{backend}-{mode}"),
        )
        timed = runtime.run(replace(job, output=output), progress=False).extra
        per_checkpoint[mode] = timed["checkpoint_stall_s"] / max(1, timed["checkpoints"])
        per_checkpoint[f"{mode}_write"] = timed["checkpoint_write_s"] / max(1, timed["checkpoints"])
    figures = {
        "placement": result.extra["sparse_placement"],
        "samples_per_s": result.samples_per_s,
        "steps": result.extra["steps"],
        "profile": result.profile,
        "max_staleness_seen": result.extra.get("max_staleness_seen"),
    }
    if checkpoints:
        figures["blocking_checkpoint_s"] = per_checkpoint["blocking"]
        figures["async_stall_s"] = per_checkpoint["async"]
        figures["async_write_s"] = per_checkpoint["async_write"]
    return figures


class TorchBatches:
    """The measured rows as ready tensors: dense (B, Dd), labels (B,), ids (F, B)."""

    def __init__(self, data: Path, batch_size: int) -> None:
        import torch

        rows = np.load(data / "rows.npz")
        n = rows["labels"].shape[0] // batch_size
        self.dense = [torch.from_numpy(d) for d in np.split(rows["dense"][: n * batch_size], n)]
        self.labels = [torch.from_numpy(y) for y in np.split(rows["labels"][: n * batch_size], n)]
        ids = rows["ids"][: n * batch_size]  # (R, F)
        self.ids = [torch.from_numpy(np.ascontiguousarray(b.T)) for b in np.split(ids, n)]

    def __len__(self) -> int:
        return len(self.labels)


def time_steps(
    step: Callable[[int], float], batches: int, warmup: int, batch_size: int
) -> dict[str, Any]:
    """Samples/s of ``step(i)`` over batches ``warmup .. warmup + batches``."""
    for i in range(warmup):
        step(i)
    t0 = time.perf_counter()
    for i in range(warmup, warmup + batches):
        step(i)
    wall_s = time.perf_counter() - t0
    return {"samples_per_s": batches * batch_size / wall_s, "steps": batches}


def run_torch(kind: str, data: Path, args: argparse.Namespace) -> dict[str, Any]:
    """pytorch / torchrec / dense: the same DLRM, differing only in the embeddings."""
    import torch
    from torch import nn

    from estuary.nn.models import DLRM

    torch.manual_seed(args.seed)
    batches = TorchBatches(data, args.batch_size)
    b, f = args.batch_size, NUM_SPARSE
    model = DLRM(NUM_DENSE, f, DIM, bottom_mlp=BOTTOM_MLP, top_mlp=TOP_MLP)
    optimizers: list[torch.optim.Optimizer] = [torch.optim.Adam(model.parameters(), lr=DENSE_LR)]
    loss_fn = nn.BCEWithLogitsLoss()
    embed: Callable[[torch.Tensor], torch.Tensor]

    if kind == "pytorch":
        tables = nn.ModuleList(
            nn.EmbeddingBag(v, DIM, mode="sum", sparse=True) for v in vocab_sizes()
        )
        sparse_opt = getattr(torch.optim, SPARSE_OPTIMIZERS[args.pytorch_optimizer])
        optimizers.append(sparse_opt(list(tables.parameters()), lr=SPARSE_LR))
        offsets = torch.arange(b)

        def embed(ids: torch.Tensor) -> torch.Tensor:  # ids (F, B) -> (B, F, D)
            return torch.stack([t(ids[k], offsets) for k, t in enumerate(tables)], dim=1)

    elif kind == "torchrec":
        tbe = make_tbe()
        tbe_offsets = torch.arange(f * b + 1)

        def embed(ids: torch.Tensor) -> torch.Tensor:
            # Feature-major bags (F*B of one id each) -> (B, F*D): table k's at [k*D, (k+1)*D).
            return tbe(ids.reshape(-1), tbe_offsets).view(b, f, DIM)

    else:
        # A leaf that wants a gradient: the interaction's backward to the
        # embeddings is work every real contender does; only the lookup,
        # pooling and table update are left out.
        fixed = torch.randn(b, f, DIM, requires_grad=True)

        def embed(ids: torch.Tensor) -> torch.Tensor:
            fixed.grad = None
            return fixed

    def step(i: int) -> float:
        k = i % len(batches)
        sparse = embed(batches.ids[k])  # (B, F, D)
        loss = loss_fn(model(batches.dense[k], sparse), batches.labels[k])
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        loss.backward()  # torchrec: the fused TBE updates its tables here
        for opt in optimizers:
            opt.step()
        return float(loss.detach())

    return time_steps(step, args.batches, args.warmup, args.batch_size)


def make_tbe() -> Any:
    """fbgemm's fused CPU table-batched EmbeddingBag, one table per feature."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        EmbeddingLocation,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    return SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[
            (v, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU) for v in vocab_sizes()
        ],
        optimizer=EmbOptimType.EXACT_ADAGRAD,
        learning_rate=SPARSE_LR,
        eps=1e-8,
        pooling_mode=PoolingMode.SUM,
    )


def torchrec_available() -> bool:
    try:
        import fbgemm_gpu  # noqa: F401
        import torchrec  # noqa: F401
    except Exception:  # an ImportError, or a broken build raising anything else
        return False
    return True


def worker(args: argparse.Namespace) -> None:
    """Run one contender and print its result as the last stdout line (JSON)."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    data = Path(args.data)
    if args.worker == "hybrid_bg":
        result = run_estuary("hybrid", data, args, sparse_placement="background")
    elif args.worker == "hybrid_bf16":
        result = run_estuary("hybrid", data, args, precision="bf16")
    elif args.worker == "hybrid_obs":
        observed = {"metrics_port": 0, "timeseries_every_s": 10.0}  # the default
        result = run_estuary("hybrid", data, args, output=observed)
    elif args.worker in CLUSTER_CONTENDERS:
        result = run_cluster(*CLUSTER_CONTENDERS[args.worker], data, args)
    elif args.worker in ("hybrid", "sync"):
        result = run_estuary(args.worker, data, args)
    elif args.worker == "torchrec" and not torchrec_available():
        result = {"unavailable": True}
    else:
        result = run_torch(args.worker, data, args)
    result["threads"] = torch.get_num_threads()
    print(json.dumps(result))


# -- driver ----------------------------------------------------------------------------


def cpu_busy_s() -> float | None:
    """CPU seconds all processes have been busy since boot (Linux ``/proc/stat``)."""
    try:
        first = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    ticks = [int(x) for x in first[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def wait_for_quiet(max_wait_s: float, idle_share: float = 0.85, window_s: float = 2.0) -> None:
    """Wait (at most ``max_wait_s``) until other processes leave the CPUs idle:
    ``idle_share`` of all CPU time idle over a ``window_s`` sample."""
    deadline = time.perf_counter() + max_wait_s
    cores = os.cpu_count() or 1
    while time.perf_counter() < deadline:
        busy0 = cpu_busy_s()
        if busy0 is None:
            return
        time.sleep(window_s)
        busy1 = cpu_busy_s()
        if busy1 is not None and (busy1 - busy0) <= (1 - idle_share) * window_s * cores:
            return


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_contender(name: str, data: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One contender in a fresh interpreter; adds ``others_cores``: the CPU cores
    other processes kept busy meanwhile (a noise gauge: ~0 on a quiet machine)."""
    cmd = [sys.executable, __file__, "--worker", name, "--data", str(data)]
    for key in WORKER_ARGS:
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    busy0, ours0, t0 = cpu_busy_s(), children_cpu_s(), time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    busy1, ours1, wall_s = cpu_busy_s(), children_cpu_s(), time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"contender {name} failed:\n{proc.stderr[-4000:]}")
    result = dict(json.loads(proc.stdout.strip().splitlines()[-1]))
    if busy0 is not None and busy1 is not None:
        result["others_cores"] = max(0.0, (busy1 - busy0) - (ours1 - ours0)) / wall_s
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write figures and ratios here")
    parser.add_argument("--batches", type=int, default=50, help="timed steps per contender")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved repeats; best kept")
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads, all")
    parser.add_argument("--staleness", type=int, default=4, help="hybrid's train.staleness")
    parser.add_argument(
        "--pytorch-optimizer",
        choices=sorted(SPARSE_OPTIMIZERS),
        default="adagrad",
        help="plain PyTorch's table optimizer",
    )
    parser.add_argument(
        "--quiet-wait-s",
        type=float,
        default=60.0,
        help="before each run, wait up to this long for other processes to idle",
    )
    parser.add_argument(
        "--max-others-cores",
        type=float,
        default=0.2,
        help="rerun a contender whose best run had others busier than this",
    )
    parser.add_argument("--retries", type=int, default=3, help="such reruns per contender")
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=5,
        help="local_2x2 / ray_2x2: steps between checkpoints in their checkpoint runs",
    )
    parser.add_argument("--zipf-a", type=float, default=1.1)
    parser.add_argument(
        "--bag-len",
        type=int,
        default=1,
        help="ids per sparse feature (multi-hot bags, sum-pooled); > 1: cluster contenders only",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--contenders", default=",".join(CONTENDERS), help="comma-separated subset to run"
    )
    parser.add_argument("--worker", choices=CONTENDERS + EXTRA_CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    names = [c for c in args.contenders.split(",") if c]
    known = CONTENDERS + EXTRA_CONTENDERS
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"unknown contenders {unknown}; known: {list(known)}")
    if args.bag_len > 1 and set(names) - set(CLUSTER_CONTENDERS):
        parser.error(f"--bag-len > 1 runs cluster contenders only: {list(CLUSTER_CONTENDERS)}")
    rows = (args.warmup + args.batches) * args.batch_size
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="estuary-bench-") as tmp:
        data = Path(tmp)
        warmup_rows = args.warmup * args.batch_size
        make_data(data, rows, warmup_rows, args.zipf_a, args.seed, args.bag_len)
        for r in range(args.rounds):
            for name in names:
                run_logged(name, data, args, runs, f"round {r + 1}/{args.rounds}")
        # A figure is only as good as its quietest run: retry contenders whose
        # best run shared the CPUs with other processes.
        for retry in range(args.retries):
            noisy = [n for n in names if best_run_noise(runs[n]) > args.max_others_cores]
            for name in noisy:
                run_logged(name, data, args, runs, f"retry {retry + 1}/{args.retries}")
    report(runs, args)


def run_logged(
    name: str,
    data: Path,
    args: argparse.Namespace,
    runs: dict[str, list[dict[str, Any]]],
    label: str,
) -> None:
    wait_for_quiet(args.quiet_wait_s)
    result = run_contender(name, data, args)
    runs[name].append(result)
    shown = (
        "unavailable" if result.get("unavailable") else f"{result['samples_per_s']:,.0f} samples/s"
    )
    others = result.get("others_cores")
    noise = "" if others is None else f"  (others busy: {others:.2f} cores)"
    print(f"{label}  {name:<9} {shown}{noise}", file=sys.stderr)


def best_run_noise(results: list[dict[str, Any]]) -> float:
    """Cores other processes kept busy during a contender's fastest run (0 when
    unavailable or not measurable)."""
    measured = [r for r in results if not r.get("unavailable")]
    if not measured:
        return 0.0
    return float(max(measured, key=lambda r: r["samples_per_s"]).get("others_cores") or 0.0)


def report(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    """Print the side-by-side table; write ``--json``. A contender's figure is its
    best round: other processes on a shared machine only ever slow a run down."""
    figures: dict[str, float] = {}
    unavailable = []
    for name, results in runs.items():
        if any(r.get("unavailable") for r in results):
            unavailable.append(name)
            continue
        figures[name] = max(r["samples_per_s"] for r in results)
    ratios: dict[str, float] = {}
    if "hybrid" in figures:
        for other, key in (
            ("pytorch", "hybrid_vs_pytorch"),
            ("torchrec", "hybrid_vs_torchrec"),
            ("dense", "hybrid_vs_dense_bound"),
            ("sync", "hybrid_vs_sync"),
        ):
            if other in figures:
                ratios[key] = figures["hybrid"] / figures[other]
        for variant in ("hybrid_bf16", "hybrid_obs"):
            if variant in figures:
                ratios[f"{variant}_vs_hybrid"] = figures[variant] / figures["hybrid"]
    if "local_2x2" in figures and "ray_2x2" in figures:
        ratios["ray_vs_local_2x2"] = figures["ray_2x2"] / figures["local_2x2"]
    if "ray_2x2" in figures and "ray_2x2_actor" in figures:
        ratios["actor_vs_socket_plane"] = figures["ray_2x2_actor"] / figures["ray_2x2"]
    if "ray_2x2" in figures and "ray_2x2_ew" in figures:
        ratios["embedding_workers_vs_direct"] = figures["ray_2x2_ew"] / figures["ray_2x2"]
    stalls = [
        (min(r["async_stall_s"] for r in runs[n]), min(r["blocking_checkpoint_s"] for r in runs[n]))
        for n in ("local_2x2", "ray_2x2")
        if n in figures
    ]
    if stalls:  # the worse contender's best rounds: an async stall over a blocking checkpoint
        ratios["async_checkpoint_stall"] = max(stall / block for stall, block in stalls)

    print(
        f"DLRM F={NUM_SPARSE} D={DIM} bottom 13-{'-'.join(map(str, BOTTOM_MLP))} "
        f"top {'-'.join(map(str, (NUM_SPARSE * (NUM_SPARSE + 1) // 2 + DIM, *TOP_MLP, 1)))} "
        f"batch {args.batch_size}; {args.batches} timed batches after {args.warmup}; "
        f"threads {args.threads}; zipf a={args.zipf_a}; best of {args.rounds} rounds"
    )
    print(
        f"{'contender':<10}{'samples/s':>12}{'ms/step':>10}{'hybrid is':>11}   rounds (others busy)"
    )
    for name, results in runs.items():
        if name in unavailable:
            print(f"{name:<10}  unavailable ({INSTALL_HINT})")
            continue
        rate = figures[name]
        vs = f"{figures['hybrid'] / rate:.2f}x" if "hybrid" in figures else "-"
        each = " ".join(
            f"{r['samples_per_s']:,.0f}"
            + (f" ({r['others_cores']:.2f})" if "others_cores" in r else "")
            for r in results
        )
        print(f"{name:<10}{rate:>12,.0f}{1e3 * args.batch_size / rate:>10.1f}{vs:>11}   {each}")
    for key, value in ratios.items():
        print(f"{key:<24}{value:.2f}x")
    noisy = [n for n in figures if best_run_noise(runs[n]) > args.max_others_cores]
    for name in noisy:
        print(
            f"note: {name}'s best run shared the CPUs with other processes "
            f"({best_run_noise(runs[name]):.2f} cores busy); its figure is a lower bound"
        )
    for name in ("local_2x2", "ray_2x2"):
        if name in figures:
            print(
                f"{name}: checkpoint every {args.checkpoint_every} steps, per checkpoint "
                "(best round): blocking "
                f"{min(r['blocking_checkpoint_s'] for r in runs[name]) * 1e3:.0f} ms, "
                f"asynchronous stall {min(r['async_stall_s'] for r in runs[name]) * 1e3:.0f} ms "
                f"(written in {min(r['async_write_s'] for r in runs[name]) * 1e3:.0f} ms)"
            )
    for name in ("hybrid", "hybrid_bg", "hybrid_bf16", "hybrid_obs", "sync", *CLUSTER_CONTENDERS):
        if name in figures:
            best = max(runs[name], key=lambda r: r["samples_per_s"])
            print(
                f"{name}: sparse work {best['placement']}; stage seconds (best round): "
                f"{best['profile']}"
            )
    if args.json:
        payload = {
            "config": {
                "batch_size": args.batch_size,
                "batches": args.batches,
                "warmup": args.warmup,
                "rounds": args.rounds,
                "threads": args.threads,
                "staleness": args.staleness,
                "pytorch_optimizer": args.pytorch_optimizer,
                "zipf_a": args.zipf_a,
                "bag_len": args.bag_len,
                "seed": args.seed,
                "vocab_sizes": vocab_sizes(),
            },
            "figures": {f"{name}.samples_per_s": rate for name, rate in figures.items()},
            "ratios": ratios,
            "unavailable": unavailable,
            "noisy": noisy,
            "rounds": {
                name: [
                    {
                        k: r[k]
                        for k in (
                            "samples_per_s",
                            "others_cores",
                            "scrapes",
                            "placement",
                            "profile",
                            "blocking_checkpoint_s",
                            "async_stall_s",
                            "async_write_s",
                        )
                        if k in r
                    }
                    for r in rs
                ]
                for name, rs in runs.items()
            },
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
