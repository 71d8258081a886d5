"""Suite-wide settings: one intra-op thread per test; ranks forked from a preloaded server.

Test tensors are tiny; on a 2-core machine shared with spawned ranks, extra threads
only add contention (small ops measured several times slower with 2 threads). A test
that runs a bench or a job in-process sets torch's thread count for itself and leaves
it set, so every test starts with one thread again.
Multi-rank tests fork their ranks from one server that has imported torch and moetrain,
instead of paying those imports in every rank of every call (calls with `rank_env`, such
as the memory tests, still spawn fresh interpreters). The GEMM peak cache is the suite's own.
"""

import os
import tempfile

import pytest
import torch

from moetrain.testing import use_preloaded_fork_server

torch.set_num_threads(1)
# Measured GEMM peaks are cached per machine; the suite keeps its own cache, never the user's
# (ranks and commands it starts inherit the variable).
os.environ["MOETRAIN_CACHE_DIR"] = tempfile.mkdtemp(prefix="moetrain-test-cache-")
use_preloaded_fork_server(extra_preload=("pytest",))  # ranks import it with their test module


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
