"""Float8 grouped GEMMs for the routed experts: torchao's rowwise recipe for MoE training, on any device.

The recipe is torchao 0.18's (`torchao.prototype.moe_training`, `_to_fp8_rowwise_then_scaled_grouped_mm`):
every operand is cast to float8 e4m3 with a dynamic scale max_e4m3 / amax rounded down to a power of two,

- a product a @ b_e (the forward GEMMs, and the input-gradient GEMMs dO @ b_e^T): one scale per row of the
  left operand, one per expert and output column of the right one (the amax along the contraction);
- a weight gradient a_e^T g_e: one scale per column of each operand within each expert's rows (the
  contraction runs over the expert's tokens, so a scale may not mix experts).

The casts are torchao's own float8 utilities (`tensor_to_scale`, `to_fp8_saturated`) wherever the GEMM
runs. On CUDA the products are torchao's: `_to_fp8_rowwise_then_scaled_grouped_mm` for the row-scaled
ones and its per-group column scales with `torch._scaled_grouped_mm` for the weight gradients, on token
groups padded to 16 rows (torchao's `pad_token_groups`; a zero row adds nothing). torch 2.13 has no CPU
kernel for `_scaled_grouped_mm` and torchao's casts there are Triton kernels, so off CUDA the product is
emulated: each float8 operand is multiplied back by its scale (exact: a power of two) and the groups are
multiplied in float32 (`grouped_mm`), then rounded once to the operands' dtype. That is the scaled GEMM up to the
order of the float32 sums. The error bound is in docs/design/float8.md and tests/unit/test_float8_experts.py.

`float8_grouped_mm` and `float8_grouped_mm_weight_grad` take `grouped_mm`'s and `grouped_mm_weight_grad`'s
arguments (the memory-efficient layer calls them without autograd); `Float8GroupedMM` is the product with
torchao's backward (both gradients float8), for the standard-autograd `grouped` implementation.
torchao is an optional extra, imported only when a float8 GEMM runs. This module holds no parameters and
makes no routing decisions; it imports only the kernels of grouped_mm.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor

from moetrain.model.grouped_mm import Backend, grouped_mm, grouped_mm_weight_grad, host_counts

FLOAT8 = torch.float8_e4m3fn
# `torch._scaled_grouped_mm` needs every token group, and both weight dimensions, a multiple of this.
ALIGNMENT = 16


def _torchao() -> SimpleNamespace:
    from torchao.float8.config import ScalingGranularity  # the optional extra (moetrain[fp8])
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    return SimpleNamespace(tensor_to_scale=tensor_to_scale, to_fp8_saturated=to_fp8_saturated,
                           axiswise=ScalingGranularity.AXISWISE)


def quantize_dequantize(x: Tensor, dim: int) -> Tensor:
    """x cast to float8 e4m3 with one power-of-two scale per slice along `dim` (torchao's rowwise cast), then
    multiplied back by its scale in float32: the float8 operand's exact value."""
    ao = _torchao()
    scale = ao.tensor_to_scale(x, FLOAT8, scaling_granularity=ao.axiswise, axiswise_dim=dim,
                               round_scales_to_power_of_2=True)
    return ao.to_fp8_saturated(x.to(torch.float32) * scale, FLOAT8).to(torch.float32) / scale


def _per_group_columns(x: Tensor, sizes: list[int]) -> Tensor:
    """`quantize_dequantize` of each group of rows with one scale per column (a weight gradient's operands)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for rows, out_rows in zip(x.split(sizes), out.split(sizes), strict=True):
        if rows.shape[0]:  # an empty group has no amax (and nothing to cast)
            out_rows.copy_(quantize_dequantize(rows, 0))
    return out


def _finish(result: Tensor, dtype: torch.dtype, out: Tensor | None) -> Tensor:
    return result.to(dtype) if out is None else out.copy_(result)


def float8_grouped_mm(a: Tensor, b: Tensor, counts: Tensor, backend: Backend, counts_host: list[int] | None = None,
                      out: Tensor | None = None) -> Tensor:
    """`grouped_mm` in float8: rows of a [N,k] grouped by `counts`, each group times its b[e] [k,m] -> [N,m]."""
    if a.is_cuda:
        return _finish(_cuda_grouped_mm(a, b, counts), a.dtype, out)
    result = grouped_mm(quantize_dequantize(a, -1), quantize_dequantize(b, -2), counts, backend, counts_host)
    return _finish(result, a.dtype, out)


def float8_grouped_mm_weight_grad(a: Tensor, g: Tensor, counts: Tensor, backend: Backend,
                                  counts_host: list[int] | None = None, out: Tensor | None = None) -> Tensor:
    """`grouped_mm_weight_grad` in float8: a_e^T g_e per expert, a [N,k], g [N,m] -> [E,k,m]."""
    if a.is_cuda:
        return _finish(_cuda_weight_grad(a, g, counts), a.dtype, out)
    sizes = host_counts(counts, a.shape[0]) if counts_host is None else counts_host
    result = grouped_mm_weight_grad(_per_group_columns(a, sizes), _per_group_columns(g, sizes), counts, backend,
                                    sizes)
    return _finish(result, a.dtype, out)


class Float8GroupedMM(torch.autograd.Function):
    """a @ b_e per group in float8, and torchao's float8 backward: dA = dO @ b_e^T (row scales), db_e = a_e^T dO_e
    (per-group column scales). Saves the high-precision a and b, as torchao's function does."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, counts: Tensor, backend: Backend,
                counts_host: list[int] | None = None) -> Tensor:  # noqa: D102
        ctx.save_for_backward(a, b, counts)
        ctx.backend, ctx.counts_host = backend, counts_host
        return float8_grouped_mm(a, b, counts, backend, counts_host)

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # noqa: D102
        a, b, counts = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = float8_grouped_mm(grad_out, b.transpose(1, 2), counts, ctx.backend, ctx.counts_host)
        if ctx.needs_input_grad[1]:
            grad_b = float8_grouped_mm_weight_grad(a, grad_out, counts, ctx.backend, ctx.counts_host).to(b.dtype)
        return grad_a, grad_b, None, None, None


# ---------------------------------------------------------------------------------------------
# CUDA: torchao's kernels and torch._scaled_grouped_mm (no CPU kernel exists for either)
# ---------------------------------------------------------------------------------------------

def _padded_groups(counts: Tensor, *mats: Tensor) -> tuple[list[Tensor], Tensor, Tensor, Tensor]:
    """The rows of each of `mats` with every group padded to `ALIGNMENT` rows by torchao's `pad_token_groups`
    (zero rows), with (end offsets, padded start offsets, padded end offsets)."""
    from torchao.prototype.moe_training.utils import pad_token_groups  # the optional extra

    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    padded, starts, padded_ends = [], None, None
    for mat in mats:
        rows, starts, padded_ends = pad_token_groups(mat, ends, alignment_size=ALIGNMENT)
        padded.append(rows)
    return padded, ends, starts, padded_ends


def _cuda_grouped_mm(a: Tensor, b: Tensor, counts: Tensor) -> Tensor:
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm
    from torchao.prototype.moe_training.utils import unpad_token_groups

    (a_padded,), ends, starts, padded_ends = _padded_groups(counts, a)
    b_column_major = b.transpose(-2, -1).contiguous().transpose(-2, -1)  # the right operand's required layout
    with torch.no_grad():  # the row-scaled product alone; the callers own the backward
        out = _to_fp8_rowwise_then_scaled_grouped_mm(a_padded, b_column_major, padded_ends, out_dtype=a.dtype,
                                                     float8_dtype=FLOAT8, pad_token_groups_for_grouped_mm=False)
    return unpad_token_groups(out, ends, starts, a.shape[0], alignment_size=ALIGNMENT)


def _cuda_weight_grad(a: Tensor, g: Tensor, counts: Tensor) -> Tensor:
    from torchao.prototype.moe_training.kernels import triton_fp8_per_group_colwise_scales_dual

    (a_padded, g_padded), _, _, padded_ends = _padded_groups(counts, a, g)
    g_data, g_scales, a_data, a_scales = triton_fp8_per_group_colwise_scales_dual(
        g_padded, a_padded, padded_ends, FLOAT8, round_scales_to_power_of_2=True)
    grad_t = torch._scaled_grouped_mm(g_data.t(), a_data, g_scales.t().reciprocal(), a_scales.reciprocal(),
                                      padded_ends, out_dtype=a.dtype, use_fast_accum=True)  # [E, m, k]
    return grad_t.transpose(-2, -1)
