"""Test utilities shipped with the package (multi-rank harness)."""

from moetrain.testing.multirank import RankFailure, free_port, run_on_ranks, use_preloaded_fork_server

__all__ = ["RankFailure", "free_port", "run_on_ranks", "use_preloaded_fork_server"]
