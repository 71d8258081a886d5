"""Interoperability with other ecosystems' model formats (hf.py: Hugging Face Qwen3-MoE and OLMoE)."""

from moetrain.interop.hf import load_hf as _load_hf  # noqa: E402
from moetrain.interop.hf import load_hf_weights  # noqa: E402


def hf_job_config(model_dir):
    return _load_hf(model_dir)[1]
