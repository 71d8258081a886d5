"""Low-precision CPU segment GEMMs run on a few row counts only, and give the per-expert float64 products.

oneDNN builds a primitive per matmul shape for bf16 on CPU, so `grouped_mm` and
`grouped_mm_weight_grad` cut each expert's row count to multiples of a tile (rows split into a
multiple and a remainder; a weight gradient's rows zero-padded). These tests count the shapes the
loop hands to `aten::mm` and check the results against a float64 loop over the experts.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moetrain.model.grouped_mm import _ROW_TILE, grouped_mm, grouped_mm_weight_grad

# Row counts of 9 experts: empty, under the tile, one tile, one tile and a remainder, several tiles.
COUNTS = [0, 1, 7, _ROW_TILE, _ROW_TILE + 1, 2 * _ROW_TILE - 1, 3 * _ROW_TILE + 5, 50, 130]


class MatmulShapes(TorchDispatchMode):
    """Records the (rows, reduction, columns) of every aten::mm dispatched."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.mm:
            a, b = args[0], args[1]
            self.shapes.append((a.shape[0], a.shape[1], b.shape[1]))
        return func(*args, **(kwargs or {}))


def _operands(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows, dim, width = sum(COUNTS), 24, 40
    a = torch.randn(rows, dim, generator=gen, dtype=torch.float64)
    w = torch.randn(len(COUNTS), dim, width, generator=gen, dtype=torch.float64)
    g = torch.randn(rows, width, generator=gen, dtype=torch.float64)
    return a.to(dtype), w.to(dtype), g.to(dtype)


def _bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    # one rounding of a float32-accumulated sum to bf16: 2^-8 relative to the result's scale
    assert got.dtype == torch.bfloat16
    scale = want.abs().max().clamp_min(1.0)
    assert (got.double() - want).abs().max() <= 2.0 ** -7 * scale


def test_bf16_rows_use_tile_multiples_and_remainders_and_match_float64():
    a, w, _ = _operands(torch.bfloat16)
    counts = torch.tensor(COUNTS)
    with MatmulShapes() as seen:
        out = grouped_mm(a, w, counts, "segment_loop", COUNTS)
    assert all(m % _ROW_TILE == 0 or m < _ROW_TILE for m, _, _ in seen.shapes), seen.shapes
    assert sum(m for m, _, _ in seen.shapes) == sum(COUNTS)
    want = torch.cat([seg @ w_e for seg, w_e in zip(a.double().split(COUNTS), w.double().unbind(0), strict=True)])
    _bf16_close(out, want)


def test_bf16_weight_gradients_pad_rows_to_tile_multiples_and_match_float64():
    a, _, g = _operands(torch.bfloat16, seed=1)
    counts = torch.tensor(COUNTS)
    out = torch.full((len(COUNTS), a.shape[1], g.shape[1]), float("nan"), dtype=torch.bfloat16)
    with MatmulShapes() as seen:
        grouped_mm_weight_grad(a, g, counts, "segment_loop", COUNTS, out=out)
    # the reduction dimension (an expert's rows) is always a whole number of tiles
    assert all(k % _ROW_TILE == 0 for _, k, _ in seen.shapes), seen.shapes
    assert len(seen.shapes) == sum(1 for c in COUNTS if c)
    want = torch.stack([a_e.t() @ g_e for a_e, g_e in zip(a.double().split(COUNTS), g.double().split(COUNTS),
                                                            strict=True)])
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # the empty expert
    _bf16_close(out, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_float32_and_float64_keep_exact_row_counts(dtype):
    a, w, g = _operands(dtype, seed=2)
    counts = torch.tensor(COUNTS)
    with MatmulShapes() as seen:
        out = grouped_mm(a, w, counts, "segment_loop", COUNTS)
        grads = grouped_mm_weight_grad(a, g, counts, "segment_loop", COUNTS)
    assert sorted(m for m, _, _ in seen.shapes[:len(seen.shapes) // 2]) == sorted(c for c in COUNTS if c)
    want = torch.cat([seg @ w_e for seg, w_e in zip(a.double().split(COUNTS), w.double().unbind(0), strict=True)])
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    want_grads = torch.stack([a_e.t() @ g_e for a_e, g_e in zip(a.double().split(COUNTS), g.double().split(COUNTS),
                                                                  strict=True)])
    torch.testing.assert_close(grads.double(), want_grads, rtol=1e-5, atol=1e-5)
