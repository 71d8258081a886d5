"""An explicit float64 attention for the attention tests, written independently of model/attention.py.

Scores q·k/√D, the "same document, causal, i - j < window" mask, the sink as one extra logit per head
dropped before the value product (what transformers' GPT-OSS eager attention computes); `run` calls an
attention function on copies of the inputs in a dtype and returns its output and gradients.
"""

from __future__ import annotations

import torch


def ids_from_lengths(rows):
    """Document ids [B, S] of rows given as lists of document lengths."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])


def reference(q, k, v, ids, sinks, window):
    """Softmax attention [B, S, H, Dv], kv heads repeated; ids None: one document per row."""
    batch, seq, heads, head_dim = q.shape
    repeat = heads // k.shape[2]
    k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / head_dim ** 0.5
    i, j = torch.arange(seq).view(-1, 1), torch.arange(seq).view(1, -1)
    allowed = (j <= i).expand(batch, seq, seq)
    if ids is not None:
        allowed = allowed & (ids.unsqueeze(2) == ids.unsqueeze(1))
    if window is not None:
        allowed = allowed & (i - j < window)
    scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    if sinks is not None:
        sink_col = sinks.view(1, heads, 1, 1).expand(batch, heads, seq, 1)
        probs = torch.cat((scores, sink_col), dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1)
    return torch.einsum("bhij,bjhd->bihd", probs, v)


def run(fn, q, k, v, sinks, grad_out, dtype):
    """[out, dq, dk, dv(, dsinks)] of fn(q, k, v, sinks) on leaf copies in `dtype`, backward of grad_out."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    sink_leaf = None if sinks is None else sinks.detach().to(dtype).requires_grad_()
    out = fn(*leaves, sink_leaf)
    out.backward(grad_out.to(dtype))
    return [out.detach(), *(t.grad for t in leaves), *([] if sink_leaf is None else [sink_leaf.grad])]
