"""Training loop and its components: optimizer, checkpoints, metrics."""
