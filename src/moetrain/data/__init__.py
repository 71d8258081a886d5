"""Data: tokenizer, corpora, packing, resumable loader."""
