#!/usr/bin/env bash
# Reproduces the `bench sync` / `simulate` results quoted in docs/bench_sync.md.
# Each `bench sync` spawns its own 4 gloo ranks on this CPU host (2 x 2 mesh) and takes a few minutes.
set -euo pipefail
cd "$(dirname "$0")/../.."
M=".venv/bin/python -m moetrain"
R=benchmarks/results

# sleep model, bimodal 40/160 ms (ratio 4, p = 0.5): accumulation 2, 4, 8
for acc in 2 4 8; do
  steps=$([ "$acc" = 8 ] && echo 24 || echo 30)
  $M bench sync --accum "$acc" --steps "$steps" --json "$R/sync_sleep_bimodal_2x2_acc$acc.json" \
    | tee "$R/sync_sleep_bimodal_2x2_acc$acc.txt"
done
# a different spread (ratio 2: 40/80 ms) at accumulation 8
$M bench sync --accum 8 --steps 24 --cost.ratio 2 --figure "$R/sync_sleep_bimodal_ratio2_2x2_acc8.png" \
  --json "$R/sync_sleep_bimodal_ratio2_2x2_acc8.json" | tee "$R/sync_sleep_bimodal_ratio2_2x2_acc8.txt"
# zero variance: every microbatch of every group sleeps 100 ms
$M bench sync --accum 8 --steps 24 --cost.distribution constant --cost.short 0.1 \
  --json "$R/sync_sleep_constant_2x2_acc8.json" | tee "$R/sync_sleep_constant_2x2_acc8.txt"
# real compute: 1 or 4 samples per microbatch (batch), 64- or 1024-token documents (packed)
$M bench sync --cost-model batch --cost.short 1 --cost.ratio 4 --dim 256 --hidden 1024 --seq-len 64 \
  --accum 4 --steps 16 --json "$R/sync_batch_bimodal_2x2_acc4.json" | tee "$R/sync_batch_bimodal_2x2_acc4.txt"
$M bench sync --cost-model packed --cost.short 64 --cost.ratio 16 --packed-tokens 1024 --accum 4 --steps 12 \
  --json "$R/sync_packed_bimodal_2x2_acc4.json" | tee "$R/sync_packed_bimodal_2x2_acc4.txt"

$M bench sync --summarize "$R"/sync_sleep_*.json "$R"/sync_batch_*.json "$R"/sync_packed_*.json \
  --figure "$R/sync_summary.png" | tee "$R/sync_summary.md"

# cluster scale: 64 replica groups x 8 shards, accumulation 16
$M simulate --replicate 64 --shard 8 --accum 16 --cost.distribution lognormal --cost.short 0.5 --cost.cv 0.3 \
  --json "$R/simulate_64x8_acc16_lognormal_cv0.3.json" --figure "$R/simulate_64x8_acc16_lognormal_cv0.3.png" \
  | tee "$R/simulate_64x8_acc16_lognormal_cv0.3.txt"
