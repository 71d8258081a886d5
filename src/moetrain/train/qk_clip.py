"""QK-clip (MuonClip, Kimi K2 arXiv 2507.20534): keep every attention head's largest logit at or below τ.

Each step, while `arm()` is in force, every attention layer records each query head's largest
pre-softmax logit over the step's microbatches (`model.attention.max_logit_per_head`, via the
layer's `max_logits`). After the optimizer step `clip()` takes the maximum over all ranks and, for
every head h whose maximum S_h exceeds τ, scales its weights so that its logits shrink by η = τ / S_h
(under pipeline parallelism each stage clips its own layers: the maximum is taken over the ranks that hold
the same layers, `reduce_max`, as the stages' layer counts differ; the maxima it returns for the log are then
gathered over the stages, so they cover every layer). Under tensor parallelism a rank computes its own heads
only (a contiguous 1 / tp of them, the colwise split of the projections): it records those, writes them into
its columns of a [layers, all heads] tensor left at -inf elsewhere, and the maximum over the ranks then takes
each head's maximum over the ranks that computed it (data and context ranks: other tokens) while the tensor
ranks fill in each other's heads, so every rank ends with every head's maximum, for the clip and the log:

- grouped-query attention with one key head per query head (MHA): the head's query rows and its key
  rows (weights and biases) each by √η, Kimi K2's balanced split;
- several query heads sharing a key head (GQA): the query rows by η and the shared key untouched, so
  the other heads of its group keep their logits and weights;
- MLA: the head's q_nope rows by √η and its q_rope rows by η in the query projection (wq, or wq_b
  after the low-rank path), its k_nope rows by √η in wkv_b; the shared rotary key (in wkv_a) and the
  values are untouched, as Kimi K2 does.

RoPE is a rotation within a head's channels, so scaling the rows scales the rotated q and k alike.
QK-norm (per head or over all heads) undoes any scaling of the projections, so it is refused. Under
FSDP and tensor parallelism the scale is applied to each rank's shard of the rows (its own heads' rows under
TP). Optimizer state is left as it is. This module changes weights after a step; it takes no part in the step
itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from moetrain.errors import ConfigError
from moetrain.model.layers import Attention
from moetrain.model.mla import MultiHeadLatentAttention
from moetrain.parallel.mesh import JobMesh

ATTENTION_LAYERS = (Attention, MultiHeadLatentAttention)


def _scale_rows(linear: nn.Linear, scale: Tensor) -> None:
    """Multiply row r of `linear`'s weight (and bias) by scale[r], on whatever shard of it this rank holds."""
    for tensor in (linear.weight, linear.bias):
        if tensor is None:
            continue
        factor = scale.to(device=tensor.device, dtype=tensor.dtype).view(-1, *[1] * (tensor.ndim - 1))
        if isinstance(tensor, DTensor):
            full = factor.expand(tensor.shape).contiguous()
            tensor.to_local().mul_(distribute_tensor(full, tensor.device_mesh, tensor.placements,
                                                     src_data_rank=None).to_local())
        else:
            tensor.mul_(factor)


def _per_head_rows(values: list[Tensor]) -> Tensor:
    """Row scales [H · Σ widths] from per-head scales for each consecutive block of a head's rows:
    `values` holds one [H, width_i] tensor per block (head-major layout: head 0's blocks, then head 1's)."""
    return torch.cat(values, dim=1).reshape(-1)


def _model_row(name: str, n_layers: int) -> int:
    """The row of the attention module `name` ("layers.<i>.attention" or "mtp.<k>.block.attention")."""
    kind, index = name.split(".")[:2]
    return int(index) + (n_layers if kind == "mtp" else 0)


def _world_max(maxima: Tensor) -> Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    return maxima


class QKClip:
    """Records the largest logit per head during a step and clips the heads above τ after it (module docstring)."""

    def __init__(self, model: nn.Module, tau: float, reduce_max: Callable[[Tensor], Tensor] | None = None,
                 across_stages: Callable[[Tensor], Tensor] | None = None, tensor: DeviceMesh | None = None):
        """`reduce_max` takes the elementwise maximum in place over the ranks holding `model`'s attention layers
        (default: every rank of the default process group, each holding every layer; the tensor-parallel ranks
        among them). Under pipeline parallelism `across_stages` takes it over the pipeline ranks, so the maxima
        `clip` returns cover the whole model. `tensor`: the tensor-parallel mesh, whose ranks split the heads."""
        if not tau > 0:
            raise ConfigError(f"train.qk_clip_tau = {tau!r} is invalid: must be > 0 (0 turns QK-clip off)")
        self.tau = tau
        self.reduce_max = reduce_max or _world_max
        self.across_stages = across_stages
        self.tp, self.tp_rank = (1, 0) if tensor is None else (tensor.size(), tensor.get_local_rank())
        named = [(name, m) for name, m in model.named_modules() if isinstance(m, ATTENTION_LAYERS)]
        self.layers = [m for _, m in named]
        if across_stages is not None:  # `model` is a stage's Transformer: its layers' rows in the whole model's
            self.rows = [_model_row(name, model.cfg.n_layers) for name, _ in named]  # [blocks, MTP modules]
            self.n_rows = model.cfg.n_layers + model.cfg.mtp_depth
        for layer in self.layers:
            if isinstance(layer, Attention) and layer.qk_norm != "none":
                raise ConfigError(f"train.qk_clip_tau = {tau!r} is invalid with model.qk_norm = {layer.qk_norm!r}: "
                                  "the norm undoes any scaling of the query and key projections")

    def arm(self) -> None:
        """Start recording: every layer's maximum starts at -inf."""
        for layer in self.layers:  # the rank's own heads under tensor parallelism
            layer.max_logits = torch.full((layer.n_heads // self.tp,), float("-inf"), device=layer.wo.weight.device)

    def disarm(self) -> None:
        for layer in self.layers:
            layer.max_logits = None

    @torch.no_grad()
    def clip(self) -> Tensor:
        """Clip the heads whose maximum over all ranks exceeded τ; stop recording; return the maxima [layers, heads]."""
        maxima = self.reduce_max(self._all_heads(torch.stack([layer.max_logits for layer in self.layers])))
        self.disarm()
        for layer, head_max in zip(self.layers, maxima, strict=True):
            over = head_max > self.tau
            if bool(over.any()):
                eta = torch.where(over, self.tau / head_max, torch.ones_like(head_max))
                self._scale(layer, eta)
        if self.across_stages is None:
            return maxima.cpu()
        # Each stage fills its own layers' rows; the other rows stay -inf until the maximum over the stages.
        whole = torch.full((self.n_rows, maxima.shape[1]), float("-inf"), device=maxima.device)
        whole[self.rows] = maxima
        return self.across_stages(whole).cpu()

    def _all_heads(self, own: Tensor) -> Tensor:
        """[layers, heads]: this rank's maxima [layers, heads / tp] (its batches, its heads) in its columns, -inf in
        the other tensor ranks' (the maximum over the ranks fills those in)."""
        if self.tp == 1:
            return own
        local = own.shape[1]
        whole = torch.full((own.shape[0], local * self.tp), float("-inf"), device=own.device, dtype=own.dtype)
        whole[:, self.tp_rank * local:(self.tp_rank + 1) * local] = own
        return whole

    @staticmethod
    def _scale(layer: nn.Module, eta: Tensor) -> None:
        """Shrink each head's logits by eta[h] through its query and key rows (see the module docstring)."""
        root = eta.sqrt().unsqueeze(1)
        if isinstance(layer, MultiHeadLatentAttention):
            heads = layer.n_heads
            query = layer.wq if layer.q_lora_rank is None else layer.wq_b
            _scale_rows(query, _per_head_rows([root.expand(heads, layer.nope_dim),
                                               eta.unsqueeze(1).expand(heads, layer.rope_dim)]))
            _scale_rows(layer.wkv_b, _per_head_rows([root.expand(heads, layer.nope_dim),
                                                     torch.ones(heads, layer.v_dim, device=eta.device)]))
            return
        heads, kv_heads, width = layer.n_heads, layer.n_kv_heads, layer.head_dim
        if kv_heads == heads:
            _scale_rows(layer.wq, _per_head_rows([root.expand(heads, width)]))
            _scale_rows(layer.wk, _per_head_rows([root.expand(heads, width)]))
        else:
            _scale_rows(layer.wq, _per_head_rows([eta.unsqueeze(1).expand(heads, width)]))


def job_qk_clip(model: nn.Module, tau: float, job: JobMesh, pipeline=None) -> QKClip | None:
    """The job's QK-clip (None when `tau` is 0): under pipeline parallelism `pipeline` (a PipelineStep) reduces the
    maxima over the ranks holding the same stages, then over the stages; the tensor ranks split the heads."""
    if not tau > 0:
        return None
    if pipeline is None:
        return QKClip(model, tau, tensor=job.tensor)
    return QKClip(model, tau, pipeline.data_max, pipeline.pipeline_max, tensor=job.tensor)
