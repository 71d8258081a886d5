"""CPU cost of attention sinks and sliding windows in each SDPA attention method (forward + backward).

    .venv/bin/python benchmarks/profile/attention_sinks_windows.py

2 rows of 1024 tokens, documents of 100, 300, 24 and 600 tokens, 8 query / 2 kv heads of 64,
float32, one thread; median of 5 forward+backward passes after one warm-up, per method and option.
"""

from __future__ import annotations

import time

import torch

from moetrain.model.attention import attend, plan_attention


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    batch, seq, heads, kv_heads, head_dim = 2, 1024, 8, 2, 64
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([100, 300, 24, 600])).expand(batch, seq).contiguous()
    q = torch.randn(batch, seq, heads, head_dim, requires_grad=True)
    k, v = (torch.randn(batch, seq, kv_heads, head_dim, requires_grad=True) for _ in range(2))
    sinks = torch.randn(heads, requires_grad=True)

    def run(method, s, window):
        attend(q, k, v, plan_attention(ids, method), s, window).sum().backward()

    for method in ("dense", "segments", "blocks"):
        for label, s, window in (("plain", None, None), ("sinks", sinks, None), ("window 128", None, 128),
                                 ("sinks + window 128", sinks, 128)):
            run(method, s, window)
            times = []
            for _ in range(5):
                start = time.perf_counter()
                run(method, s, window)
                times.append(time.perf_counter() - start)
            print(f"{method:9s} {label:20s} median fwd+bwd {sorted(times)[2] * 1000:.0f} ms")


if __name__ == "__main__":
    main()
