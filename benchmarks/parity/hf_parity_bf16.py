"""bf16 import parity: moetrain's imported model in bfloat16 is no further from the exact logits than transformers'.

    .venv/bin/python benchmarks/parity/hf_parity_bf16.py [--device cuda] [--layers 2] [--json PATH]

For each family (Qwen3-MoE and OLMoE at the presets' widths, random weights, as in
benchmarks/parity/hf_parity.py): the reference is transformers' model in float32 on the CPU (its
grouped GEMM has no float64);
moetrain imports the saved directory (`load_hf`) and runs in bfloat16 on `--device`, and so
does transformers' own model. bf16 keeps 8 significant bits, so neither matches the reference
closely; the check is relative: moetrain's max |diff| / max |logit| must stay within 2x
transformers' own bf16 error (both round the same weights to bf16, so a wrong conversion or a
bf16-specific bug shows up as a much larger error), and moetrain's logits must come out in bf16
(a silent float32 path would pass the first test for the wrong reason). Measured on the CPU
(1 layer): moetrain 0.87x and 0.72x of transformers' error (Qwen3-MoE, OLMoE).
Exits 1 when a family fails, so scripts (benchmarks/gpu_check.sh) stop on it.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from benchmarks.parity.hf_parity import diff, hf_model, saved_and_loaded

from moetrain.args import take_option

BOUND = 2.0  # moetrain's bf16 error over transformers' bf16 error, at most


def measure(family: str, layers: int, device: str, work: Path) -> dict[str, float]:
    reference = hf_model(family, layers)
    model, _ = saved_and_loaded(reference, work / family)
    tokens = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        exact = reference(tokens).logits  # float32: ~1e-6 relative, far below bf16 rounding (~4e-3)
        theirs = reference.to(device=device, dtype=torch.bfloat16)(tokens.to(device)).logits.cpu()
        ours = model.to(device=device, dtype=torch.bfloat16)(tokens.to(device)).cpu()
    assert ours.dtype == torch.bfloat16, f"moetrain returned {ours.dtype} logits in bf16"
    moetrain_rel, transformers_rel = diff(ours, exact)["max_rel"], diff(theirs, exact)["max_rel"]
    return {"moetrain_bf16_max_rel": moetrain_rel, "transformers_bf16_max_rel": transformers_rel,
            "ratio": moetrain_rel / transformers_rel, "ok": moetrain_rel <= BOUND * transformers_rel}


def main() -> int:
    device, rest = take_option(sys.argv[1:], "device")
    layers, rest = take_option(rest, "layers")
    json_path, _ = take_option(rest, "json")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in ("qwen3_moe", "olmoe"):
            results[family] = measure(family, int(layers or 2), device, Path(tmp))
    print(f"bf16 on {device}: max |diff| / max |logit| against transformers in float32")
    print(f"{'family':<10} {'moetrain':>10} {'transformers':>13} {'ratio':>6}  (must be <= {BOUND})")
    for family, r in results.items():
        print(f"{family:<10} {r['moetrain_bf16_max_rel']:>10.2e} {r['transformers_bf16_max_rel']:>13.2e} "
              f"{r['ratio']:>6.2f}  {'ok' if r['ok'] else 'FAIL'}")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps({"device": device, "bound": BOUND, "results": results}, indent=2) + "\n")
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
