"""Model definitions: transformer, MoE layer, expert kernels, init schemes. No distributed code."""
