"""Grouped GEMMs over contiguous expert segments, their per-device backends, and the expert activations.

`grouped_mm` multiplies rows grouped by expert with each expert's weight; `grouped_mm_weight_grad`
forms the per-expert weight gradients a_e^T g_e. Two backends share that contract:
``torch_grouped_mm`` (``torch._grouped_mm``, one call over all experts) and ``segment_loop`` (a
loop of matmuls over the contiguous segments). `grouped_mm_backend` chooses per device:
``_grouped_mm`` on CUDA, and on CPU whichever of the two `moetrain bench moe` measured faster for
each implementation (see docs/bench_moe.md). The activations (SwiGLU on a fused [gate | up] input,
exact GELU, GPT-OSS's clamped SwiGLU as a `ClampedSwiGLU` with its constants) and their derivative
are shared by the standard-autograd implementations and the memory-efficient backward.

These are kernels only: nothing here knows about routing decisions, parameters or distribution,
and this module imports no other model module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from moetrain.errors import ModelError

Backend = Literal["torch_grouped_mm", "segment_loop"]

ACTIVATIONS: tuple[str, ...] = ("swiglu", "gelu")
BACKENDS: tuple[str, ...] = ("torch_grouped_mm", "segment_loop")

# CPU backend per implementation, chosen by measurement: `moetrain bench moe` times both backends
# side by side for the grouped and memory-efficient paths (numbers and commands in docs/bench_moe.md).
CPU_GROUPED_MM_BACKEND: dict[str, Backend] = {"grouped": "torch_grouped_mm", "memory_efficient": "segment_loop"}


# ---------------------------------------------------------------------------------------------
# Grouped GEMMs over contiguous expert segments
# ---------------------------------------------------------------------------------------------

def grouped_mm_backend(device: torch.device, dtype: torch.dtype, impl: str = "memory_efficient") -> Backend:
    """The grouped GEMM backend for a device: `_grouped_mm` on CUDA, the measured winner on CPU.

    float64 is not supported by `_grouped_mm` on any device, so it always takes the segment loop.
    On CUDA, `_grouped_mm` runs a CUTLASS grouped kernel for bf16 on sm90/sm100 and a per-group
    fallback otherwise; it needs 16-byte aligned strides (checked per call, else segment loop).
    """
    if dtype == torch.float64:
        return "segment_loop"
    if device.type == "cpu" and torch.compiler.is_compiling():
        # torch 2.13's fake-tensor rule for `_grouped_mm` accepts only bf16 off CUDA, so a traced CPU
        # graph multiplies the segments instead (sizes from `host_counts`, symbolic under compile).
        return "segment_loop"
    if device.type == "cuda":
        return "torch_grouped_mm"
    return CPU_GROUPED_MM_BACKEND.get(impl, "segment_loop")


def _grouped_mm_usable(*mats: Tensor) -> bool:
    """`_grouped_mm` needs one dtype in {fp32, bf16, fp16} and 16-byte aligned strides and pointers."""
    dtype = mats[0].dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    for mat in mats:
        if mat.dtype != dtype or mat.data_ptr() % 16:
            return False
        # Every non-unit stride (in bytes) must be a multiple of 16.
        if any(s != 1 and (s * mat.element_size()) % 16 for s in mat.stride()):
            return False
    return True


def host_counts(counts: Tensor, n_rows: int) -> list[int]:
    """counts [E] as Python ints (split sizes summing to n_rows).

    Eager this reads the tensor on the host. Under torch.compile (with dynamo's
    `capture_scalar_outputs`, which `moetrain.parallel.parallelize` turns on) the values become
    unbacked symbolic sizes inside the graph: the checks tell the compiler they are valid split
    sizes, so the graph needs no host sync and no graph break.
    """
    sizes = counts.tolist()
    if torch.compiler.is_compiling():
        for size in sizes:
            torch._check(size >= 0)
        torch._check(sum(sizes) == n_rows)
    return sizes


def _offsets(counts: Tensor) -> Tensor:
    # `_grouped_mm` takes int32 cumulative end offsets, one per group, on the operands' device.
    return torch.cumsum(counts, 0, dtype=torch.int32)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    torch 2.13's CPU `_grouped_mm` backward rejects a stride-0 gradient (what `out.sum()`
    produces): "Invalid strides/sizes, got [0, 0]". Placing this right after each `_grouped_mm`
    hands it a dense gradient instead. It saves nothing for backward.
    """

    @staticmethod
    def forward(ctx, tensor: Tensor) -> Tensor:  # noqa: D102
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # noqa: D102
        return grad.contiguous()


def grouped_mm(a: Tensor, b: Tensor, counts: Tensor, backend: Backend, counts_host: list[int] | None = None,
               out: Tensor | None = None) -> Tensor:
    """Rows of `a` [N,k] grouped by `counts` [E], each group times its `b[e]` [k,m] -> [N,m].

    Differentiable under standard autograd for both backends (used by the `grouped` impl), and
    immune to the stride-0 gradient bug of `_grouped_mm`. `out` (only without autograd) receives
    the result in place.
    """
    if backend == "torch_grouped_mm" and _grouped_mm_usable(a, b):
        result = _ContiguousGrad.apply(torch._grouped_mm(a, b, offs=_offsets(counts)))
        return result if out is None else out.copy_(result)
    sizes = host_counts(counts, a.shape[0]) if counts_host is None else counts_host
    if not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)):
        # No autograd (e.g. inside the memory-efficient Function): write each segment's product
        # straight into its rows of one output instead of concatenating pieces (saves an N x m copy).
        out = a.new_empty(a.shape[0], b.shape[2]) if out is None else out
        # Skipping empty segments branches on a size, which a compiled graph cannot (an empty mm is exact).
        compiling = torch.compiler.is_compiling()
        tile = 0 if compiling else _row_tile(a)
        for seg, b_e, out_seg in zip(a.split(sizes, dim=0), b.unbind(0), out.split(sizes, dim=0), strict=True):
            if compiling or seg.shape[0]:
                _mm_rows(seg, b_e, out_seg, tile)
        return out
    # unbind, not b[e]: each select's backward would materialise a zero [E,k,m] gradient per expert.
    # Empty segments are multiplied too (a free [0,k] @ [k,m]) so the output stays connected to
    # every weight even when no token is routed at all: gradients are zeros, never None, which
    # keeps FSDP's per-parameter gradient reduction uniform across ranks.
    return torch.cat([seg @ b_e for seg, b_e in zip(a.split(sizes, dim=0), b.unbind(0), strict=True)], dim=0)


def grouped_mm_weight_grad(a: Tensor, g: Tensor, counts: Tensor, backend: Backend,
                           counts_host: list[int] | None = None, out: Tensor | None = None) -> Tensor:
    """Per-expert a_e^T g_e for rows grouped by `counts`: a [N,k], g [N,m] -> [E,k,m] (zeros for empty experts).

    Used only inside the memory-efficient backward (no autograd through it); `out` [E,k,m], if
    given, receives the result in place.
    """
    n_experts = counts.numel()
    if backend == "torch_grouped_mm" and _grouped_mm_usable(a, g):
        a_t = a.t()  # [k, N] view with unit row stride: the 2d x 2d form groups along the shared N dim
        if _grouped_mm_usable(a_t, g) and a.shape[0] > 0:
            result = torch._grouped_mm(a_t, g, offs=_offsets(counts))
            # Groups with no rows are left untouched by some kernels; zero them explicitly.
            result = result.masked_fill((counts == 0).view(-1, 1, 1), 0)
            return result if out is None else out.copy_(result)
    sizes = host_counts(counts, a.shape[0]) if counts_host is None else counts_host
    out = torch.empty(n_experts, a.shape[1], g.shape[1], dtype=a.dtype, device=a.device) if out is None else out
    compiling = torch.compiler.is_compiling()  # no branch on a symbolic size: an empty a^T g is zeros anyway
    tile = 0 if compiling else _row_tile(a)
    padded = _PaddedRows(a, g, max(sizes, default=0), tile) if tile else None
    for a_seg, g_seg, out_e in zip(a.split(sizes, dim=0), g.split(sizes, dim=0), out.unbind(0), strict=True):
        if not compiling and a_seg.shape[0] == 0:
            out_e.zero_()
            continue
        if padded is not None:
            a_seg, g_seg = padded.fill(a_seg, g_seg)
        if out_e.dtype == a.dtype:
            torch.mm(a_seg.t(), g_seg, out=out_e)
        else:
            out_e.copy_(a_seg.t() @ g_seg)
    return out


# On CPU, bf16/fp16 matmuls go through oneDNN, which builds (JIT-compiles) a primitive per shape and
# keeps the last 1024 in a cache. An expert's row count changes every step, so per-expert GEMMs
# with their exact row counts meet a new shape on most calls and pay for a primitive each time
# (measured in docs/design/performance.md, "bf16 expert GEMMs on a few shapes"). Row counts are
# therefore cut to a few shapes: a segment's rows go through as a multiple of the tile plus a
# remainder under the tile (row GEMMs: each output row is its own dot products, so splitting rows
# changes no result), and a weight gradient's rows (its reduction dimension) are padded with zero
# rows to a multiple of the tile (zeros add nothing; splitting there would round a partial sum to
# bf16). float32 goes to a BLAS with no per-shape cost.
_ROW_TILE = 32


def _row_tile(a: Tensor) -> int:
    """The row tile for `a`'s per-expert GEMMs: `_ROW_TILE` for low precision on CPU, else 0 (exact counts)."""
    return _ROW_TILE if a.device.type == "cpu" and a.dtype in (torch.bfloat16, torch.float16) else 0


def _mm_rows(seg: Tensor, weight: Tensor, out: Tensor, tile: int) -> None:
    """out = seg @ weight, as a multiple of `tile` rows and a remainder (one call when `tile` is 0)."""
    rows = seg.shape[0]
    head = rows - rows % tile if tile else rows
    if head:
        torch.mm(seg[:head], weight, out=out[:head])
    if head < rows:
        torch.mm(seg[head:], weight, out=out[head:])


def _round_up(rows: int, tile: int) -> int:
    return -(-rows // tile) * tile


class _PaddedRows:
    """Two scratch buffers that hand out a pair of segments with their rows zero-padded to a multiple of `tile`."""

    def __init__(self, a: Tensor, g: Tensor, max_rows: int, tile: int):
        self.tile = tile
        capacity = _round_up(max_rows, tile)
        self.a = a.new_empty(capacity, a.shape[1])
        self.g = g.new_empty(capacity, g.shape[1])

    def fill(self, a_seg: Tensor, g_seg: Tensor) -> tuple[Tensor, Tensor]:
        rows = a_seg.shape[0]
        padded = _round_up(rows, self.tile)
        if padded == rows:
            return a_seg, g_seg
        for scratch, seg in ((self.a, a_seg), (self.g, g_seg)):
            scratch[:rows].copy_(seg)
            scratch[rows:padded].zero_()
        return self.a[:padded], self.g[:padded]


# ---------------------------------------------------------------------------------------------
# Activations and their derivative (shared with the memory-efficient backward)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS's expert activation on H = [gate | up]: (clamp(up, ±limit) + 1) · g · sigmoid(alpha · g),
    g = min(gate, limit) (gate clamped from above only), as transformers' GptOssExperts computes it."""

    alpha: float = 1.702
    limit: float = 7.0


# What the expert functions take as `activation`: a name of ACTIVATIONS, or a ClampedSwiGLU.
Activation = str | ClampedSwiGLU


def check_activation(activation: Activation) -> None:
    if isinstance(activation, ClampedSwiGLU):
        return
    if activation not in ACTIVATIONS:
        raise ModelError(f"moe activation = {activation!r} is invalid: valid activations are {', '.join(ACTIVATIONS)} "
                         "or a ClampedSwiGLU")


def is_gated(activation: Activation) -> bool:
    """Whether W1's output is [gate | up] (width 2n) rather than n wide."""
    return activation == "swiglu" or isinstance(activation, ClampedSwiGLU)


def activation_forward(h: Tensor, activation: Activation) -> Tensor:
    """A = phi(H). SwiGLU: H = [gate | up] (width 2n), A = silu(gate) * up. GELU: A = gelu(H).
    ClampedSwiGLU: see the class."""
    if isinstance(activation, ClampedSwiGLU):
        gate, up = h.chunk(2, dim=-1)
        gate = gate.clamp(max=activation.limit)
        return (up.clamp(-activation.limit, activation.limit) + 1) * (gate * torch.sigmoid(activation.alpha * gate))
    if activation == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h)


def activation_backward(h: Tensor, grad_a: Tensor, activation: Activation) -> Tensor:
    """dH = dA * phi'(H), computed in float32 for low-precision inputs and returned in H's dtype."""
    compute_dtype = torch.float32 if h.dtype in (torch.bfloat16, torch.float16) else h.dtype
    h_c, grad_c = h.to(compute_dtype), grad_a.to(compute_dtype)
    if isinstance(activation, ClampedSwiGLU):
        alpha, limit = activation.alpha, activation.limit
        gate, up = h_c.chunk(2, dim=-1)
        g, u = gate.clamp(max=limit), up.clamp(-limit, limit)
        sig = torch.sigmoid(alpha * g)
        # d/dg [g·σ(αg)] = σ(αg)·(1 + αg·(1 − σ(αg))); the clamps pass the gradient inside their range
        # (bounds included, as torch.clamp's backward does).
        grad_gate = grad_c * (u + 1) * sig * (1 + alpha * g * (1 - sig)) * (gate <= limit)
        grad_up = grad_c * g * sig * ((up >= -limit) & (up <= limit))
        return torch.cat((grad_gate, grad_up), dim=-1).to(h.dtype)
    if activation == "swiglu":
        gate, up = h_c.chunk(2, dim=-1)
        if torch.compiler.is_compiling():  # dynamo takes no strided out=; the compiler fuses the cat away
            return torch.cat([torch.ops.aten.silu_backward(grad_c * up, gate), grad_c * F.silu(gate)],
                             dim=-1).to(h.dtype)
        grad_h = torch.empty_like(h_c)
        # dH = [dA * up * silu'(gate) | dA * silu(gate)], written into the two halves without a cat.
        torch.ops.aten.silu_backward.grad_input(grad_c * up, gate, grad_input=grad_h[:, : gate.shape[1]])
        torch.mul(grad_c, F.silu(gate), out=grad_h[:, gate.shape[1] :])
        return grad_h.to(h.dtype)
    # Exact (erf) GELU, matching F.gelu's default.
    return torch.ops.aten.gelu_backward(grad_c, h_c).to(h.dtype)
