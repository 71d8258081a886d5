"""The tiled online-softmax attention context parallelism runs, against an explicit float64 attention.

Every CP rank of a head-tail split is simulated in one process: rank r's queries are its head and tail
chunks, its keys the whole rows in the gathered order (ranks in turn, each its own chunks), the exchange
the identity. The ranks' outputs put back in token order must equal the reference attention (document
mask, causal, windows, sinks, grouped-query heads, a value width other than the key width), and so must
the gradients of q, k, v and the sinks, with tiles forced small enough that a chunk spans several and
the plan skips, fully sees and masks tiles. The plan is also checked against the mask it stands for.
"""

import pytest
import torch

from attention_reference import ids_from_lengths, reference, run
from moetrain.model import tiled_attention
from moetrain.model.tiled_attention import IDENTITY, TiledAttention, plan_tiles
from moetrain.parallel.context_parallel import head_tail_indices

# Documents cross every chunk boundary of cp 2 and 4 at 96 tokens (chunks of 24 and 12); one row one document.
ROWS = [[5, 30, 17, 2, 40, 2], [96]]
CASES = {  # (sinks, window, cp, value width)
    "cp1-plain": (False, None, 1, 8),
    "cp2-sinks": (True, None, 2, 8),
    "cp4-window": (False, 10, 4, 8),
    "cp4-window+sinks-dv": (True, 30, 4, 12),
    "cp2-window1": (False, 1, 2, 8),
}


def split_attention(cp, window, ids):
    """fn(q, k, v, sinks) -> [B, S, H, Dv]: every rank's tiled attention, outputs put back in token order."""
    seq = ids.shape[1]
    key_index = torch.cat([head_tail_indices(seq, cp, r) for r in range(cp)])

    def fn(q, k, v, sinks):
        out = q.new_zeros(*q.shape[:3], v.shape[-1])
        for rank in range(cp):
            query_index = head_tail_indices(seq, cp, rank)
            plan = plan_tiles(query_index, key_index, ids, window, q.shape[0] * q.shape[2])
            part = TiledAttention.apply(q[:, query_index], k[:, key_index], v[:, key_index], sinks, plan, IDENTITY)
            out = out.index_copy(1, query_index, part)
        return out
    return fn


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(tiled_attention, "KEY_TILE", 8)
    monkeypatch.setattr(tiled_attention, "TILE_SCORES", 8 * 8 * 8)  # B·H = 8: query tiles of 8
    monkeypatch.setattr(tiled_attention, "MIN_QUERY_TILE", 4)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
@pytest.mark.parametrize("case", list(CASES))
def test_tiled_attention_matches_the_reference_on_every_rank_of_the_split(small_tiles, case, dtype, tol):
    with_sinks, window, cp, value_dim = CASES[case]
    gen = torch.Generator().manual_seed(0)
    ids = ids_from_lengths(ROWS)
    batch, seq = ids.shape
    q = torch.randn(batch, seq, 4, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, seq, 2, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, seq, 2, value_dim, generator=gen, dtype=torch.float64)
    sinks = torch.randn(4, generator=gen, dtype=torch.float64) if with_sinks else None
    grad_out = torch.randn(batch, seq, 4, value_dim, generator=gen, dtype=torch.float64)
    got = run(split_attention(cp, window, ids), q, k, v, sinks, grad_out, dtype)
    want = run(lambda *t: reference(*t[:3], ids, t[3], window), q, k, v, sinks, grad_out, torch.float64)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want, strict=False):
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("window", [None, 20])
def test_the_plan_skips_only_forbidden_tiles_and_unmasks_only_fully_visible_ones(small_tiles, window):
    ids = ids_from_lengths(ROWS)
    seq = ids.shape[1]
    i, j = torch.arange(seq).view(-1, 1), torch.arange(seq).view(1, -1)
    allowed = (j <= i) & (ids.unsqueeze(2) == ids.unsqueeze(1))
    if window is not None:
        allowed &= i - j < window
    key_index = torch.cat([head_tail_indices(seq, 4, r) for r in range(4)])
    counts = {"skipped": 0, "full": 0, "masked": 0}
    for rank in range(4):
        query_index = head_tail_indices(seq, 4, rank)
        plan = plan_tiles(query_index, key_index, ids, window, 8)
        covered = torch.zeros(2, query_index.numel(), seq, dtype=torch.bool)
        for query in plan.tiles:
            queries = query_index[query.queries]
            for key in query.keys:
                block = allowed[:, queries][:, :, key_index[key.keys]]
                assert key.masked or bool(block.all())
                counts["masked" if key.masked else "full"] += 1
                covered[:, query.queries, key.keys] = True
        # Every allowed (query, key) pair lies in a tile the plan computes.
        assert not bool((allowed[:, query_index][:, :, key_index] & ~covered).any())
        key_tiles = len(tiled_attention._cut(tiled_attention.contiguous_runs(key_index), tiled_attention.KEY_TILE))
        counts["skipped"] += len(plan.tiles) * key_tiles - sum(len(t.keys) for t in plan.tiles)
    assert min(counts.values()) > 0, counts
