"""Interoperability with other ecosystems' model formats (hf.py: Hugging Face Qwen3-MoE and OLMoE)."""
