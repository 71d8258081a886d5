"""Evaluation with lm-evaluation-harness (the optional extra `eval`): `moetrain eval` and the model class.

`harness.py` holds the model class lm-evaluation-harness drives (`loglikelihood`,
`loglikelihood_rolling`, `generate_until` on a moetrain model, registered as "moetrain") and turns
local JSONL task files into task configs; `command.py` is `moetrain eval`. The scoring itself is
`moetrain.train.task_eval`, which the in-loop evaluation shares, and generation is
`moetrain.train.sample`. This package sits above train (it loads checkpoints and Hugging Face
directories through it) and below the CLI; it imports `lm_eval` only inside functions.
"""
