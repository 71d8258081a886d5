"""Decoder-only transformer: embedding, pre-norm blocks (attention + dense or MoE FFN), RMSNorm, LM head.

The first `n_dense_layers` blocks (0: every block is MoE, as in Qwen3-MoE and OLMoE) use a dense
SwiGLU feed-forward (`layers.FeedForward`), the rest an MoE layer (`moe.MoE`); attention and RoPE
come from layers.py (multi-head latent attention from mla.py when `kv_lora_rank` is set), the
document-masked attention methods (`model.attention`) from attention.py, planned once per forward.
Parameter names follow torchtitan (`tok_embeddings.weight`, `layers.{i}.attention.wq.weight`,
`layers.{i}.attention.q_norm.weight`,
`layers.{i}.feed_forward.w1.weight`, `layers.{i}.moe.experts.w1`, `norm.weight`, `output.weight`)
so init schemes, sharding and checkpoints can match by name (moetrain.interop maps them to Hugging
Face names).

With `model.mtp_depth` = D the model also holds D multi-token-prediction modules (`mtp.{k}`,
moetrain.model.mtp), each with a block numbered after the main ones; a forward runs them only when
asked (`mtp=True`, training's MTP loss) and computes the main logits the same way either way.
`cached_forward` and `mtp_cached_forward` are the KV-cached steps self-speculative decoding uses.

A model can also be one part of the whole (a pipeline stage, or a rank's stages together):
`Transformer(cfg, layer_ids, embedding=False, head=False)` holds only those blocks (`Blocks`, keyed
by their index in the whole model, so names and checkpoints are the whole model's), takes hidden
states instead of tokens without the embedding and returns hidden states without norm and head.
`Transformer.part_of` makes a part that shares its modules with a larger part. Which layers a part
holds is decided outside (`moetrain.parallel.pipeline`).

The model builds on any device, including `meta`; `init_weights()` fills every parameter and
buffer (after `to_empty` when built on meta) through `init.init_model`. The MoE bookkeeping
(`aux_loss`, `z_loss_sum`, `tokens_per_expert`, `set_global_balance`, `update_expert_bias`,
`discard_pending_expert_load`) is exposed as model methods so callers never touch MoE state.
It knows nothing about distribution: FSDP is applied from outside (`moetrain.parallel.shard`),
the init code handles DTensor shards, and the cross-rank sums (the bias update's loads, the
global-batch expert counts) happen outside.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from moetrain.config.model import ModelConfig
from moetrain.model.attention import AttentionPlan, plan_attention
from moetrain.model.init import init_model
from moetrain.model.kv_cache import KVCache
from moetrain.model.layers import Attention, FeedForward, positions_from_documents
from moetrain.model.mla import MultiHeadLatentAttention
from moetrain.model.moe import MoE
from moetrain.model.mtp import MTPModule, tokens_ahead


class TransformerBlock(nn.Module):
    """Pre-norm block: h = x + attention(norm(x)); out = h + ffn(norm(h)). One unit for fully_shard."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        # Multi-head latent attention (DeepSeek-V3) when the config has a KV latent, else grouped-query attention.
        self.attention = MultiHeadLatentAttention(cfg) if cfg.kv_lora_rank is not None else Attention(cfg, layer_id)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.is_moe = layer_id >= cfg.n_dense_layers
        if self.is_moe:
            self.moe = MoE(cfg.dim, cfg.moe)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden)

    def forward(self, x: Tensor, positions: Tensor, plan: AttentionPlan | None,
                cache: KVCache | None = None) -> Tensor:
        normed = self.attention_norm(x)
        if cache is None:
            h = x + self.attention(normed, positions, plan)
        else:  # only attention modules that accept a cache get one (kv_cache.accepts_cache)
            h = x + self.attention(normed, positions, plan, cache=cache.layer(self.layer_id))
            if self.is_moe:  # generation reads no balance statistics: the MoE layer skips them
                return h + self.moe(self.ffn_norm(h), statistics=False)
        ffn = self.moe if self.is_moe else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Blocks(nn.ModuleDict):
    """The blocks a model (or a part of it) holds, keyed by their layer index in the whole model.

    The keys "0".."n-1" give the names a list would (`layers.3.attention.wq.weight`), also in a part
    holding layers 3..5 only. Iterating yields the blocks in layer order; `blocks[i]` is layer i.
    """

    def __iter__(self):
        return iter(self.values())

    def __getitem__(self, index: int | str) -> TransformerBlock:
        return super().__getitem__(str(index))


class Transformer(nn.Module):
    """Token embedding, blocks, final RMSNorm and LM head (optionally tied to the embedding), or a part of them.

    `layer_ids` (default: all) are the blocks this part holds; `embedding` / `head` whether it holds
    the token embedding / the final norm and LM head.
    """

    def __init__(self, cfg: ModelConfig, layer_ids: Sequence[int] | None = None, *, embedding: bool = True,
                 head: bool = True):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim) if embedding else None
        ids = range(cfg.n_layers) if layer_ids is None else layer_ids
        self.layers = Blocks({str(i): TransformerBlock(cfg, i) for i in ids})
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps) if head else None
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False) if head else None
        # Multi-token prediction: module k's block is layer n_layers + k - 1 (MoE past n_dense_layers, as
        # the Hugging Face families number it); run only when a forward asks (`mtp=True`). Only a model
        # with both ends holds them (a pipeline's last rank holds a copy of the embedding for them).
        self.mtp = nn.ModuleList(MTPModule(cfg, TransformerBlock(cfg, cfg.n_layers + k))
                                 for k in range(cfg.mtp_depth if embedding and head else 0))
        self.mtp_embeddings: nn.Embedding | None = None  # a pipeline's last stage part only (`part_of`)
        if cfg.tie_embeddings and embedding and head:
            self.output.weight = self.tok_embeddings.weight
        # The document-masked attention method; compiled blocks pin it (moetrain.parallel.parallelize).
        self.attention_method: str = cfg.attention

    @classmethod
    def part_of(cls, whole: Transformer, layer_ids: Sequence[int], *, embedding: bool, head: bool) -> Transformer:
        """A part holding `whole`'s own modules (no copy): its blocks `layer_ids`, its embedding / norm and head."""
        part = cls.__new__(cls)
        nn.Module.__init__(part)
        part.cfg = whole.cfg
        part.tok_embeddings = whole.tok_embeddings if embedding else None
        part.layers = Blocks({str(i): whole.layers[i] for i in layer_ids})
        part.norm = whole.norm if head else None
        part.output = whole.output if head else None
        # The last stage runs the MTP modules, embedding the tokens ahead with the rank's copy of the embedding
        # (its input is hidden states, so it is not the part's `tok_embeddings`: moetrain.train.pipeline_step).
        part.mtp = whole.mtp if head else nn.ModuleList()
        part.mtp_embeddings = whole.tok_embeddings if head and not embedding and len(whole.mtp) else None
        part.attention_method = whole.attention_method
        return part

    def _apply(self, fn, recurse=True):
        # `to_empty` / `to` from meta replace each module's parameters one by one, which would
        # give the embedding and the head two separate tensors: tie them again.
        out = super()._apply(fn, recurse)
        tied = self.cfg.tie_embeddings and self.output is not None and self.tok_embeddings is not None
        if tied and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight
        return out

    def forward(self, tokens: Tensor, positions: Tensor | None = None,
                document_ids: Tensor | None = None, until_last_moe: bool = False,
                cache: KVCache | None = None, mtp: bool = False,
                attention_plan: AttentionPlan | None = None,
                mtp_ahead: Tensor | None = None) -> Tensor | tuple[Tensor, list[Tensor]] | None:
        """tokens [B, S] -> logits [B, S, V]; in a part, hidden states [B, S, D] in or out where it lacks the ends.

        `document_ids` [B, S] (contiguous runs of equal ids) restricts attention to earlier tokens of
        the same document. `positions` [B, S] are the RoPE positions; when omitted they are the
        position inside each document if `document_ids` is given, else 0..S-1. `until_last_moe`
        stops after the last MoE block and returns None: a routing-only pass that leaves every
        MoE layer's `tokens_per_expert` set without paying for the later blocks and the LM head.
        `cache` (generation, `model.kv_cache.KVCache`): the tokens extend the cached rows; their
        positions come from the cache and every layer attends over the cached tokens too; its MoE
        layers record no balance statistics (`tokens_per_expert`, `aux_loss`, `router_z` are None after it).
        `mtp` (model.mtp_depth > 0): also run the multi-token-prediction modules and return
        (logits, [logits of depth k, [B, S, V], position i predicting token i + k + 1, for k = 1..D]);
        the main logits are computed exactly as without it.
        `attention_plan`: a plan the caller built (context parallelism's: these tokens are a slice of longer
        rows and attend over keys other ranks hold); `document_ids` is then not planned here and `positions`
        must be given.
        `mtp_ahead` ([B, S, D], `model.mtp.tokens_ahead` of the whole rows, then cut like the tokens): the tokens
        ahead of each position, for the MTP modules; computed from `tokens` when omitted. A rank holding a slice
        of the rows (context parallelism) or hidden states (a pipeline's last stage, which embeds them with
        `mtp_embeddings`) must pass them.
        """
        batch, seq = tokens.shape[:2]
        if self.tok_embeddings is None and positions is not None:
            # A part taking hidden states: under sequence parallelism they are this rank's slice of the rows
            # that `positions` and `document_ids` describe whole (attention gathers the slices back).
            seq = positions.shape[1]
        if cache is not None:
            if document_ids is not None or positions is not None:
                raise ValueError("a forward with a KV cache takes its positions from the cache: "
                                 "pass neither document_ids nor positions")
            return self.cached_forward(tokens, cache)[0]
        if document_ids is not None and document_ids.shape != (batch, seq):
            raise ValueError(f"document_ids shape {tuple(document_ids.shape)} != tokens shape {(batch, seq)}")
        if attention_plan is not None and positions is None:
            raise ValueError("a forward with an attention_plan needs the tokens' positions")
        # Once per forward, shared by every layer.
        plan = attention_plan if attention_plan is not None else plan_attention(document_ids, self.attention_method)
        if positions is None:
            if document_ids is not None:
                positions = positions_from_documents(document_ids)
            else:
                positions = torch.arange(seq, device=tokens.device).expand(batch, seq)
        elif positions.shape != (batch, seq):
            raise ValueError(f"positions shape {tuple(positions.shape)} != tokens shape {(batch, seq)}")
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        last_moe = max((layer.layer_id for layer in self.layers if layer.is_moe), default=-1)
        for layer in self.layers:
            h = layer(h, positions, plan)
            if until_last_moe and layer.layer_id == last_moe:
                return None
        if until_last_moe:
            return None
        if self.output is None:
            return h
        if not mtp:
            return self.output(self.norm(h))
        if not self.mtp:
            raise ValueError("a forward with mtp=True needs model.mtp_depth > 0")
        normed = [self.norm(h)]
        embedding = self.mtp_embeddings if self.mtp_embeddings is not None else self.tok_embeddings
        ahead = tokens_ahead(tokens, len(self.mtp)) if mtp_ahead is None else mtp_ahead
        for depth, module in enumerate(self.mtp, start=1):
            ids = ahead[..., depth - 1]
            h = module(h, embedding(ids.clamp(min=0)), ids, positions, plan)
            normed.append(module.norm(h))
        # One call of the head for every depth: under FSDP it is one unit, gathered once per forward.
        logits = self.output(torch.cat(normed, dim=1)).split(seq, dim=1)
        return logits[0], list(logits[1:])

    def cached_forward(self, tokens: Tensor, cache: KVCache) -> tuple[Tensor, Tensor]:
        """(logits [B, S, V], the last block's output before the final norm [B, S, dim]) of a KV-cached forward."""
        positions = cache.advance(tokens.shape[1])
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, positions, None, cache)
        return self.output(self.norm(h)), h

    def mtp_cached_forward(self, depth: int, hidden: Tensor, tokens_ahead: Tensor,
                           cache: KVCache) -> tuple[Tensor, Tensor]:
        """(logits, hidden state h^depth) of MTP module `depth` (1..D) on h^{depth-1} [B, S, dim] and the
        tokens `depth` ahead [B, S], extending `cache` (its own, holding layer n_layers + depth - 1)."""
        module = self.mtp[depth - 1]
        positions = cache.advance(tokens_ahead.shape[1])
        h = module.block(module.combine(hidden, self.tok_embeddings(tokens_ahead)), positions, None, cache)
        return self.output(module.norm(h)), h

    def _device(self) -> torch.device:
        return next(self.parameters()).device

    def moe_layers(self) -> list:
        return [layer.moe for layer in self.layers if layer.is_moe]

    def tokens_per_expert(self) -> Tensor | None:
        """Tokens routed to each expert by the last forward, [n_moe_layers, n_experts], detached.

        None when the model has no MoE layer (or no forward has run yet).
        """
        counts = [moe.tokens_per_expert for moe in self.moe_layers()]
        if not counts or any(c is None for c in counts):
            return None
        return torch.stack(counts).detach()

    def mtp_moe_layers(self) -> list:
        """The MoE layers of the multi-token-prediction blocks. They are left out of `moe_layers` (expert
        loads, balance and z-losses, global-batch counts): only the MTP loss trains their routers, and their
        aux-free expert bias follows their own loads (`update_expert_bias`)."""
        return [module.block.moe for module in self.mtp if module.block.is_moe]

    @torch.no_grad()
    def discard_pending_expert_load(self) -> None:
        """Forget the expert loads accumulated since the last bias update (for a skipped step)."""
        for moe in self.moe_layers() + self.mtp_moe_layers():
            moe.load_since_update.zero_()

    def aux_loss(self) -> Tensor:
        """Σ coef · balance loss over MoE layers of the last forward (0 when no layer uses the aux loss).

        Under `aux_loss_scope = "global_batch"` each term is the last forward's exact part of the
        step's loss (see `routing.global_balance_share`), which needs `set_global_balance` first.
        """
        total = torch.zeros((), device=self._device())
        for moe in self.moe_layers():
            if moe.cfg.load_balance != "aux_loss":
                continue
            if moe.aux_loss is None:
                if moe.tokens_per_expert is not None:  # a forward ran without the step's expert shares
                    raise RuntimeError("aux_loss_scope = 'global_batch' needs the step's expert counts: call "
                                       "set_global_balance (moetrain.train.global_balance) before the forward")
                continue
            total = total + moe.cfg.aux_loss_coef * moe.aux_loss
        return total

    def needs_global_balance(self) -> bool:
        """Whether a step must measure its expert counts before the forwards that train on them."""
        return any(moe.cfg.load_balance == "aux_loss" and moe.cfg.aux_loss_scope == "global_batch"
                   and moe.cfg.aux_loss_coef > 0 for moe in self.moe_layers())

    def set_global_balance(self, counts: Tensor, n_tokens: int) -> None:
        """Give every MoE layer the step's assignments per expert ([n_moe_layers, E]) and routed-token count."""
        for moe, counts_E in zip(self.moe_layers(), counts, strict=True):
            moe.set_global_balance(counts_E, n_tokens)

    def balance_on_own_counts(self) -> None:
        """The step is one microbatch on one rank: each MoE layer takes its forward's own counts as the step's."""
        for moe in self.moe_layers():
            moe.balance_on_own_counts()

    def z_loss_sum(self, token_mask: Tensor | None = None) -> Tensor:
        """Σ over MoE layers of coef · Σ over the last forward's tokens of the router z-loss.

        `token_mask` [B, S] (bool) keeps the tokens the language-model loss counts, so dividing by
        the same token count makes the z-loss token-weighted exactly like it. 0 when no layer uses it.
        """
        total = torch.zeros((), device=self._device())
        for moe in self.moe_layers():
            if moe.router_z is None:
                continue
            z_T = moe.router_z
            if token_mask is not None:
                z_T = torch.where(token_mask.reshape(-1), z_T, torch.zeros_like(z_T))
            total = total + moe.cfg.z_loss_coef * z_T.sum()
        return total

    @torch.no_grad()
    def update_expert_bias(self, all_reduce=None) -> None:
        """Aux-loss-free balancing step for every MoE layer, MTP blocks' too (see `MoE.update_expert_bias`)."""
        for moe in self.moe_layers() + self.mtp_moe_layers():
            moe.update_expert_bias(all_reduce)

    def init_weights(self, seed: int = 0, scheme: str | None = None,
                     device: torch.device | str | None = None) -> None:
        """Initialise every parameter and buffer in place with a named scheme (default cfg.init_scheme).

        A model still on the meta device is first materialised with `to_empty(device)` (CPU when
        `device` is None); plain and FSDP-sharded (DTensor) parameters are both handled.
        """
        if any(t.is_meta for t in (*self.parameters(), *self.buffers())):
            self.to_empty(device=device or "cpu")
        init_model(self, scheme or self.cfg.init_scheme, seed=seed)
