"""Evaluation of a model in hand: generation, local task files and their scoring, the lm-evaluation-harness model.

`generate.py` is batched generation with the KV cache (training's final sample, `moetrain sample`,
`generate_until`); `tasks.py` reads local JSONL task files and scores them the way
lm-evaluation-harness does, for the in-loop evaluation and the harness alike; `harness.py` holds the
model class lm-evaluation-harness drives (registered as "moetrain") and turns local task files into
task configs. This package sits below train (training evaluates and samples through it) and above
observe: it loads no checkpoints, builds no models and parses no command lines (`moetrain eval` is
`moetrain.commands.eval`); it imports `lm_eval` only inside functions.
"""
