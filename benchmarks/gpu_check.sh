#!/usr/bin/env bash
# Every CUDA path moetrain has, in one run of under 14 minutes on one GPU, then one summary table.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]      (default OUT_DIR: benchmarks/results/gpu_check)
#
# Steps (each under its own time limit; the limits add up to 13.5 minutes):
#   1. the CUDA-marked tests (pytest -m cuda; a skipped or missing test counts as a failure), among them the
#      float8 routed experts through torchao's kernels and torch._scaled_grouped_mm within float8's bound
#      (tests/unit/test_float8_experts.py)
#   2. moetrain bench moe in bf16 on the GPU (expert implementations side by side)
#   3. moetrain bench train on configs/qwen3_moe_debug.toml, flex attention, bf16 (tokens/s, MFU, memory)
#   4. bf16 import parity against transformers (benchmarks/parity/hf_parity_bf16.py)
#   5. float8 (train.float8 = "rowwise": torchao's _scaled_mm for the linears, its rowwise float8 grouped GEMMs
#      for the routed experts) against bf16 on qwen3_moe_debug (step 3 is its
#      bf16 row) and on the DeepSeek-V3 debug preset (a bf16 row and a float8 row), then their tokens/s and
#      MFU ratios; MFU keeps the bf16 peak as its denominator, so float8's gain shows as a higher MFU
# A step that fails is reported and the others still run; the script exits 1 when any failed,
# printing FAILED in the table and the tail of that step's log. Run it from the repository root
# with the project's environment (.venv, or PYTHON=... / MOETRAIN=...).
set -uo pipefail

cd "$(dirname "$0")/.."
# The benchmark scripts import each other as the `benchmarks` package (benchmarks/parity/...).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${1:-benchmarks/results/gpu_check}"
PYTHON="${PYTHON:-.venv/bin/python}"
MOETRAIN="${MOETRAIN:-.venv/bin/moetrain}"
DEVICE="${DEVICE:-cuda}"  # DEVICE=cpu: the same steps on the CPU, to check this script where no GPU is
mkdir -p "$OUT"

if [ "$DEVICE" = "cuda" ] && ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: FAILED: torch sees no CUDA device ($("$PYTHON" -c 'import torch; print(torch.__version__)' 2>&1))" >&2
    exit 1
fi
[ "$DEVICE" = "cuda" ] && "$PYTHON" -c "import torch; p = torch.cuda.get_device_properties(0); \
print(f'gpu_check: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}')"

NAMES=()
STATUS=()
SECONDS_TAKEN=()
FAILED=0

# run_step NAME TIMEOUT_S COMMAND...: runs it with its log in $OUT/NAME.log, records status and time.
run_step() {
    local name="$1" limit="$2"
    shift 2
    echo "gpu_check: [$name] $*"
    local start end rc
    start=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    end=$(date +%s)
    NAMES+=("$name")
    SECONDS_TAKEN+=("$((end - start))")
    if [ "$rc" -eq 0 ]; then
        STATUS+=("ok")
    else
        if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then STATUS+=("FAILED (timeout ${limit}s)"); else STATUS+=("FAILED (exit $rc)"); fi
        FAILED=1
        echo "gpu_check: [$name] FAILED, last lines of $OUT/$name.log:" >&2
        tail -n 25 "$OUT/$name.log" >&2
    fi
}

run_step cuda_tests 120 "$PYTHON" -m pytest -q -m cuda -p no:cacheprovider -rs tests
# pytest exits 0 when every selected test is skipped (5 when none is selected): a GPU run must run them.
if [ "${STATUS[-1]}" = "ok" ] && grep -Eq "skipped|no tests ran" "$OUT/cuda_tests.log"; then
    STATUS[-1]="FAILED (tests skipped)"
    FAILED=1
    grep -E "SKIPPED|skipped" "$OUT/cuda_tests.log" >&2
fi

run_step bench_moe_bf16 90 "$MOETRAIN" bench moe --device "$DEVICE" --dtype bfloat16 --json "$OUT/bench_moe_bf16.json"

run_step bench_train_flex_bf16 150 "$MOETRAIN" bench train --config configs/qwen3_moe_debug.toml \
    --model.attention flex --parallel.param_dtype bfloat16 --parallel.device "$DEVICE" \
    --steps 20 --json "$OUT/bench_train_flex_bf16.json"

run_step bench_train_flex_float8 120 "$MOETRAIN" bench train --config configs/qwen3_moe_debug.toml \
    --model.attention flex --parallel.param_dtype bfloat16 --parallel.device "$DEVICE" --train.float8 rowwise \
    --steps 20 --json "$OUT/bench_train_flex_float8.json"

for precision in bf16 float8; do
    extra=()
    [ "$precision" = "float8" ] && extra=(--train.float8 rowwise)
    run_step "bench_train_dsv3_$precision" 120 "$MOETRAIN" bench train --config configs/deepseek_v3_debug.toml \
        --model.attention flex --parallel.param_dtype bfloat16 --parallel.device "$DEVICE" "${extra[@]}" \
        --steps 20 --json "$OUT/bench_train_dsv3_$precision.json"
done

# float8 / bf16 ratios of tokens/s and MFU (printed; the table below shows each row's own numbers).
"$PYTHON" - "$OUT" <<'PY' | tee "$OUT/float8_ratios.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for model, bf16, float8 in (("qwen3_moe_debug", "bench_train_flex_bf16", "bench_train_flex_float8"),
                            ("deepseek_v3_debug", "bench_train_dsv3_bf16", "bench_train_dsv3_float8")):
    try:
        a, b = (json.loads((out / f"{name}.json").read_text()) for name in (bf16, float8))
    except (OSError, ValueError):
        print(f"gpu_check: float8 vs bf16 on {model}: missing a row")
        continue
    print(f"gpu_check: float8 rowwise vs bf16 on {model}: tokens/s {b['tokens_per_s']:.0f} / {a['tokens_per_s']:.0f} "
          f"= {b['tokens_per_s'] / a['tokens_per_s']:.3f}x, MFU {100 * b['mfu']:.2f}% / {100 * a['mfu']:.2f}%")
PY

run_step hf_parity_bf16 90 "$PYTHON" benchmarks/parity/hf_parity_bf16.py --device "$DEVICE" --json "$OUT/hf_parity_bf16.json"

# One table: step, status, seconds, and the headline numbers of each step's JSON (whatever scalars it holds).
echo
printf '%-24s %-24s %6s  %s\n' "step" "status" "s" "numbers"
for i in "${!NAMES[@]}"; do
    name="${NAMES[$i]}"
    numbers=$("$PYTHON" - "$OUT" "$name" <<'PY' 2>/dev/null
import json, sys
from pathlib import Path
out, name = Path(sys.argv[1]), sys.argv[2]
if name == "cuda_tests":
    log = (out / "cuda_tests.log").read_text().strip().splitlines()
    print(log[-1] if log else "")
    sys.exit()
path = out / f"{name}.json"
if not path.is_file():
    sys.exit()
data = json.loads(path.read_text())
flat = {}
def walk(prefix, value):
    if isinstance(value, dict):
        for key, item in value.items():
            walk(f"{prefix}.{key}" if prefix else key, item)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        flat[prefix] = value
walk("", data)
wanted = ("tokens_per_s", "mfu", "peak", "memory", "ratio", "max_rel", "time", "ms")
keys = [k for k in flat if any(w in k.lower() for w in wanted)][:8]
print("; ".join(f"{k}={flat[k]:.4g}" for k in keys))
PY
)
    printf '%-24s %-24s %6s  %s\n' "$name" "${STATUS[$i]}" "${SECONDS_TAKEN[$i]}" "$numbers"
done
echo
if [ "$FAILED" -ne 0 ]; then
    echo "gpu_check: FAILED (logs in $OUT/)" >&2
    exit 1
fi
echo "gpu_check: all CUDA paths ran (results in $OUT/)"
