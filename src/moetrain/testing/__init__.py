"""Test utilities shipped with the package (multi-rank harness)."""

from moetrain.testing.multirank import RankFailure, free_port, run_on_ranks

__all__ = ["RankFailure", "free_port", "run_on_ranks"]
