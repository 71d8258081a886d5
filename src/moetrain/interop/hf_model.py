"""`load_hf`: a model built and filled from a Hugging Face directory, in one process.

The one place in interop that builds a model; it stays here only until the project's model
builder (`moetrain.train.build`) takes it over. Everything else it needs is `hf_job_config` and
`load_hf_weights`, so moving it moves this file alone.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moetrain.config import JobConfig
from moetrain.interop.config_map import hf_job_config
from moetrain.interop.hf_io import load_hf_weights
from moetrain.model.transformer import Transformer


# moved to train/build.py at merge
def load_hf(model_dir: str | Path, device: torch.device | str = "cpu") -> tuple[Transformer, JobConfig]:
    """(model, JobConfig) of a Hugging Face directory, in one process: the architecture from config.json
    (RoPE kept in the "half" layout), the weights from the safetensors files, the directory's
    tokenizer.json as `data.tokenizer` when it has one."""
    cfg = hf_job_config(model_dir)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    model.to_empty(device=device)
    for module in model.modules():  # weights come from the files; only the balancing buffers need a value
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()
    load_hf_weights(model, model_dir)
    return model, cfg
