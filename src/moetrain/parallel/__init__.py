"""Parallelism applied from outside the model: mesh, FSDP2 sharding, gradient sync."""
