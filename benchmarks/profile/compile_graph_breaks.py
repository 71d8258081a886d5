"""Graph breaks of `torch.compile` per transformer block, per block kind and MoE implementation.

    PYTHONPATH=src .venv/bin/python benchmarks/profile/compile_graph_breaks.py [--json PATH]

Runs `torch._dynamo.explain` on every block kind (the dense block, the MoE block under each expert
implementation) of a small model with two documents per row (document-masked attention, the
plan `train.compile` uses: the dense mask on CPU), with dynamo configured as `train.compile`
configures it when this tree's parallelize has `apply_compile` (capture_scalar_outputs).
Point PYTHONPATH at another tree's src to count its breaks (before/after). Prints one line per
block kind: graphs, graph breaks and the first break reasons with their source lines.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch._dynamo as dynamo

from moetrain.args import take_option
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.model.attention import plan_attention
from moetrain.parallel import parallelize
from moetrain.train.build import build_model


def main(argv: list[str]) -> None:
    json_path, argv = take_option(argv, "json")
    if hasattr(parallelize, "apply_compile"):
        dynamo.config.capture_scalar_outputs = True
    rows = []
    for impl in ("loop", "grouped", "memory_efficient"):
        cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, n_dense_layers=1,
                          max_seq_len=32, moe=MoEConfig(n_experts=8, top_k=2, expert_hidden=16, impl=impl))
        model = build_model(cfg, seed=0).train()
        tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
        docs = (torch.arange(32) >= 10).long().expand(2, 32)
        plan = plan_attention(docs, "dense")
        positions = torch.arange(32).expand(2, 32)
        h = model.tok_embeddings(tokens)
        for block in model.layers:
            if not block.is_moe and impl != "loop":
                continue  # the dense block does not depend on the MoE implementation
            dynamo.reset()
            explained = dynamo.explain(block)(h, positions, plan)
            reasons = sorted({f"{Path(r.user_stack[-1].filename).name}:{r.user_stack[-1].lineno} "
                              f"{r.reason.splitlines()[0][:90]}" for r in explained.break_reasons if r.user_stack})
            rows.append({"block": f"moe/{impl}" if block.is_moe else "dense", "graphs": explained.graph_count,
                         "graph_breaks": explained.graph_break_count, "reasons": reasons})
            print(f"{rows[-1]['block']:>22}: {explained.graph_count} graphs, {explained.graph_break_count} breaks"
                  + "".join(f"\n{'':>24}{reason}" for reason in reasons), flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps({"torch": torch.__version__, "blocks": rows}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
