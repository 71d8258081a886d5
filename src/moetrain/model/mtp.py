"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 §2.2): one module per extra depth after the last block.

Module k (1..D) at position i combines the previous depth's hidden state h^{k-1}_i (h^0: the last
block's output, before the final norm) with the embedding of the token k ahead, Emb(t_{i+k}):

    h'^k_i = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)]       (eh_proj, [dim, 2·dim])
    h^k    = Block_k(h'^k)                                          (causal, one block of the model's kind)
    P^k_i  = OutHead(RMSNorm_k(h^k_i))                              (predicts t_{i+k+1})

The embedding and the output head are the main model's (shared, not copied); each module has its own
two input norms, projection, block and output norm (DeepSeek-V3's `shared_head.norm`). The paper
writes the concatenation as [h; Emb]; the released DeepSeek-V3 and GLM-4.5 weights, and the inference
engines that run them, put the embedding first, which is the order kept here so imported weights
mean what they were trained to mean.

The token k ahead is read from the token ids (`tokens_ahead`, computed on the whole rows), not by shifting
embedded rows: a rank that holds a slice of the sequence (context parallelism's chunks, tensor parallelism's
sequence slices) then gets each of its positions' token ahead from the whole row, and embeds it itself.

This module holds one MTP module's own parameters and its step; the transformer (`model.transformer`)
builds the block, owns the embedding and head and runs the depths. It computes no loss (train.loss) and
knows nothing about distribution or generation.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moetrain.config.model import ModelConfig


class MTPModule(nn.Module):
    """Depth k's enorm, hnorm, eh_proj, block and output norm (Hugging Face: `model.layers.{n_layers + k - 1}.*`)."""

    def __init__(self, cfg: ModelConfig, block: nn.Module):
        super().__init__()
        self.enorm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.hnorm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = block
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)

    def combine(self, hidden: Tensor, embedded_ahead: Tensor) -> Tensor:
        """h'^k = eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)]), [B, S, dim]."""
        return self.eh_proj(torch.cat([self.enorm(embedded_ahead), self.hnorm(hidden)], dim=-1))

    def forward(self, hidden: Tensor, embedded_ahead: Tensor, ids_ahead: Tensor, positions: Tensor,
                plan) -> Tensor:
        """h^k [B, S, dim] of a training forward: `embedded_ahead` is Emb of `ids_ahead` [B, S] (`tokens_ahead`'s
        column, -1 past the sequence's end), whose rows past the end become zeros here.

        The zero rows only feed positions whose targets lie past the sequence (never counted): attention is
        causal, so they change no earlier position. (Under tensor parallelism the ids arrive here cut to the
        rank's sequence slice, like the hidden states.)
        """
        embedded_ahead = torch.where((ids_ahead >= 0).unsqueeze(-1), embedded_ahead, 0)
        return self.block(self.combine(hidden, embedded_ahead), positions, plan)


def tokens_ahead(tokens: Tensor, depth: int) -> Tensor:
    """[B, S, depth] token ids: column k - 1 holds t_{i+k} at position i, -1 past the row's end."""
    batch, seq = tokens.shape
    out = tokens.new_full((batch, seq, depth), -1)
    for k in range(1, min(depth, seq - 1) + 1):
        out[:, :seq - k, k - 1] = tokens[:, k:]
    return out
