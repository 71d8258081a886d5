"""Interoperability with Hugging Face model directories (config.json, safetensors, tokenizer.json).

Per-family knowledge lives in `interop.families` (one module per family, a registry by model_type,
and `families.base` with the field names and readings they share);
the shared modules convert through those adapters: `config_json` (reading config.json),
`config_map` (config.json <-> ModelConfig, checks, the JobConfig of a directory), `hf_io` (the
safetensors files, plain or sharded), `shards` (shard-local tensor helpers), `layouts` (tensor
names several families share). Callers import from here. Interop sits above `parallel` (it uses its
collectives) and below `train`; it builds no process group and parses no command line.
"""

from moetrain.interop.config_json import hf_dir
from moetrain.interop.config_map import (
    architecture,
    check_architecture,
    export_family,
    hf_config,
    hf_job_config,
    model_config_from_hf,
    read_hf_config,
)
from moetrain.interop.families import FAMILIES, SUPPORTED
from moetrain.interop.families.base import ARCH_FIELDS
from moetrain.interop.hf_io import INDEX_FILE, MAX_FILE_BYTES, check_output_dir, load_hf_weights, save_hf

__all__ = [
    "ARCH_FIELDS", "FAMILIES", "INDEX_FILE", "MAX_FILE_BYTES", "SUPPORTED", "architecture", "check_architecture",
    "check_output_dir", "export_family", "hf_config", "hf_dir", "hf_job_config", "load_hf_weights",
    "model_config_from_hf", "read_hf_config", "save_hf",
]
