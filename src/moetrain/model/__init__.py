"""Model definitions, imported top-down with no cycles (each module imports only those above it).

layers (RoPE, attention, FFN) -> routing (expert choice, token rounding, balance loss) ->
grouped_mm (GEMM backends, activations) -> moe_function (memory-efficient autograd Function) ->
experts (the routed-expert implementations) -> moe (the MoE layer) -> init (scheme catalog and
shard-local drawing) -> transformer (the model) -> init_report (the `init-report` command);
flops works from the config alone. No distributed code: sharding is applied from outside.
"""
