"""Why the default job's expert load is uneven before the router has learned anything.

Builds the default job's model at initialization (configs/tiny_moe.toml, the trainer's seed and
builder), runs the trainer's first training batch (same loader, same seed) through it once, and
prints per MoE layer: the router weight's std, the router logits' std, how close the router
probabilities are to uniform (mean max probability, mean entropy / ln E) and the expert-load
coefficient of variation and idle experts of that forward, the same statistics the training
records carry. The same weights then route a batch of uniformly random bytes, for comparison: the
difference between the two loads is the data's doing, not the router's. Last, the ratio of the peak
learning rate to the router weight's std: Adam's first steps move every weight by about the
learning rate, so this is the relative size of one peak-rate router update.

    PYTHONPATH=src .venv/bin/python benchmarks/quality/router_init.py --seeds 0 1

Benchmark only: one forward per seed on one thread (a few seconds); nothing here asserts a number.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from moetrain.config.job import load
from moetrain.data.batching import build_batching
from moetrain.data.dataset import load_training_data
from moetrain.data.loader import DataLoader
from moetrain.observe.metrics import expert_health
from moetrain.parallel.mesh import JobMesh, MeshDims
from moetrain.train.build import build_for_job

ROOT = Path(__file__).resolve().parents[2]


def layer_stats(model: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor | None,
                document_ids: torch.Tensor | None) -> list[dict[str, float]]:
    captured: dict[int, torch.Tensor] = {}
    hooks = [moe.router.register_forward_hook(lambda _m, _i, out, i=i: captured.__setitem__(i, out.detach()))
             for i, moe in enumerate(model.moe_layers())]
    with torch.no_grad():
        model(tokens, positions, document_ids)
    for hook in hooks:
        hook.remove()
    load_LE = torch.stack([moe.tokens_per_expert for moe in model.moe_layers()])
    health = expert_health(load_LE)
    out = []
    for i, moe in enumerate(model.moe_layers()):
        probs_TE = captured[i].float().softmax(-1)
        entropy = -(probs_TE * probs_TE.clamp_min(1e-30).log()).sum(-1).mean() / math.log(probs_TE.shape[1])
        out.append({"router_w_std": float(moe.router.weight.detach().std()), "logit_std": float(captured[i].std()),
                    "max_prob": float(probs_TE.max(-1).values.mean()), "entropy": float(entropy),
                    "load_cv": health["expert_load_cv_per_layer"][i],
                    "idle": health["experts_without_tokens_per_layer"][i],
                    "max_load": health["expert_load_max_per_layer"][i]})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "tiny_moe.toml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    base = load(args.config)
    data = load_training_data(base)
    print("seed | batch | MoE layer | router w std | logit std | mean max prob (1/E = "
          f"{1 / base.model.moe.n_experts:.4f}) | entropy / ln E | load CV | idle | max load "
          f"(of {base.train.microbatch_size * base.data.seq_len * base.model.moe.top_k} assignments)")
    for seed in args.seeds:
        cfg = load(args.config)
        cfg.train.seed = seed
        torch.manual_seed(seed)
        model = build_for_job(cfg, JobMesh.build(MeshDims(), "cpu")).eval()
        batching = build_batching(data.train, cfg.data, cfg.train.microbatch_size, seed)
        (first,) = DataLoader(batching, seed=seed).next_microbatches()
        gen = torch.Generator().manual_seed(seed)
        uniform = torch.randint(0, 256, first.tokens.shape, generator=gen, dtype=first.tokens.dtype)
        for name, stats in (("first training batch", layer_stats(model, first.tokens, first.positions,
                                                                   first.document_ids)),
                            ("uniform random bytes", layer_stats(model, uniform, None, None))):
            for i, s in enumerate(stats):
                print(f"{seed} | {name} | {i} | {s['router_w_std']:.4f} | {s['logit_std']:.3f} | {s['max_prob']:.4f} "
                      f"| {s['entropy']:.4f} | {s['load_cv']:.2f} | {s['idle']} | {s['max_load']}")
        stds = [float(moe.router.weight.detach().std()) for moe in model.moe_layers()]
        ratios = ", ".join(f"{cfg.train.lr / std:.2f}" for std in stds)
        print(f"{seed} | peak lr {cfg.train.lr:g} / router weight std, per MoE layer: {ratios}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
