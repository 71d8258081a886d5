"""Document-masked causal attention: the methods `model.attention` selects, and the plan they share.

A packed row holds several documents; a query may attend only to earlier keys of its own document.
`plan_attention` looks at the batch's `document_ids` once per forward and returns an
`AttentionPlan` that every layer reuses; `attend` runs the plan's method on q [B, S, H, D] and
k, v [B, S, H_kv, D] (grouped-query heads: query head h reads kv head h // (H / H_kv), as
`repeat_interleave` lays them out) and returns [B, S, H, D]. The methods:

- "dense": SDPA with a boolean [B, 1, S, S] mask. Cost follows S², whatever the documents;
  it is the reference every other method is tested against.
- "causal": SDPA with `is_causal` and no mask, for rows that are one document each (or no
  document ids). Chosen by the plan, never configured.
- "segments": exact per-document SDPA. Every document (a run of equal ids inside a row) is
  right-padded to a multiple of `SEGMENT_TILE` tokens, documents of equal padded length are
  gathered into one batch and run through SDPA with `is_causal`; the outputs are gathered back.
  Right padding is exact under a causal mask: a real query never sees the padded keys after it,
  and padded queries' outputs are dropped (so their gradients are zero). One SDPA call per padded
  length, no Python loop over documents; cost follows Σ padded_length² instead of S².
- "blocks": exact block-local SDPA. The row is cut into query blocks of `BLOCK_SIZE` tokens; a
  block's queries can only reach keys from the start of the document holding its first query up
  to its own end, so each block attends to the key blocks from that document's block on, with a
  small [BLOCK_SIZE, n·BLOCK_SIZE] "same document and causal" mask. Blocks needing the same
  number n of key blocks share one masked SDPA call: a handful of calls per batch (n is 1–3 for
  short documents), no per-document padding, and the query blocks are reshapes of q, so only
  keys and values are gathered. Cost follows Σ n·BLOCK_SIZE² over blocks.
- "flex": `flex_attention` with a block mask (same document and causal). Compiled on CUDA,
  where it skips the masked blocks; eager on CPU, where torch 2.13 has no backward for it, so
  it serves inference and the forward tests only.
- "auto": "causal" when every row is one document; else "flex" on CUDA; on CPU "segments"
  when the padded segment work is at most `SEGMENTS_PAY_OFF` of the dense work, else "dense"
  ("blocks" measured slower than "segments" in float32 at every mix and no faster beyond the noise in
  bf16, so auto does not pick it).

Two per-layer options compose with every method (`attend(..., sinks=, window=)`):

- a sliding window: query i also needs i - j < window (the window counts the query itself, as
  transformers' `sliding_window` does), on top of "same document and causal";
- attention sinks (GPT-OSS): one learned logit per query head that joins the softmax's
  denominator and carries no value: out = Σ_j e^{s_j} v_j / (Σ_j e^{s_j} + e^{sink}).

The SDPA methods ("dense", "segments", "blocks", and "causal" rows) realise a sink as one extra
key whose k and v are zero and whose logit an additive float mask sets to the head's sink (q·0 = 0,
so the score is exactly the sink and its value adds nothing); the window is part of the boolean
mask (for "segments" a band inside each padded document, for "blocks" a band inside each key
span). "flex" puts the window in its mask_mod and applies the sink from the log-sum-exp flex
returns: out · sigmoid(lse - sink), the same quantity. A "causal" plan with either option runs the
dense band mask on CPU and flex on CUDA. Masks and block masks a window needs are built once per
forward and window (cached in the plan).

On CPU, a float32 or bf16 call whose scores B·H·L·Lk fit `GEMM_ATTENTION_MAX_SCORES` skips SDPA for
the GEMM attention (`gemm_attention.GemmAttention`: batched GEMMs over causal query chunks, torch's fused softmax,
the probabilities saved for the backward), with the same masks, windows and sinks: SDPA's CPU flash
kernel ran at a third of the bf16 GEMM rate at the model's shapes (docs/design/performance.md).

`max_logit_per_head` is what QK-clip (train/qk_clip.py) reads: each head's largest pre-softmax logit over
the keys the plan lets it see, computed apart from the attention itself (an extra q·kᵀ in float32), and only
when a layer is asked to record it.

Documents must be contiguous runs (each id appears in one run per row, as packing produces):
"dense" and "flex" compare ids, "segments" cuts at id changes. This module holds no parameters
and no projections (layers.Attention does); from moetrain.model it imports the GEMM attention only.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention

from moetrain.model.gemm_attention import GemmAttention, use_gemm_attention

METHODS = ("auto", "dense", "segments", "blocks", "flex")
# Query block of "blocks". Measured (docs/results.md) against 32 and 128: 32 was best at mean document
# length 64, 128 at 256 and 1024; 64 sits between. "blocks" is not auto's choice (segments measured faster).
BLOCK_SIZE = 64
# Documents are padded to a multiple of this many tokens, so documents of nearby lengths share one
# SDPA call. `moetrain bench attention` (docs/results.md): the best median of tiles 1, 16, 32, 64
# on float32 rows of mean document length 64 (an earlier experiment: better than powers of two);
# other mixes favoured 32 or 64, within the noise of a shared machine.
SEGMENT_TILE = 16
# "auto" takes "segments" on CPU when Σ padded_length² ≤ this fraction of B·S². Measured (docs/results.md,
# lock held, 2x1024 rows): segments beat the dense mask 1.87x (float32) and 1.57x (bf16) at a work ratio of
# 0.640, where the old bound 0.5 chose dense; above 1 (a short document beside a long one) dense stays.
SEGMENTS_PAY_OFF = 0.7

_compiled_flex = None  # torch.compile(flex_attention), built on the first CUDA call


@dataclass
class SegmentLayout:
    """Where each document's tokens go in the padded, length-grouped layout ("segments").

    `gather` [P] picks, for each of the P padded slots, a flat token index b*S + s (padding
    slots repeat a token of their own document: any finite value is exact, see the module
    docstring); `scatter` [B*S] is the slot holding each token's output; `groups` lists
    (documents, padded length) in slot order.
    """

    gather: Tensor
    scatter: Tensor
    groups: list[tuple[int, int]]

    def padded_work(self) -> int:
        """Σ over documents of padded_length², the attention scores the layout computes (per head)."""
        return sum(n * length * length for n, length in self.groups)


@dataclass
class BlockGroup:
    """Query blocks that attend to the same number of key blocks ("blocks"): one masked SDPA call."""

    key_blocks: int  # n: each query block attends to its own and the n - 1 preceding key blocks
    query_index: Tensor  # [G] flat block index b * (S / block) + i of each query block
    key_index: Tensor  # [G * n] flat block indices of their key blocks, in order
    mask: Tensor  # [G, 1, block, n * block] bool: same document and causal


@dataclass
class BlockLayout:
    """How "blocks" cuts [B, S] into query blocks and groups them; `inverse` restores block order."""

    block: int
    padded_seq: int  # S rounded up to a multiple of `block`; the tail is a document of its own
    groups: list[BlockGroup]
    inverse: Tensor | None  # [B * padded_seq / block]; None when there is one group in block order

    def work(self) -> int:
        """Attention scores the layout computes (per head): Σ over query blocks of n · block²."""
        return sum(g.query_index.numel() * g.key_blocks * self.block * self.block for g in self.groups)


@dataclass
class AttentionPlan:
    """The method one forward uses in every layer, with what it needs, built once from the document ids."""

    method: str  # "dense" | "causal" | "segments" | "flex"
    mask: Tensor | None = None  # "dense": [B, 1, S, S] bool
    segments: SegmentLayout | None = None
    blocks: BlockLayout | None = None
    block_mask: BlockMask | None = None
    document_ids: Tensor | None = None  # [B, S]; None for "causal" (every row one document)
    # An attention function the caller supplies, (q, k, v, sinks, window) -> out, used instead of the method:
    # context parallelism's, whose keys and values live on other ranks too (moetrain.parallel.context_parallel
    # runs moetrain.model.tiled_attention with the CP group's collectives).
    external: Callable[..., Tensor] | None = None
    # Masks built for a sliding window (or a "causal" plan with sinks), once per forward: key (kind, window).
    cache: dict = field(default_factory=dict, repr=False)

    def mask_for(self, seq: int, device: torch.device, window: int | None) -> Tensor:
        """The [B or 1, 1, S, S] boolean mask of this plan's documents (all one document for "causal"),
        restricted to the sliding window when one is given."""
        key = ("mask", window)
        if key not in self.cache:
            if self.document_ids is not None:
                mask = self.mask if self.mask is not None else document_causal_mask(self.document_ids)
            else:
                mask = torch.ones(seq, seq, dtype=torch.bool, device=device).tril().view(1, 1, seq, seq)
            self.cache[key] = mask if window is None else mask & window_band(seq, seq, window, device)
        return self.cache[key]

    def block_mask_for(self, batch: int, seq: int, device: torch.device, window: int | None) -> BlockMask:
        """flex's block mask of this plan's documents, restricted to the window when one is given."""
        if window is None and self.block_mask is not None:
            return self.block_mask
        key = ("block_mask", window)
        if key not in self.cache:
            self.cache[key] = document_block_mask(self.document_ids, window, batch, seq, device)
        return self.cache[key]


def document_causal_mask(document_ids: Tensor) -> Tensor:
    """Boolean mask [B, 1, S, S]: True where query i may attend key j (same document, j <= i)."""
    seq = document_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    same_doc = document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)
    return (same_doc & causal).unsqueeze(1)


def segment_layout(document_ids: Tensor, tile: int = SEGMENT_TILE) -> SegmentLayout:
    """Group the documents (runs of equal ids in each row) of [B, S] ids by length rounded up to `tile`."""
    batch, seq = document_ids.shape
    device = document_ids.device
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.nonzero(starts.reshape(-1)).squeeze(1)  # flat index of each document's first token
    lengths = torch.diff(first, append=torch.tensor([batch * seq], device=device))
    padded = (lengths + tile - 1) // tile * tile
    order = torch.sort(padded, stable=True).indices  # documents of one padded length become adjacent
    first, lengths, padded = first[order], lengths[order], padded[order]
    doc_of_slot = torch.repeat_interleave(torch.arange(first.numel(), device=device), padded)
    slot_start = torch.cumsum(padded, 0) - padded
    offset = torch.arange(doc_of_slot.numel(), device=device) - slot_start[doc_of_slot]
    valid = offset < lengths[doc_of_slot]
    gather = first[doc_of_slot] + torch.minimum(offset, lengths[doc_of_slot] - 1)
    scatter = torch.empty(batch * seq, dtype=torch.long, device=device)
    scatter[gather[valid]] = torch.nonzero(valid).squeeze(1)
    lengths_of_groups, documents = torch.unique_consecutive(padded, return_counts=True)
    groups = list(zip(documents.tolist(), lengths_of_groups.tolist(), strict=True))
    return SegmentLayout(gather=gather, scatter=scatter, groups=groups)


def block_layout(document_ids: Tensor, block: int = BLOCK_SIZE) -> BlockLayout:
    """Cut [B, S] ids into query blocks of `block` tokens and group them by the key blocks they need."""
    batch, seq = document_ids.shape
    device = document_ids.device
    padded_seq = -(-seq // block) * block
    starts = torch.ones(batch, padded_seq, dtype=torch.bool, device=device)
    starts[:, 1:seq] = document_ids[:, 1:] != document_ids[:, :-1]
    starts[:, seq + 1:] = False  # the padding tail is one document, its own (its outputs are dropped)
    # Documents are compared by run number, not id: runs never repeat, across rows included.
    run = torch.cumsum(starts.reshape(-1), 0).view(batch, padded_seq)
    position = torch.arange(padded_seq, device=device)
    document_start = torch.cummax(torch.where(starts, position, 0), dim=1).values
    n_blocks = padded_seq // block
    # Every query of a block lies in the document of its first query or a later one, so keys before
    # that document's start are masked for the whole block.
    key_blocks = (torch.arange(n_blocks, device=device) - document_start[:, ::block] // block + 1).reshape(-1)
    order = torch.sort(key_blocks, stable=True).indices
    counts_of, counts = torch.unique_consecutive(key_blocks[order], return_counts=True)
    run_of_block = run.view(batch * n_blocks, block)
    groups = []
    for n, query_index in zip(counts_of.tolist(), order.split(counts.tolist()), strict=True):
        key_index = (query_index.unsqueeze(1) - n + 1 + torch.arange(n, device=device)).reshape(-1)
        query_run = run_of_block[query_index].unsqueeze(2)  # [G, block, 1]
        key_run = run_of_block[key_index].view(-1, 1, n * block)  # [G, 1, n * block]
        query_pos = torch.arange(block, device=device).unsqueeze(1) + (n - 1) * block  # within the key span
        causal = query_pos >= torch.arange(n * block, device=device)
        groups.append(BlockGroup(n, query_index, key_index, ((query_run == key_run) & causal).unsqueeze(1)))
    inverse = None
    if len(groups) > 1:
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=device)
    return BlockLayout(block=block, padded_seq=padded_seq, groups=groups, inverse=inverse)


def window_band(queries: int, keys: int, window: int, device: torch.device, offset: int = 0) -> Tensor:
    """[queries, keys] bool: query i (at position i + offset among the keys) sees key j when i + offset - j < window.

    Only the window's lower edge: the causal part (j <= i + offset) comes from the mask it is combined with.
    """
    query_pos = torch.arange(queries, device=device).unsqueeze(1) + offset
    return query_pos - torch.arange(keys, device=device) < window


def document_block_mask(document_ids: Tensor | None, window: int | None = None, batch: int | None = None,
                        seq: int | None = None, device: torch.device | None = None) -> BlockMask:
    """flex_attention's block mask for "same document and causal" over [B, S] ids (all heads alike),
    and inside the sliding window when one is given. `document_ids` None: every row is one document
    (then `batch`, `seq` and `device` say the shape)."""
    if document_ids is not None:
        batch, seq = document_ids.shape
        device = document_ids.device

    def allowed(b, h, q_idx, kv_idx):
        keep = q_idx >= kv_idx
        if document_ids is not None:
            keep = keep & (document_ids[b, q_idx] == document_ids[b, kv_idx])
        if window is not None:
            keep = keep & (q_idx - kv_idx < window)
        return keep

    return create_block_mask(allowed, batch if document_ids is not None else None, None, seq, seq, device=device)


def plan_attention(document_ids: Tensor | None, method: str) -> AttentionPlan:
    """Resolve `method` (one of METHODS) for this batch and prepare what it needs once for all layers."""
    if method not in METHODS:
        raise ValueError(f"attention method {method!r} is not one of {METHODS}")
    if document_ids is None:
        return AttentionPlan("causal")
    ids = document_ids
    if method == "dense":
        return AttentionPlan("dense", mask=document_causal_mask(ids), document_ids=ids)
    if method == "flex":
        return AttentionPlan("flex", block_mask=document_block_mask(ids), document_ids=ids)
    if method == "segments":
        return AttentionPlan("segments", segments=segment_layout(ids), document_ids=ids)
    if method == "blocks":
        return AttentionPlan("blocks", blocks=block_layout(ids), document_ids=ids)
    if bool((ids == ids[:, :1]).all()):  # auto: one document per row
        return AttentionPlan("causal")
    if ids.is_cuda:
        return AttentionPlan("flex", block_mask=document_block_mask(ids), document_ids=ids)
    layout = segment_layout(ids)
    batch, seq = ids.shape
    if layout.padded_work() <= SEGMENTS_PAY_OFF * batch * seq * seq:
        return AttentionPlan("segments", segments=layout, document_ids=ids)
    return AttentionPlan("dense", mask=document_causal_mask(ids), document_ids=ids)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Tensor:
    """SDPA on [N, L, H, D] tensors (heads-second views for the kernel), grouped-query heads expanded."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          enable_gqa=q.shape[2] != k.shape[2], **kwargs).transpose(1, 2)


def _masked_sdpa(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, sinks: Tensor | None) -> Tensor:
    """`masked_sdpa`, or below the size bound on CPU the GEMM attention (mask and sinks applied inside)."""
    if use_gemm_attention(q, k.shape[1]):
        return GemmAttention.apply(q, k, v, allowed, sinks)
    return masked_sdpa(q, k, v, allowed, sinks)


def masked_sdpa(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, sinks: Tensor | None) -> Tensor:
    """SDPA on [N, L, H, D] / [N, Lk, H_kv, D] under a boolean mask broadcastable to [N, 1, L, Lk], with
    optional sinks [H]: one zero key and value appended, its logit set to the head's sink by a float mask.
    The keys may come in any order (the mask alone says which a query sees).
    `allowed` may also be that mask as an additive float mask (0 / -inf) in q's dtype: SDPA's CPU flash kernel
    then uses it as it is, where it would make a float copy of a boolean mask in every call."""
    if sinks is None:
        return _sdpa(q, k, v, attn_mask=allowed)
    n, length, heads, _ = q.shape
    bias = (allowed if allowed.is_floating_point() else
            torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf")))
    bias = bias.expand(n, heads, length, allowed.shape[-1])
    sink_column = sinks.to(q.dtype).view(1, heads, 1, 1).expand(n, heads, length, 1)
    k, v = (F.pad(t, (0, 0, 0, 0, 0, 1)) for t in (k, v))  # the sink's key and value: zeros
    return _sdpa(q, k, v, attn_mask=torch.cat((bias, sink_column), dim=-1))


class _GatherIntoSegments(torch.autograd.Function):
    """x [N, ...] -> x[gather] [P, ...]; backward reads each token's gradient from its own slot only.

    The padding slots' gradients are exactly zero (their queries' outputs are dropped, their keys
    lie after every real query under the causal mask), so picking `scatter` instead of summing
    over all slots is exact, and saves autograd's zero fill and accumulating index_put.
    """

    @staticmethod
    def forward(ctx, x: Tensor, gather: Tensor, scatter: Tensor) -> Tensor:
        ctx.save_for_backward(scatter)
        return x[gather]

    @staticmethod
    def backward(ctx, grad: Tensor):
        (scatter,) = ctx.saved_tensors
        return grad[scatter], None, None


class _ScatterFromSegments(torch.autograd.Function):
    """out_padded [P, ...] -> out_padded[scatter] [N, ...]; backward puts each gradient in its slot, zeros elsewhere."""

    @staticmethod
    def forward(ctx, x: Tensor, scatter: Tensor) -> Tensor:
        ctx.save_for_backward(scatter)
        ctx.padded_rows = x.shape[0]
        return x[scatter]

    @staticmethod
    def backward(ctx, grad: Tensor):
        (scatter,) = ctx.saved_tensors
        return grad.new_zeros(ctx.padded_rows, *grad.shape[1:]).index_copy_(0, scatter, grad), None


def _attend_segments(q: Tensor, k: Tensor, v: Tensor, layout: SegmentLayout, sinks: Tensor | None = None,
                     window: int | None = None) -> Tensor:
    batch, seq, heads, head_dim = q.shape
    q_pad, k_pad, v_pad = (_GatherIntoSegments.apply(t.reshape(batch * seq, *t.shape[2:]), layout.gather,
                                                     layout.scatter) for t in (q, k, v))
    # split, not slicing: its backward is one cat, where each slice's backward would fill a full-size zero gradient.
    sizes = [documents * length for documents, length in layout.groups]
    outputs = []
    for (documents, length), q_g, k_g, v_g in zip(layout.groups, *(t.split(sizes) for t in (q_pad, k_pad, v_pad)),
                                                  strict=True):
        q_g, k_g, v_g = (t.unflatten(0, (documents, length)) for t in (q_g, k_g, v_g))
        if sinks is None and window is None:
            causal = (GemmAttention.apply(q_g, k_g, v_g, None, None) if use_gemm_attention(q_g, length)
                      else _sdpa(q_g, k_g, v_g, is_causal=True))
            outputs.append(causal.flatten(0, 1))
            continue
        # Every document of the group starts at slot 0: one [length, length] causal band serves them all.
        band = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        if window is not None:
            band = band & window_band(length, length, window, q.device)
        outputs.append(_masked_sdpa(q_g, k_g, v_g, band.view(1, 1, length, length), sinks).flatten(0, 1))
    out_pad = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
    return _ScatterFromSegments.apply(out_pad, layout.scatter).view(batch, seq, heads, -1)


def _attend_blocks(q: Tensor, k: Tensor, v: Tensor, layout: BlockLayout, sinks: Tensor | None = None,
                   window: int | None = None) -> Tensor:
    batch, seq, heads, head_dim = q.shape
    block, tail = layout.block, layout.padded_seq - seq
    if tail:  # zero tokens in a document of their own: no real query reaches them; their outputs are cut
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, tail)) for t in (q, k, v))
    # Query blocks are a reshape of q; index_select's backward sums each key block's gradient over
    # the query blocks that read it.
    q_blocks, k_blocks, v_blocks = (t.reshape(-1, block, *t.shape[2:]) for t in (q, k, v))
    outputs = []
    for group in layout.groups:
        span = group.key_blocks * block
        q_g = q_blocks if layout.inverse is None else q_blocks.index_select(0, group.query_index)
        k_g, v_g = (t.index_select(0, group.key_index).view(-1, span, *t.shape[2:]) for t in (k_blocks, v_blocks))
        mask = group.mask
        if window is not None:  # query i of the block sits at (n - 1) * block + i in its key span
            mask = mask & window_band(block, span, window, q.device, offset=span - block)
        outputs.append(_masked_sdpa(q_g, k_g, v_g, mask, sinks))
    out = outputs[0] if layout.inverse is None else torch.cat(outputs).index_select(0, layout.inverse)
    return out.reshape(batch, layout.padded_seq, heads, -1)[:, :seq]


def _attend_flex(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask, sinks: Tensor | None = None) -> Tensor:
    global _compiled_flex
    if q.is_cuda:
        if _compiled_flex is None:  # eager flex materialises the full scores; compiled it skips masked blocks
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        kernel = _compiled_flex
    else:
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise NotImplementedError("model.attention = 'flex' has no backward on CPU in torch 2.13; "
                                      "use 'segments' or 'auto' to train on CPU")
        kernel = flex_attention
    with warnings.catch_warnings():  # eager on CPU is deliberate (inference, tests): no "use torch.compile" notice
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        extra = {} if sinks is None else {"return_aux": AuxRequest(lse=True)}
        out = kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask,
                     enable_gqa=q.shape[2] != k.shape[2], **extra)
    if sinks is None:
        return out.transpose(1, 2)
    out, aux = out
    # The sink joins the denominator only: out · Z / (Z + e^sink) = out · sigmoid(lse - sink).
    keep = torch.sigmoid(aux.lse.float() - sinks.float().view(1, -1, 1)).to(out.dtype)  # [B, H, S]
    return (out * keep.unsqueeze(-1)).transpose(1, 2)


def _sdpa_repeated_kv(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """SDPA with the kv heads repeated to the query heads: the computation moetrain has always done
    (the GEMM attention, which needs no repeat, below its size bound on CPU)."""
    if use_gemm_attention(q, k.shape[1]):
        return GemmAttention.apply(q, k, v, mask, None)
    repeats = q.shape[2] // k.shape[2]
    if repeats > 1:  # each kv head serves `repeats` consecutive query heads
        k, v = k.repeat_interleave(repeats, dim=2), v.repeat_interleave(repeats, dim=2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


@torch.no_grad()
def max_logit_per_head(q: Tensor, k: Tensor, plan: AttentionPlan | None, window: int | None = None) -> Tensor:
    """[H] in float32 (float64 for float64 inputs): each query head's largest q·k/√D over the keys `attend`
    lets it see (sinks are not q·k logits).

    q [B, S, H, D], k [B, S, H_kv, D] as `attend` gets them (so the scale is its SDPA scale). A plan whose
    attention is external (context parallelism: the keys of the rows live on other ranks too) brings its own.
    """
    if plan is not None and plan.external is not None:
        return plan.external.max_logit_per_head(q, k, window)
    allowed = (plan or AttentionPlan("causal")).mask_for(q.shape[1], q.device, window)  # [B or 1, 1, S, S]
    return masked_max_logit_per_head(q, k, allowed)


@torch.no_grad()
def masked_max_logit_per_head(q: Tensor, k: Tensor, allowed: Tensor) -> Tensor:
    """[H]: each query head's largest q·k/√D over the keys `allowed` [B or 1, 1, S_q, S_k] (bool) lets it see,
    for q [B, S_q, H, D] and k [B, S_k, H_kv, D]."""
    batch, seq, heads, head_dim = q.shape
    groups = k.shape[2]
    dtype = torch.promote_types(q.dtype, torch.float32)
    q_g = q.to(dtype).view(batch, seq, groups, heads // groups, head_dim)
    scores = torch.einsum("bsgrd,btgd->bgrst", q_g, k.to(dtype)) * head_dim ** -0.5
    scores = scores.masked_fill(~allowed.view(allowed.shape[0], 1, 1, seq, k.shape[1]), float("-inf"))
    return scores.amax(dim=(0, 3, 4)).reshape(heads)  # query head h = g·r + i, as attend pairs them


def attend(q: Tensor, k: Tensor, v: Tensor, plan: AttentionPlan | None, sinks: Tensor | None = None,
           window: int | None = None) -> Tensor:
    """Document-masked causal attention of q [B, S, H, D] over k, v [B, S, H_kv, D] -> [B, S, H, D].

    `plan` None: plain causal attention (every row one document). `sinks` [H]: one learned logit per
    query head in the softmax's denominator; `window`: query i sees keys j > i - window only.
    """
    if window is not None and window < 1:
        raise ValueError(f"sliding window {window} must be a positive number of tokens")
    if sinks is not None and sinks.shape != (q.shape[2],):
        raise ValueError(f"sinks shape {tuple(sinks.shape)} != ({q.shape[2]},): one per query head")
    plain = sinks is None and window is None
    if plan is None:
        plan = AttentionPlan("causal")
    if plan.external is not None:
        return plan.external(q, k, v, sinks, window)
    batch, seq = q.shape[:2]
    if plan.method == "causal":
        if plain:
            return _sdpa_repeated_kv(q, k, v, None)
        if q.is_cuda:
            return _attend_flex(q, k, v, plan.block_mask_for(batch, seq, q.device, window), sinks)
        return _masked_sdpa(q, k, v, plan.mask_for(seq, q.device, window), sinks)
    if plan.method == "dense":
        if plain:
            return _sdpa_repeated_kv(q, k, v, plan.mask)
        return _masked_sdpa(q, k, v, plan.mask_for(seq, q.device, window), sinks)
    if plan.method == "segments":
        return _attend_segments(q, k, v, plan.segments, sinks, window)
    if plan.method == "blocks":
        return _attend_blocks(q, k, v, plan.blocks, sinks, window)
    if plan.method == "flex":
        return _attend_flex(q, k, v, plan.block_mask_for(batch, seq, q.device, window), sinks)
    raise ValueError(f"attention plan method {plan.method!r} is unknown")
