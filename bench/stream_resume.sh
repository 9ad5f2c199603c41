#!/usr/bin/env bash
# Issue 17's steps, for NATS and Redis, with a short and a long gap: replay the
# first 30,000 rows of the Criteo sample at the start of a minute, train until
# the idle timeout, wait GAP seconds, replay the last 4,578 rows, train --resume.
# Prints the resumed run's train_rows (expected: 4578 every time).
# Usage: bash bench/stream_resume.sh [GAP_S ...]   (default gaps: 3 70; ~8 min)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DATA="$ROOT/../shared/data/criteo_dac_sample_34k.tsv.gz"
GAPS=("${@:-3 70}"); read -r -a GAPS <<< "${GAPS[*]}"
WORK="$(mktemp -d)"; cd "$WORK"
zcat "$DATA" > all.tsv
head -30000 all.tsv > first.tsv
tail -n +30001 all.tsv > later.tsv
NATS="$(command -v nats-server || echo /usr/sbin/nats-server)"
"$NATS" -js -a 127.0.0.1 -p 14222 -sd "$WORK/nats" > nats.log 2>&1 &
redis-server --port 16379 --bind 127.0.0.1 --save '' --dir "$WORK" > redis.log 2>&1 &
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$WORK"' EXIT
sleep 1
for kind in nats redis; do
  for gap in "${GAPS[@]}"; do
    t="resume-$kind-$gap-$RANDOM"
    if [ "$kind" = nats ]; then
      url=nats://127.0.0.1:14222; target="subject: $t"
    else
      url=redis://127.0.0.1:16379; target="key: $t"
    fi
    cat > "$t.yaml" <<YAML
name: criteo-live
data:
  schema:
    label: label
    dense: [I1, I2, I3, I4, I5, I6, I7, I8, I9, I10, I11, I12, I13]
    sparse: [C1, C2, C3, C4, C5, C6, C7, C8, C9, C10, C11, C12, C13, C14, C15, C16,
             C17, C18, C19, C20, C21, C22, C23, C24, C25, C26]
  dataset:
    streams:
      live:
        sources:
          - name: clicks
            type: stream
            window_s: 60
            stream: {kind: $kind, url: "$url", $target, format: criteo_tsv}
    timer: {poll_interval_s: 1, idle_timeout_s: 5}
model:
  type: dlrm
  params: {bottom_mlp: [128, 64, 16], top_mlp: [64]}
  embedding:
    default: {dim: 16, optimizer: {name: adagrad, lr: 0.03}, admission: {min_count: 2}}
train: {batch_size: 256, epochs: 1, seed: 0}
output: {dir: run-$t, checkpoint_every_steps: 50}
YAML
    sleep $(( 60 - $(date +%-S) ))  # the start of a minute
    estuary replay first.tsv --to "$url/$t" --rate 0 > /dev/null
    estuary train "$t.yaml" --no-progress > /dev/null 2>&1
    sleep "$gap"
    estuary replay later.tsv --to "$url/$t" --rate 0 > /dev/null
    estuary train "$t.yaml" --no-progress --resume > /dev/null 2>&1
    python -c "import json; s = json.load(open('run-$t/summary.json')); print('$kind gap ${gap} s: train_rows', s['train_rows'], 'rows_committed', s['rows_committed'], 'duplicate_rows', s['duplicate_rows'])"
  done
done
