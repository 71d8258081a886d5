"""Suite-wide settings: one intra-op thread per test process; ranks forked from a preloaded server.

Test tensors are tiny; on a 2-core machine shared with spawned ranks, extra threads
only add contention (small ops measured several times slower with 2 threads).
Multi-rank tests fork their ranks from one server that has imported torch and moetrain,
instead of paying those imports in every rank of every call (calls with `rank_env`, such
as the memory tests, still spawn fresh interpreters).
"""

import torch

from moetrain.testing import use_preloaded_fork_server

torch.set_num_threads(1)
use_preloaded_fork_server(extra_preload=("pytest",))  # ranks import it with their test module
