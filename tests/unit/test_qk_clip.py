"""QK-clip on hand-built attention layers (MHA, GQA, MLA) against closed forms.

Every case runs one float64 layer at position 0 (RoPE is then the identity, so the logits are plain
projections): head 1's query rows are blown up so that only it exceeds τ. Checks:
- the recorded maximum per head equals a by-hand q·k/√D over the causal pairs;
- after `clip()` the clipped head's rows are the old rows times the closed-form factor (MHA: √η on its
  query and key rows; GQA: η on its query rows, the shared key untouched; MLA: √η on q_nope and k_nope,
  η on q_rope, the rotary key and the values untouched), every other row is bit-for-bit unchanged;
- re-recording gives exactly τ for the clipped head and the old maxima for the others.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moetrain.config.model import ModelConfig
from moetrain.errors import ConfigError
from moetrain.model.layers import Attention
from moetrain.model.mla import MultiHeadLatentAttention
from moetrain.train.qk_clip import QKClip

SEQ, DIM, CLIPPED = 6, 16, 1


def _layer(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mla":
        cfg = ModelConfig(dim=DIM, n_heads=2, kv_lora_rank=6, q_lora_rank=None, qk_nope_head_dim=4,
                          qk_rope_head_dim=2, v_head_dim=4)
        layer = MultiHeadLatentAttention(cfg)
    else:
        layer = Attention(ModelConfig(dim=DIM, n_heads=4 if kind == "gqa" else 2, n_kv_heads=2, head_dim=4))
    layer.double()
    for param in layer.parameters():
        nn.init.normal_(param, std=0.5) if param.ndim > 1 else nn.init.ones_(param)
    query = layer.wq
    rows = query.weight.shape[0] // layer.n_heads
    with torch.no_grad():
        query.weight[CLIPPED * rows:(CLIPPED + 1) * rows] *= 6.0  # head 1 alone gets large logits
    return layer


def _record(layer: nn.Module, x: torch.Tensor, clip: QKClip) -> torch.Tensor:
    clip.arm()
    layer(x, torch.zeros(1, SEQ, dtype=torch.long))
    return layer.max_logits.clone()


def _by_hand(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Max over causal (i, j) of q_h(x_i)·k_h(x_j)/√D at position 0, from the weights alone."""
    if isinstance(layer, MultiHeadLatentAttention):
        width = layer.nope_dim + layer.rope_dim
        q = (x @ layer.wq.weight.T).view(SEQ, layer.n_heads, width)
        latent, k_rope = (x @ layer.wkv_a.weight.T).split([layer.kv_lora_rank, layer.rope_dim], dim=-1)
        kv = (layer.kv_a_norm(latent) @ layer.wkv_b.weight.T).view(SEQ, layer.n_heads, -1)
        k = torch.cat([kv[..., :layer.nope_dim], k_rope.unsqueeze(1).expand(-1, layer.n_heads, -1)], dim=-1)
    else:
        width = layer.head_dim
        q = (x @ layer.wq.weight.T).view(SEQ, layer.n_heads, width)
        k = (x @ layer.wk.weight.T).view(SEQ, layer.n_kv_heads, width)
        k = k.repeat_interleave(layer.n_heads // layer.n_kv_heads, dim=1)
    scores = torch.einsum("ihd,jhd->hij", q, k) / width ** 0.5
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    return scores.masked_fill(~causal, float("-inf")).amax(dim=(1, 2))


def _expected_row_scales(layer: nn.Module, eta: float) -> dict[str, torch.Tensor]:
    """Closed-form factor per row of each projection QK-clip may touch; 1 for rows it must leave alone."""
    heads = layer.n_heads
    if isinstance(layer, MultiHeadLatentAttention):
        q = torch.ones(heads, layer.nope_dim + layer.rope_dim, dtype=torch.float64)
        q[CLIPPED, :layer.nope_dim], q[CLIPPED, layer.nope_dim:] = eta ** 0.5, eta
        kv = torch.ones(heads, layer.nope_dim + layer.v_dim, dtype=torch.float64)
        kv[CLIPPED, :layer.nope_dim] = eta ** 0.5
        return {"wq": q.reshape(-1), "wkv_b": kv.reshape(-1),
                "wkv_a": torch.ones(layer.wkv_a.weight.shape[0], dtype=torch.float64)}
    q = torch.ones(heads, layer.head_dim, dtype=torch.float64)
    k = torch.ones(layer.n_kv_heads, layer.head_dim, dtype=torch.float64)
    if layer.n_kv_heads == heads:
        q[CLIPPED], k[CLIPPED] = eta ** 0.5, eta ** 0.5
    else:
        q[CLIPPED] = eta
    return {"wq": q.reshape(-1), "wk": k.reshape(-1), "wv": torch.ones(layer.wv.weight.shape[0], dtype=torch.float64)}


@pytest.mark.parametrize("kind", ["mha", "gqa", "mla"])
def test_clipped_head_gets_the_closed_form_and_the_others_are_untouched(kind):
    layer = _layer(kind)
    x = torch.randn(1, SEQ, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    before = {name: getattr(layer, name).weight.detach().clone() for name in ("wq", "wk", "wv", "wkv_a", "wkv_b")
              if hasattr(layer, name)}
    probe = QKClip(nn.ModuleList([layer]), tau=1.0)
    maxima = _record(layer, x, probe)
    assert torch.allclose(maxima, _by_hand(layer, x[0]), rtol=1e-12, atol=0)
    others = maxima[torch.arange(layer.n_heads) != CLIPPED]
    tau = float(others.max() + maxima[CLIPPED]) / 2  # only the clipped head is above it
    assert float(maxima[CLIPPED]) > tau > float(others.max())
    clip = QKClip(nn.ModuleList([layer]), tau=tau)
    _record(layer, x, clip)
    returned = clip.clip()
    assert torch.equal(returned[0], maxima) and layer.max_logits is None  # logged, and recording stopped
    eta = tau / float(maxima[CLIPPED])
    for name, scale in _expected_row_scales(layer, eta).items():
        after = getattr(layer, name).weight.detach()
        assert torch.allclose(after, before[name] * scale.unsqueeze(1), rtol=1e-14, atol=0), name
        untouched = scale == 1
        assert torch.equal(after[untouched], before[name][untouched]), name
    again = _record(layer, x, clip)
    assert float(again[CLIPPED]) == pytest.approx(tau, rel=1e-12)
    assert torch.equal(again[torch.arange(layer.n_heads) != CLIPPED], others)


def test_qk_norm_is_refused():
    layer = Attention(ModelConfig(dim=DIM, n_heads=2, qk_norm="per_head"))
    with pytest.raises(ConfigError, match="model.qk_norm"):
        QKClip(nn.ModuleList([layer]), tau=10.0)
