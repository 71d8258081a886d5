"""Tiled attention with an online softmax: exact document-masked causal attention whose memory is linear in the keys.

Context parallelism needs attention from a rank's queries (a few contiguous runs of token indices) to the
keys of the whole rows, which other ranks computed. Materialising a [queries x whole row] mask or score
matrix costs more than the rank's share of every other activation at long rows, so this module cuts
queries and keys into tiles and never holds more than one tile's scores:

- `plan_tiles` lists, once per forward, the (query tile, key tile) pairs a plan needs from the token
  indices of the queries and keys and the rows' document ids: a pair whose keys all lie after its queries,
  outside the sliding window or in other documents is skipped; a pair whose keys every query sees
  (earlier keys of the same document, inside the window) runs without a mask; the rest build a small
  [B, tile, tile] "same document, causal, in window" mask when they run. Documents must be contiguous runs
  of equal ids (as packing produces and `model.attention` assumes), so two ids per row decide a pair.
- `TiledAttention` (a custom autograd function) runs the forward tile by tile with the online softmax
  (running maximum, running denominator, rescaled accumulator; float32 inside for bf16/float32, float64
  for float64) and saves only q, this rank's k and v, the output and the log-sum-exp per query. The
  backward recomputes each tile's probabilities from the saved log-sum-exp (dS = P (dP - δ), δ = dO·O)
  and accumulates dq, dk, dv. Attention sinks join the denominator after the last tile (lse ⊕ sink) and
  get their gradient -Σ P_sink·δ.

The keys and values of the whole rows come from an `exchange` the caller passes: `gather` turns this
rank's [Lk_local, B, F] (sequence first) into the rows' [Lk, B, F] (called in the forward and again in the
backward, so the gathered keys are never saved), `reduce_scatter` sums the [Lk, B, F] key/value gradients
back to this rank's share. This module holds no distributed code (moetrain.parallel.context_parallel supplies the
collectives; identity functions give single-process attention, what the unit tests compare with SDPA).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

# Keys per tile, and the bound on one tile's scores (B·H·query_tile·key_tile elements, 1 MiB in float32):
# the query tile is what fits it, between MIN_QUERY_TILE and KEY_TILE. A few tiles' scores are alive at
# once (scores, probabilities, their gradient), so this bound is the kernel's memory beyond its inputs.
KEY_TILE = 512
TILE_SCORES = 1 << 18
MIN_QUERY_TILE = 16


@dataclass(frozen=True)
class KeyTile:
    keys: slice  # positions in the gathered keys
    key_start: int  # token index of the first key (the tile's keys are contiguous tokens)
    masked: bool  # False: every query of the tile sees every key of it


@dataclass(frozen=True)
class QueryTile:
    queries: slice  # positions in this rank's queries
    query_start: int  # token index of the first query
    keys: tuple[KeyTile, ...]


@dataclass(frozen=True)
class TilePlan:
    """The tiles one attention call computes, and what its masked tiles need to build their masks."""

    tiles: tuple[QueryTile, ...]
    document_ids: Tensor | None  # [B, S] by token index; None: every row one document
    window: int | None

    def mask(self, query: QueryTile, key: KeyTile, queries: int, keys: int) -> Tensor:
        """[B or 1, 1, 1, queries, keys] bool: same document, causal, inside the window."""
        device = self.document_ids.device if self.document_ids is not None else "cpu"
        q_tok = torch.arange(query.query_start, query.query_start + queries, device=device).unsqueeze(1)
        k_tok = torch.arange(key.key_start, key.key_start + keys, device=device)
        allowed = k_tok <= q_tok
        if self.window is not None:
            allowed = allowed & (q_tok - k_tok < self.window)
        if self.document_ids is not None:
            q_doc = self.document_ids[:, query.query_start:query.query_start + queries].unsqueeze(2)
            k_doc = self.document_ids[:, key.key_start:key.key_start + keys].unsqueeze(1)
            allowed = allowed & (q_doc == k_doc)
        return allowed.view(-1, 1, 1, queries, keys)


def contiguous_runs(index: Tensor) -> list[tuple[int, int, int]]:
    """(position, first token index, length) of each run of consecutive token indices in `index`."""
    values = index.tolist()
    runs, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[i - 1] + 1:
            runs.append((start, values[start], i - start))
            start = i
    return runs


def _cut(runs: list[tuple[int, int, int]], size: int) -> list[tuple[int, int, int]]:
    return [(pos + a, tok + a, min(size, length - a)) for pos, tok, length in runs for a in range(0, length, size)]


def plan_tiles(query_index: Tensor, key_index: Tensor, document_ids: Tensor | None, window: int | None,
               batch_heads: int) -> TilePlan:
    """The tiles of attention from queries at token indices `query_index` [Lq] to keys at `key_index` [Lk]
    (each a few contiguous runs), `batch_heads` = B·H sizing the query tiles."""
    query_tile = max(MIN_QUERY_TILE, min(KEY_TILE, TILE_SCORES // (batch_heads * KEY_TILE)))
    key_tiles = _cut(contiguous_runs(key_index), KEY_TILE)
    ids = None if document_ids is None else document_ids.tolist()
    tiles = []
    for q_pos, q_lo, q_len in _cut(contiguous_runs(query_index), query_tile):
        q_hi = q_lo + q_len - 1
        keys = []
        for k_pos, k_lo, k_len in key_tiles:
            k_hi = k_lo + k_len - 1
            if k_lo > q_hi or (window is not None and q_lo - k_hi >= window):
                continue  # after every query, or before every query's window
            # Contiguous documents: a query of the tile shares a document with an earlier key of it only
            # if one document runs from k_hi to q_lo; every pair does if one runs from k_lo to q_hi.
            if ids is not None and k_hi < q_lo and all(row[k_hi] != row[q_lo] for row in ids):
                continue
            full = k_hi <= q_lo and (window is None or q_hi - k_lo < window) and (
                ids is None or all(row[k_lo] == row[q_hi] for row in ids))
            keys.append(KeyTile(slice(k_pos, k_pos + k_len), k_lo, not full))
        tiles.append(QueryTile(slice(q_pos, q_pos + q_len), q_lo, tuple(keys)))
    return TilePlan(tuple(tiles), document_ids, window)


@dataclass(frozen=True)
class KeyValueExchange:
    """How the keys and values of the whole rows are had from this rank's (dimension 0 is the sequence)."""

    gather: Callable[[Tensor], Tensor]
    reduce_scatter: Callable[[Tensor], Tensor]


IDENTITY = KeyValueExchange(lambda t: t, lambda t: t)


def _whole_rows(k: Tensor, v: Tensor, exchange: KeyValueExchange, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The rows' keys [B, G, Lk, D] and values [B, G, Lk, Dv] in `dtype` (views of one gathered tensor), from
    this rank's [B, Lk_local, G, D]. Exchanged sequence first, [Lk_local, B, F]: the collectives then write
    and read whole blocks, with no copy to put the sequence dimension in place."""
    batch, local, groups, head_dim = k.shape
    kv_local = torch.cat((k.reshape(batch, local, -1), v.reshape(batch, local, -1)), dim=-1).transpose(0, 1)
    kv = exchange.gather(kv_local.contiguous()).to(dtype)
    return _key_value_views(kv, groups, head_dim)


def _key_value_views(kv: Tensor, groups: int, head_dim: int) -> tuple[Tensor, Tensor]:
    """[B, G, Lk, D] and [B, G, Lk, Dv] views of a sequence-first [Lk, B, G·D + G·Dv] tensor."""
    keys, batch, width = kv.shape
    k_part, v_part = kv.split((groups * head_dim, width - groups * head_dim), dim=-1)
    return (t.unflatten(-1, (groups, -1)).permute(1, 2, 0, 3) for t in (k_part, v_part))


def _scores(q_t: Tensor, k_all: Tensor, plan: TilePlan, query: QueryTile, key: KeyTile, scale: float,
            rep: int) -> Tensor:
    """[B, G, r·lq, lk] scaled scores of one tile, -inf where its mask forbids."""
    k_t = k_all[:, :, key.keys]
    scores = torch.matmul(q_t, k_t.transpose(-1, -2)).mul_(scale)
    if key.masked:
        batch, groups, rows, keys = scores.shape
        allowed = plan.mask(query, key, rows // rep, keys)
        scores.view(batch, groups, rep, rows // rep, keys).masked_fill_(~allowed, float("-inf"))
    return scores


def _sink_rows(sinks: Tensor, groups: int, rep: int, queries: int, dtype: torch.dtype) -> Tensor:
    """[1, G, r·lq, 1]: each row's head's sink logit (query head h = g·r + i)."""
    return sinks.detach().to(dtype).view(1, groups, rep, 1, 1).expand(1, groups, rep, queries, 1).reshape(
        1, groups, rep * queries, 1)


class TiledAttention(torch.autograd.Function):
    """Attention of q [B, L, H, D] to the gathered k [B, Lk, G, D], v [B, Lk, G, Dv] over `plan`'s tiles.

    Grouped-query heads h = g·r + i share kv head g. Returns [B, L, H, Dv] in q's dtype. `sinks` [H] or None.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, plan: TilePlan,
                exchange: KeyValueExchange) -> Tensor:
        batch, length, heads, head_dim = q.shape
        groups = k.shape[2]
        rep = heads // groups
        compute = torch.promote_types(q.dtype, torch.float32)
        scale = head_dim ** -0.5
        k_all, v_all = _whole_rows(k, v, exchange, compute)
        q_g = q.reshape(batch, length, groups, rep, head_dim).permute(0, 2, 3, 1, 4)  # [B, G, r, L, D]
        out = q.new_empty(batch, groups, rep, length, v_all.shape[-1])
        lse = torch.empty(batch, groups, rep, length, dtype=compute, device=q.device)
        for query in plan.tiles:
            rows = query.queries.stop - query.queries.start
            q_t = q_g[:, :, :, query.queries].reshape(batch, groups, rep * rows, head_dim).to(compute)
            top = q_t.new_full((batch, groups, rep * rows, 1), float("-inf"))
            denominator = q_t.new_zeros(top.shape)
            acc = q_t.new_zeros(batch, groups, rep * rows, v_all.shape[-1])
            for key in query.keys:
                scores = _scores(q_t, k_all, plan, query, key, scale, rep)
                new_top = torch.maximum(top, scores.amax(dim=-1, keepdim=True))
                # A row that has seen no allowed key yet keeps -inf: shift it by 0 so exp gives 0, not NaN.
                shift = torch.where(torch.isfinite(new_top), new_top, 0.0)
                probs = scores.sub_(shift).exp_()
                rescale = (top - shift).exp_()
                denominator.mul_(rescale).add_(probs.sum(dim=-1, keepdim=True))
                acc.mul_(rescale).add_(torch.matmul(probs, v_all[:, :, key.keys]))
                top = new_top
            row_lse = top + denominator.log()
            if sinks is not None:  # the sink joins the denominator only
                row_lse = torch.logaddexp(row_lse, _sink_rows(sinks, groups, rep, rows, compute))
            out_t = acc.mul_((top - row_lse).exp_())
            out[:, :, :, query.queries] = out_t.view(batch, groups, rep, rows, -1).to(q.dtype)
            lse[:, :, :, query.queries] = row_lse.view(batch, groups, rep, rows)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.plan, ctx.exchange = plan, exchange
        return out.permute(0, 3, 1, 2, 4).reshape(batch, length, heads, -1)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        plan, exchange = ctx.plan, ctx.exchange
        batch, length, heads, head_dim = q.shape
        groups = k.shape[2]
        rep = heads // groups
        compute = lse.dtype
        scale = head_dim ** -0.5
        k_all, v_all = _whole_rows(k, v, exchange, compute)  # gathered again: never saved
        grad_g = grad_out.reshape(batch, length, groups, rep, -1).permute(0, 2, 3, 1, 4)
        q_g = q.reshape(batch, length, groups, rep, head_dim).permute(0, 2, 3, 1, 4)
        grad_q = q.new_empty(batch, groups, rep, length, head_dim)
        # Accumulated in place in the sequence-first layout the reduce-scatter sends: no copy before it.
        grad_kv = k_all.new_zeros(k_all.shape[2], batch, groups * (head_dim + v_all.shape[-1]))
        grad_k, grad_v = _key_value_views(grad_kv, groups, head_dim)
        grad_sinks = None if sinks is None else torch.zeros(heads, dtype=compute, device=q.device)
        for query in plan.tiles:
            rows = query.queries.stop - query.queries.start
            q_t, grad_t, out_t = (t[:, :, :, query.queries].reshape(batch, groups, rep * rows, -1).to(compute)
                                  for t in (q_g, grad_g, out))
            lse_t = lse[:, :, :, query.queries].reshape(batch, groups, rep * rows, 1)
            delta = (grad_t * out_t).sum(dim=-1, keepdim=True)  # δ = Σ_j P_j dP_j = dO·O
            grad_q_t = torch.zeros_like(q_t)
            for key in query.keys:
                probs = _scores(q_t, k_all, plan, query, key, scale, rep).sub_(lse_t).exp_()
                grad_v[:, :, key.keys] += torch.matmul(probs.transpose(-1, -2), grad_t)
                grad_scores = torch.matmul(grad_t, v_all[:, :, key.keys].transpose(-1, -2)).sub_(delta).mul_(probs)
                grad_q_t += torch.matmul(grad_scores, k_all[:, :, key.keys])
                grad_k[:, :, key.keys] += torch.matmul(grad_scores.transpose(-1, -2), q_t)
            grad_q[:, :, :, query.queries] = grad_q_t.mul_(scale).view(batch, groups, rep, rows, -1).to(q.dtype)
            if sinks is not None:  # dS_sink = -P_sink·δ
                sink_probs = (_sink_rows(sinks, groups, rep, rows, compute) - lse_t).exp_()
                grad_sinks -= (sink_probs * delta).view(batch, groups, rep, rows).sum(dim=(0, 3)).reshape(heads)
        grad_k.mul_(scale)
        grad_k_local, grad_v_local = _key_value_views(exchange.reduce_scatter(grad_kv), groups, head_dim)
        return (grad_q.permute(0, 3, 1, 2, 4).reshape(q.shape),
                grad_k_local.permute(0, 2, 1, 3).to(k.dtype), grad_v_local.permute(0, 2, 1, 3).to(v.dtype),
                None if sinks is None else grad_sinks.to(sinks.dtype), None, None)
