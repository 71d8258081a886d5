"""Data: tokenizer, corpora, packing, batching, a loader whose order does not depend on the world size."""
