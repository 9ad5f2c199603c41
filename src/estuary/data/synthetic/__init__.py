"""Synthetic CTR data: Zipf-distributed ids, a drifting latent click model, hourly
partitions; from thousands to hundreds of millions of rows.

    spec = SyntheticSpec(rows_per_hour=100_000, hours=48, seed=7, drift=0.5)
    for chunk in generate_chunks(spec, spec.start_hour):    # in memory, <= chunk_rows
        chunk.labels, chunk.dense, chunk.sparse              # (B,), (B, Dd), (B, F)
    report = write_synthetic(spec, "data/synth", SynthOutput(gzip=True), workers=4)
    # data/synth/20260101/00/part-00000.tsv.gz + _SUCCESS, ... (Criteo TSV layout)

What the data looks like:
- **Columns**: ``label``, dense ``I1..I{Dd}`` (non-negative counts, lognormal-ish,
  correlated through a per-row activity), sparse ``C1..C{F}`` (8 hex digits),
  some values empty. Default shape and vocabularies are Criteo's.
- **Ids**: value k of a column (k = 1..vocab) appears with probability
  ~ ``k ** -zipf_exponent``; ranks go through a keyed 32-bit bijection, so ids
  look random and never collide.
- **Clicks**: ``label ~ Bernoulli(sigmoid(logit))``; the logit sums per-value
  weights, a few pairwise value interactions (rank-4 factors) and a nonlinear
  dense term, plus a time-of-day cycle; its bias is solved for ``base_ctr``.
- **Drift**: ``drift_fraction`` of the values have weights that wander smoothly
  (independent every ``drift_period_hours``), so a model fit on early hours
  loses AUC on later ones and training on fresh hours pays.

Reproducibility: every value is a hash of (seed, hour, row, column) or of
(seed, feature, value), so an hour's rows depend on the spec's model fields,
``rows_per_hour`` and the hour only: not on ``hours``/``start``, generation order,
chunk size or worker count. Results are bit-identical for one numpy version and
CPU family (transcendental functions may differ in the last ulp elsewhere).

Memory is one chunk (``chunk_rows`` rows, ~1.1 KB per Criteo-shaped row while
generating and formatting) per worker.
"""

from estuary.data.synthetic.formats import (
    EXTRA_COLUMNS,
    SYNTHETIC_FORMATS,
    SyntheticFormat,
    chunk_table,
)
from estuary.data.synthetic.model import ClickModel, SyntheticChunk, generate_chunks, model_for
from estuary.data.synthetic.spec import (
    CRITEO_VOCAB_SIZES,
    DRIFT_KINDS,
    SyntheticSpec,
    epoch_hour,
    hour_datetime,
    parse_hour,
)
from estuary.data.synthetic.writers import (
    SUCCESS,
    PartitionResult,
    SynthOutput,
    SynthReport,
    partition_dir,
    write_partition,
    write_synthetic,
)

__all__ = [
    "CRITEO_VOCAB_SIZES",
    "DRIFT_KINDS",
    "EXTRA_COLUMNS",
    "SUCCESS",
    "SYNTHETIC_FORMATS",
    "ClickModel",
    "PartitionResult",
    "SynthOutput",
    "SynthReport",
    "SyntheticChunk",
    "SyntheticFormat",
    "SyntheticSpec",
    "chunk_table",
    "epoch_hour",
    "generate_chunks",
    "hour_datetime",
    "model_for",
    "parse_hour",
    "partition_dir",
    "write_partition",
    "write_synthetic",
]
