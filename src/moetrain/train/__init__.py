"""Training loop and its components: optimizer, metrics."""
