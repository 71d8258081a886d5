"""Measured logits differences between moetrain and transformers for each family and conversion path.

    .venv/bin/python benchmarks/parity/hf_parity.py [--layers 2] [--json benchmarks/results/hf_parity.json]

Builds Qwen3-MoE and OLMoE models at the presets' widths (Qwen3: dim 256, 16/8 heads, head_dim 128,
64 experts top-8, expert width 768; OLMoE: dim 256, 8 heads, 64 experts top-8, width 128), and
Mixtral (dim 256, 8/2 heads, 8 experts top-2 of width 512, sliding window 64), Qwen2-MoE (dim 256,
8 heads, q/k/v biases, 16 experts top-4 of width 128, a gated shared expert of width 512) and
GPT-OSS (dim 256, 8/2 heads of 64 with biases and sinks, window 32 on every other layer, 16 experts
top-4 of width 256 with biases and the clamped SwiGLU) with random weights (transformers' init,
norm weights, biases and sinks perturbed), float32, CPU, and reports for each:
import (moetrain's RoPE "half" and "interleaved" layouts) against transformers on the same
tokens; packed documents (document masking on) against transformers run on each document
alone; and export after 3 AdamW steps of the imported model, reloaded with `from_pretrained`.
Numbers: max |diff| and max |diff| / max |logit|. The 1-rank vs HSDP 2×2 round trip is checked
bit for bit by tests/distributed/test_families.py.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from moetrain.args import take_option
from moetrain.data.tokenizer import write_byte_level_tokenizer
from moetrain.interop import load_hf_weights, save_hf
from moetrain.model.transformer import Transformer
from moetrain.train.build import load_hf_model

SPECIAL = {"bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258}


def hf_model(family: str, layers: int):
    from transformers import (
        AutoModelForCausalLM,
        GptOssConfig,
        MixtralConfig,
        OlmoeConfig,
        Qwen2MoeConfig,
        Qwen3MoeConfig,
    )

    rope = {"rope_type": "default", "rope_theta": 1e6 if family == "qwen3_moe" else 1e4}
    if family == "mixtral":
        config = MixtralConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                               num_attention_heads=8, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                               sliding_window=64, max_position_embeddings=512, rope_parameters=rope, **SPECIAL)
    elif family == "qwen2_moe":
        config = Qwen2MoeConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                                num_attention_heads=8, num_key_value_heads=8, moe_intermediate_size=128,
                                shared_expert_intermediate_size=512, num_experts=16, num_experts_per_tok=4,
                                max_position_embeddings=512, rope_parameters=rope, **SPECIAL)
    elif family == "gpt_oss":
        config = GptOssConfig(vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=layers,
                              num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_local_experts=16,
                              num_experts_per_tok=4, sliding_window=32, max_position_embeddings=512,
                              rope_parameters=rope, **SPECIAL)
    elif family == "qwen3_moe":
        config = Qwen3MoeConfig(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=layers,
                                num_attention_heads=16, num_key_value_heads=8, head_dim=128, moe_intermediate_size=768,
                                num_experts=64, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=512,
                                rope_parameters=rope, **SPECIAL)
    else:
        config = OlmoeConfig(vocab_size=512, hidden_size=256, intermediate_size=128, num_hidden_layers=layers,
                             num_attention_heads=8, num_experts=64, num_experts_per_tok=8, max_position_embeddings=512,
                             rope_parameters=rope, **SPECIAL)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.mul_(1 + 0.3 * torch.randn_like(param))
            elif "bias" in name or "sinks" in name:  # zeros at init: a mis-mapped one would hide
                param.add_(0.1 * torch.randn_like(param))
    return model


def diff(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    error = (got.double() - want.double()).abs().max()
    return {"max_abs": float(error), "max_rel": float(error / want.double().abs().max())}


def packed_diff(model: Transformer, reference, tokens: torch.Tensor) -> dict[str, float]:
    """Packed documents (document masking on) against the reference run on each document alone."""
    lengths = [50, 7, 1, 70]
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0)
    packed = model(tokens[:1], document_ids=document_ids)[0]
    pieces, start = [], 0
    for n in lengths:
        pieces.append(reference(tokens[:1, start:start + n]).logits[0])
        start += n
    return diff(packed, torch.cat(pieces))


def export_diff(model: Transformer, cfg, directory: Path, tokens: torch.Tensor,
                want: torch.Tensor) -> dict[str, dict[str, float]]:
    """The trained model exported and reloaded by transformers against itself, and how far training moved it."""
    from transformers import AutoModelForCausalLM

    exported = save_hf(model, dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_from=None)), directory)
    reloaded = AutoModelForCausalLM.from_pretrained(exported).float().eval()
    with torch.no_grad():
        trained = model(tokens)
        return {"export after 3 steps": diff(reloaded(tokens).logits, trained),
                "(3 steps moved the logits by)": diff(trained, want)}


def report(results: dict, label: str, width: int, path: Path, layers: int) -> None:
    """The table on stdout and the JSON at `path`."""
    print(f"{label:<{width}} {'path':<36} {'max |diff|':>11} {'max |diff| / max |logit|':>25}")
    for name, paths in results.items():
        for kind, numbers in paths.items():
            print(f"{name:<{width}} {kind:<36} {numbers['max_abs']:>11.2e} {numbers['max_rel']:>25.2e}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"layers": layers, "results": results}, indent=2) + "\n")


def saved_and_loaded(reference, directory: Path):
    """Save a transformers model with a byte-level tokenizer to `directory`; (moetrain model, job config) read back."""
    reference.save_pretrained(directory)
    write_byte_level_tokenizer(directory / "tokenizer.json")
    return load_hf_model(directory)


def train_briefly(model: Transformer, with_aux_loss: bool) -> None:
    """Three AdamW steps on fixed random bytes (and the aux-free bias step), so export sees weights that moved."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for step in range(3):
        batch = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(10 + step))
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        if with_aux_loss:
            loss = loss + model.aux_loss()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        model.update_expert_bias()  # changes nothing unless the router balances without an aux loss


def run_all(names, measure, label: str, width: int, default_layers: int, default_json: str) -> int:
    """`measure(name, layers, work)` for every name on one thread, then the table and the JSON (--layers, --json)."""
    layers, rest = take_option(sys.argv[1:], "layers")
    json_path, _ = take_option(rest, "json")
    torch.set_num_threads(1)
    layers = int(layers or default_layers)
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: measure(name, layers, Path(tmp)) for name in names}
    report(results, label, width, Path(json_path or default_json), layers)
    return 0


def measure(family: str, layers: int, work: Path) -> dict[str, dict[str, float]]:

    reference = hf_model(family, layers)
    directory = work / family
    model, cfg = saved_and_loaded(reference, directory)
    tokens = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(1))
    out: dict[str, dict[str, float]] = {}
    with torch.no_grad():
        want = reference(tokens).logits
        out["import (half layout)"] = diff(model(tokens), want)
        interleaved = Transformer(dataclasses.replace(cfg.model, rope_layout="interleaved"))
        load_hf_weights(interleaved, directory)
        out["import (interleaved layout)"] = diff(interleaved(tokens), want)
        out["packed documents vs per-document"] = packed_diff(model, reference, tokens)
    train_briefly(model, with_aux_loss=True)
    return {**out, **export_diff(model, cfg, work / f"{family}-export", tokens, want)}


def main() -> int:
    return run_all(("qwen3_moe", "olmoe", "mixtral", "qwen2_moe", "gpt_oss"), measure, "family", 10,
                   default_layers=2, default_json="benchmarks/results/hf_parity.json")


if __name__ == "__main__":
    sys.exit(main())
