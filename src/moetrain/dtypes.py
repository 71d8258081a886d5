"""The floating-point dtypes moetrain names in configs and command lines, in one table.

Each user of a dtype name (mixed precision, export, benchmarks) picks from this table and
lists its own subset as valid; this module only maps names to torch dtypes.
"""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
