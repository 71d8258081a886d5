#!/bin/bash
# Peak RSS per rank and step time, full fine-tuning then LoRA r16 (attention, experts, router): 4 gloo ranks
# (FSDP 4), qwen3_moe_debug, 1 x 128 tokens per rank. OUT=DIR VENV=.venv benchmarks/profile/lora_memory_4ranks.sh
# (reports: OUT/lora_memory_4ranks_{full,lora}.json). A benchmark: asserts nothing.
cd "$(dirname "$0")/../.."
for mode in full lora; do
  extra=""
  if [ $mode = lora ]; then extra="--lora.rank 16 --lora.targets attention experts router"; fi
  PYTHONPATH=$PWD/src timeout 900 nice -n 5 "${VENV:-.venv}/bin/torchrun" --standalone --nproc-per-node 4 -m moetrain bench train --config configs/qwen3_moe_debug.toml --data.seq_len 128 --train.microbatch_size 1 --train.grad_accum 1 --data.max_documents 300 --train.num_threads 1 --steps 2 --warmup 1 --json "${OUT:-/tmp}/lora_memory_4ranks_$mode.json" $extra > "${OUT:-/tmp}/lora_memory_4ranks_$mode.log" 2>&1
  echo "$mode rc=$?"
done
