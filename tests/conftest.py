"""Suite-wide settings: one intra-op thread per test process.

Test tensors are tiny; on a 2-core machine shared with spawned ranks, extra threads
only add contention (small ops measured several times slower with 2 threads).
"""

import torch

torch.set_num_threads(1)
