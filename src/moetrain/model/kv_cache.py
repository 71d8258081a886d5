"""Key/value cache for incremental decoding: each attention layer's keys and values, kept between forwards.

Generation runs the prompt once (prefill) and then one token per forward (decode); the cache holds
what every layer computed for the earlier tokens so a decode step costs one token's projections
instead of the whole context's. It is the one seam between generation and attention: an attention
module given a `LayerCache` hands it its new q, k, v (after RoPE, before attention) and gets the
attention output back (`LayerCache.attend`). The cache stores whatever k and v the module gives it,
per layer, so a module whose keys and values differ in width (MLA's decompressed heads) uses it
unchanged; a module that attends through a window passes `window` (keys within that many
positions). Nothing here knows about the model's parameters, documents or distribution.

Rows of different prompt lengths share one cache by left padding: row b's prompt starts at slot
`pad[b]`, the slots before it are never attended to, and a real token's RoPE position is its slot
minus `pad[b]` (so positions are 0.. inside each prompt, exactly as when the row runs alone). Every
row extends by the same number of slots per forward, so one slot range is written per step.

A decode step is cheap by construction: the buffers are allocated once at full capacity and written
in place, head-major ([B, H_kv, capacity, D], so attention reads each head's keys contiguously); a
one-token step builds no causal mask (its query sees every earlier real slot: no mask at all
without padding, a slice of the per-row real-slot mask made once per batch with it); and
`per_forward` lets every layer share what depends only on the step (RoPE's rotation matrices).
A forward of a few tokens after the prompt (`FEW_TOKENS`: speculative decoding's verify forward of the
newest token and its drafts, the MTP modules' catch-up) is a decode step too (`KVCache.few`): its causal
mask is a slice of a slot-by-slot table made once per cache, and the attention modules give it the
one-token step's specialisations (layers.Attention).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from moetrain.errors import ModelError

# A forward of at most this many new tokens, every one a real (not padding) slot, is a decode step.
FEW_TOKENS = 8
# The causal table of a few-token step holds capacity^2 bools; above this many (16 MiB) the mask is built per step.
CAUSAL_TABLE_ELEMENTS = 1 << 24


def accepts_cache(attention: torch.nn.Module) -> bool:
    """Whether an attention module's forward takes a `cache` (a `LayerCache`); generation reruns the context if not."""
    return "cache" in inspect.signature(attention.forward).parameters


class KVCache:
    """Keys and values of `n_layers` attention layers for `batch` rows of up to `capacity` slots.

    Use: `cache = KVCache(n_layers, batch, capacity, pad=pad_B)`, then `model(tokens, cache=cache)`
    with the left-padded prompts [B, S], then `model(next_tokens [B, 1], cache=cache)` per step.
    The buffers are allocated by the first write of each layer (shape, dtype and device from its k/v).
    """

    def __init__(self, n_layers: int, batch: int, capacity: int, pad: Tensor | None = None,
                 device: torch.device | str | None = None, copy_weights: bool = True):
        if capacity < 1:
            raise ModelError(f"KV cache capacity {capacity} is invalid: must be >= 1")
        self.n_layers, self.batch, self.capacity = n_layers, batch, capacity
        # Whether a layer may keep a rearranged copy of its weights for this generation (`per_cache`,
        # e.g. q/k/v as one matrix: one GEMV a step instead of three). False for a sharded model,
        # whose layers hold their full weights only during their own forward.
        self.copy_weights = copy_weights
        self.pad_B = (torch.zeros(batch, dtype=torch.long, device=device) if pad is None
                      else pad.to(device=device, dtype=torch.long))
        if self.pad_B.shape != (batch,):
            raise ModelError(f"KV cache pad shape {tuple(self.pad_B.shape)} != (batch,) = ({batch},)")
        self.keys: list[Tensor | None] = [None] * n_layers  # [B, H_kv, capacity, D]: a head's keys contiguous
        self.values: list[Tensor | None] = [None] * n_layers
        self.length = 0  # slots written by every layer so far
        self.start = 0  # the slot range [start, length) the current forward writes
        self.mask: Tensor | None = None  # [B, 1, S_new, length] bool for the current forward; None: every key
        self.few = False  # whether the current forward is a decode step (`FEW_TOKENS`)
        self._set_rows()
        self._per_forward: dict = {}
        self._per_cache: dict = {}

    def _set_rows(self) -> None:
        # Read once per batch (not per step): whether any row is padded, and each row's real slots.
        self.most_padding = int(self.pad_B.max()) if self.batch else 0
        self.padded = self.most_padding > 0
        self.real_slot_BC = (torch.arange(self.capacity, device=self.pad_B.device) >= self.pad_B.unsqueeze(1)
                             if self.padded else None)

    def advance(self, new_tokens: int) -> Tensor:
        """Reserve `new_tokens` slots for the forward about to run; returns their RoPE positions [B, S_new].

        Called once per forward by the transformer, before its layers attend.
        """
        if self.length + new_tokens > self.capacity:
            raise ModelError(f"KV cache holds {self.capacity} slots; {self.length} are used and the forward "
                             f"adds {new_tokens}")
        device = self.pad_B.device
        self.start, self.length = self.length, self.length + new_tokens
        self._per_forward = {}
        few = new_tokens <= FEW_TOKENS and self.start >= self.most_padding  # real queries only
        self.few = few and (new_tokens == 1 or self.capacity ** 2 <= CAUSAL_TABLE_ELEMENTS)
        if self.few:
            # One query sees every earlier slot of its row except the padding: no causal mask to build; a few
            # queries see those up to their own, a slice of the causal table.
            real = None if not self.padded else self.real_slot_BC[:, None, None, :self.length]
            causal = None if new_tokens == 1 else self.per_cache("causal", self._causal_table)[self.start:self.length,
                                                                                               :self.length]
            self.mask = causal if real is None else real if causal is None else causal & real
            slots = self.per_cache("slots", lambda: torch.arange(self.capacity, device=device))
            return slots[self.start:self.length].unsqueeze(0) - self.pad_B.unsqueeze(1)
        query_slot = torch.arange(self.start, self.length, device=device)
        key_slot = torch.arange(self.length, device=device)
        causal = key_slot <= query_slot.unsqueeze(1)  # [S_new, L]
        real_key = key_slot >= self.pad_B.unsqueeze(1)  # [B, L]
        # A padding query sees only itself (a row with no key at all would give NaN in SDPA); its
        # output is never read, and no real query sees a padding key.
        itself = key_slot == query_slot.unsqueeze(1)
        self.mask = ((causal & real_key.unsqueeze(1)) | itself).unsqueeze(1)
        return (query_slot - self.pad_B.unsqueeze(1)).clamp(min=0)

    def _causal_table(self) -> Tensor:
        """[capacity, capacity] bool: slot j (column) is at or before slot i (row)."""
        slots = torch.arange(self.capacity, device=self.pad_B.device)
        return slots <= slots.unsqueeze(1)

    def rewind(self, length: int) -> None:
        """Forget every slot from `length` on (speculative decoding's rejected drafts); later forwards write them."""
        if not 0 <= length <= self.length:
            raise ModelError(f"KV cache rewind to {length} is invalid: {self.length} slots are written")
        self.length = self.start = length

    def per_forward(self, key, compute: Callable[[], object]):
        """`compute()` once per forward for every layer asking with an equal `key` (e.g. RoPE's rotation
        at this forward's positions, the same in every layer of a model)."""
        if key not in self._per_forward:
            self._per_forward[key] = compute()
        return self._per_forward[key]

    def per_cache(self, key, compute: Callable[[], object]):
        """`compute()` once for this cache's whole life (one generation: the model does not change),
        for what depends on neither the rows nor the step (e.g. RoPE's rotations at every slot)."""
        if key not in self._per_cache:
            self._per_cache[key] = compute()
        return self._per_cache[key]

    def layer(self, layer_id: int) -> LayerCache:
        return LayerCache(self, layer_id)

    def _write(self, layer_id: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v [B, S_new, H_kv, D] in place; returns every written slot's keys, values [B, H_kv, L, D]."""
        if self.keys[layer_id] is None:
            self.keys[layer_id] = k.new_zeros(self.batch, k.shape[2], self.capacity, k.shape[3])
            self.values[layer_id] = v.new_zeros(self.batch, v.shape[2], self.capacity, v.shape[3])
        keys, values = self.keys[layer_id], self.values[layer_id]
        if k.shape[1] != self.length - self.start:
            raise ModelError(f"layer {layer_id} wrote {k.shape[1]} tokens into a forward of "
                             f"{self.length - self.start} (call KVCache.advance once per forward)")
        new_tokens = self.length - self.start
        keys.narrow(2, self.start, new_tokens).copy_(k.transpose(1, 2))
        values.narrow(2, self.start, new_tokens).copy_(v.transpose(1, 2))
        return keys.narrow(2, 0, self.length), values.narrow(2, 0, self.length)

    def keep_rows(self, rows: Tensor) -> None:
        """Drop every row not in `rows` (indices), e.g. the finished ones, so later steps skip them."""
        self.pad_B = self.pad_B[rows]
        self.batch = int(rows.numel())
        self.keys = [None if k is None else k[rows] for k in self.keys]
        self.values = [None if v is None else v[rows] for v in self.values]
        self._set_rows()


class LayerCache:
    """One layer's view of a `KVCache`: what an attention module calls instead of its own attention."""

    def __init__(self, cache: KVCache, layer_id: int):
        self.cache, self.layer_id = cache, layer_id

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    @property
    def few(self) -> bool:
        """`KVCache.few`: whether this forward is a decode step of one or a few real tokens."""
        return self.cache.few

    @property
    def copy_weights(self) -> bool:
        """`KVCache.copy_weights`: whether this layer may keep a copy of its weights for the generation."""
        return self.cache.copy_weights

    def per_forward(self, key, compute: Callable[[], object]):
        """`KVCache.per_forward`: computed once per forward, shared with the other layers."""
        return self.cache.per_forward(key, compute)

    def per_cache(self, key, compute: Callable[[], object]):
        """`KVCache.per_cache`: computed once per generation, shared with the other layers."""
        return self.cache.per_cache(key, compute)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, window: int | None = None,
               sinks: Tensor | None = None) -> Tensor:
        """Store this forward's k, v [B, S_new, H_kv, D(v)] and attend q [B, S_new, H, D] over every cached key.

        Returns [B, S_new, H, D_v]. `window`, when given, keeps only keys fewer than `window`
        positions before each query (sliding-window attention); `sinks` [H], when given, adds one
        logit per head to every softmax's denominator that carries no value (attention sinks).
        """
        keys, values = self.cache._write(self.layer_id, k, v)  # [B, H_kv, L, D(v)]
        mask = self.cache.mask
        if window is not None:
            query_slot = torch.arange(self.cache.start, self.cache.length, device=q.device)
            near = torch.arange(self.cache.length, device=q.device) > query_slot.unsqueeze(1) - window
            mask = near if mask is None else mask & near  # a query is always near itself
        repeats = q.shape[2] // keys.shape[1]
        if repeats > 1:  # each kv head serves `repeats` consecutive query heads, as attention.attend lays them out
            keys, values = keys.repeat_interleave(repeats, dim=1), values.repeat_interleave(repeats, dim=1)
        if sinks is None:
            out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask)
            return out.transpose(1, 2)
        scores_BHQK = torch.einsum("bqhd,bhkd->bhqk", q, keys) * q.shape[-1] ** -0.5
        if mask is not None:
            scores_BHQK = scores_BHQK.masked_fill(~mask, float("-inf"))
        sink_BHQ1 = sinks.to(scores_BHQK.dtype).view(1, -1, 1, 1).expand(*scores_BHQK.shape[:3], 1)
        probs_BHQK = torch.softmax(torch.cat([scores_BHQK, sink_BHQ1], dim=-1), dim=-1)[..., :-1]
        return torch.einsum("bhqk,bhkd->bqhd", probs_BHQK.to(values.dtype), values)
