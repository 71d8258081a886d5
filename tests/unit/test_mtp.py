"""Multi-token prediction: the loss against a float64 reference written from DeepSeek-V3's equations, the main
path untouched by it, and targets that never cross a document or loss-mask boundary.

The reference (`reference_losses`) is written here from the paper's equations (arXiv 2412.19437 §2.2) with
plain tensor ops: RMSNorm, the concatenation [Emb(t_{i+k}); h^{k-1}_i], the projection, the shared head and
the cross-entropy of each depth averaged over its valid targets, L = main + λ/D Σ_k CE_k. Each block (main
and MTP) is used as the function Block(·) of the equations (its attention and MoE are checked against
transformers elsewhere) and is run on each document alone, truncated to the positions that have a target,
so the reference needs neither the model's document masking nor its zero-padded tail.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.config.train import TrainConfig
from moetrain.data.packing import sequence_fields
from moetrain.errors import ConfigError
from moetrain.model.transformer import Transformer
from moetrain.train.loss import microbatch_loss, mtp_loss_term, mtp_targets, mtp_valid_counts, token_loss_sum

VOCAB, EOS, PAD = 40, 38, 39
LAMBDA = 0.3


def tiny_cfg(mtp_depth: int = 2, **changes) -> ModelConfig:
    moe = MoEConfig(n_experts=4, top_k=2, expert_hidden=8, score_func="sigmoid", n_shared_experts=1,
                    load_balance="aux_free")
    return ModelConfig(vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, ffn_hidden=24, n_dense_layers=1,
                       max_seq_len=64, mtp_depth=mtp_depth, moe=moe, **changes)


def model_of(cfg: ModelConfig, dtype=torch.float64) -> Transformer:
    model = Transformer(cfg)
    model.init_weights(seed=3)
    with torch.no_grad():  # norms away from 1, so a swapped or missing norm shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    return model.to(dtype)


def packed_window(seed: int) -> torch.Tensor:
    """S + 1 = 17 tokens: three documents [BOS] text [EOS] (the last cut off), a short one among them."""
    gen = torch.Generator().manual_seed(seed)
    text = torch.randint(1, 37, (17,), generator=gen)
    text[[5, 8]] = EOS  # documents end at 5 and 8: a 3-token document in the middle
    return text


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def run_per_document(block_fn, x: torch.Tensor, doc_of: list[int]) -> torch.Tensor:
    """Block(x) [S, dim] with each document run alone from position 0 (the causal, per-document meaning)."""
    out = torch.empty_like(x)
    for doc in sorted(set(doc_of)):
        rows = [i for i, d in enumerate(doc_of) if d == doc]
        positions = torch.arange(len(rows)).unsqueeze(0)
        out[rows] = block_fn(x[rows].unsqueeze(0), positions, None)[0]
    return out


def reference_losses(model: Transformer, window: torch.Tensor, keep: torch.Tensor | None,
                     starts: torch.Tensor | None) -> tuple[float, list[float]]:
    """(main CE, [CE_k for k = 1..D]) of one window of S + 1 tokens, each a mean over its valid targets."""
    cfg = model.cfg
    seq = window.numel() - 1
    # Document of every window position: a new one after each EOS (or at `starts`); the targets' loss mask `keep`.
    doc_of, doc = [], 0
    for j in range(seq + 1):
        if starts is not None and j > 0 and bool(starts[j]):
            doc += 1
        elif starts is None and j > 0 and int(window[j - 1]) == EOS:
            doc += 1
        doc_of.append(doc)
    kept = [keep is None or bool(keep[j]) for j in range(seq + 1)]
    emb = model.tok_embeddings.weight.detach()
    h = emb[window[:seq]]
    for layer in model.layers:
        h = run_per_document(layer, h, doc_of[:seq])
    head = model.output.weight.detach()

    def ce(logits_row: torch.Tensor, target: int) -> float:
        return float(torch.logsumexp(logits_row, 0) - logits_row[target])

    def mean_ce(hidden: torch.Tensor, norm_w: torch.Tensor, ahead: int) -> float:
        """Position i predicts window token i + ahead when it is in i's document and kept."""
        losses = [ce(rms(hidden[i], norm_w, cfg.norm_eps) @ head.T, int(window[i + ahead]))
                  for i in range(hidden.shape[0])
                  if i + ahead <= seq and doc_of[i + ahead] == doc_of[i] and kept[i + ahead]
                  and (starts is not None or int(window[i + ahead - 1]) != EOS)]
        return sum(losses) / len(losses)

    main = mean_ce(h, model.norm.weight.detach(), 1)
    depth_losses = []
    for k, module in enumerate(model.mtp, start=1):
        n = seq - k  # positions i with a token i + k to embed
        merged = torch.cat([rms(emb[window[k:k + n]], module.enorm.weight.detach(), cfg.norm_eps),
                            rms(h[:n], module.hnorm.weight.detach(), cfg.norm_eps)], dim=-1)
        h = run_per_document(module.block, merged @ module.eh_proj.weight.detach().T, doc_of[:n])
        depth_losses.append(mean_ce(h, module.norm.weight.detach(), k + 1))
    return main, depth_losses


def model_losses(model: Transformer, fields: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(main CE, λ/D Σ_k CE_k) as the trainer computes them, for one window as a batch of one."""
    tokens, document_ids, targets = (fields[k].unsqueeze(0) for k in ("tokens", "document_ids", "targets"))
    logits, mtp_logits = model(tokens, positions=fields["positions"].unsqueeze(0), document_ids=document_ids,
                               mtp=True)
    loss_sum, n_valid = token_loss_sum(logits, targets)
    counts = mtp_valid_counts(targets, document_ids, model.cfg.mtp_depth)
    term, _ = mtp_loss_term(mtp_logits, targets, document_ids, counts, LAMBDA)
    return float(loss_sum) / n_valid, float(term)


@pytest.mark.parametrize("case", ["packed", "conversation"])
def test_mtp_loss_equals_the_papers_equations_in_float64(case):
    model = model_of(tiny_cfg())
    window = packed_window(1)
    keep = starts = None
    if case == "packed":
        fields = sequence_fields(window, EOS, PAD)
    else:  # two conversations (starting at 0 and 9), each with a masked-out prompt span
        starts = torch.zeros(17, dtype=torch.bool)
        starts[[0, 9]] = True
        keep = torch.ones(17, dtype=torch.long)
        keep[[0, 1, 2, 9, 10, 11, 12]] = 0
        fields = sequence_fields(window, EOS, PAD, starts=starts, keep=keep)
    with torch.no_grad():
        main, term = model_losses(model, fields)
        want_main, want_depths = reference_losses(model, window, keep, starts)
    assert abs(main - want_main) < 1e-10
    assert abs(term - LAMBDA / 2 * sum(want_depths)) < 1e-10


def test_mtp_targets_stop_at_document_boundaries_and_the_loss_mask():
    # Documents [0 1 2] [3 4] [5 6 7]; position 6's main target is masked out.
    document_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    targets = torch.tensor([[11, 12, -100, 14, -100, 16, -100, 18]])
    got = mtp_targets(targets, document_ids, 1)
    # i predicts the main target of i + 1, kept only inside i's document.
    assert got.tolist() == [[12, -100, -100, -100, -100, -100, 18, -100]]
    assert mtp_targets(targets, document_ids, 2).tolist() == [[-100] * 5 + [18, -100, -100]]
    assert mtp_valid_counts(targets, document_ids, 2) == [2, 1]


def test_with_weight_zero_the_main_loss_and_gradients_are_the_model_without_mtp_bit_for_bit():
    """λ = 0 runs no MTP module: the same loss, and the same gradients for every main parameter."""
    fields = sequence_fields(packed_window(2), EOS, PAD)
    batch = {k: v.unsqueeze(0) for k, v in fields.items()}
    results = []
    for depth in (0, 1):
        model = model_of(tiny_cfg(mtp_depth=depth), torch.float32)
        weight = TrainConfig(mtp_loss_weight=0.0).mtp_loss_weight
        outputs = model(batch["tokens"], batch["positions"], batch["document_ids"],
                        **({"mtp": True} if depth and weight > 0 else {}))
        loss_sum, n_valid = token_loss_sum(outputs, batch["targets"])
        loss = microbatch_loss(loss_sum, n_valid, n_valid, model.aux_loss())
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if not n.startswith("mtp.")}))
    (loss0, grads0), (loss1, grads1) = results
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys() and all(torch.equal(grads0[n], grads1[n]) for n in grads0)


def test_running_the_mtp_modules_leaves_the_main_logits_unchanged():
    model = model_of(tiny_cfg(), torch.float32)
    fields = sequence_fields(packed_window(3), EOS, PAD)
    tokens, document_ids = fields["tokens"].unsqueeze(0), fields["document_ids"].unsqueeze(0)
    with torch.no_grad():
        plain = model(tokens, document_ids=document_ids)
        with_mtp, depths = model(tokens, document_ids=document_ids, mtp=True)
    assert torch.equal(plain, with_mtp) and len(depths) == 2 and depths[0].shape == plain.shape


def test_mtp_blocks_aux_free_bias_follows_their_own_loads():
    model = model_of(tiny_cfg(mtp_depth=1), torch.float32)
    fields = sequence_fields(packed_window(4), EOS, PAD)
    model(fields["tokens"].unsqueeze(0), document_ids=fields["document_ids"].unsqueeze(0), mtp=True)
    moe = model.mtp[0].block.moe
    assert moe not in model.moe_layers() and moe.load_since_update.sum() > 0
    model.update_expert_bias()
    assert moe.expert_bias.abs().sum() > 0 and moe.load_since_update.sum() == 0


@pytest.mark.parametrize(("changes", "message"), [
    ({"mtp_depth": -1}, "model.mtp_depth"),
    ({"mtp_depth": 1, "sliding_window": 4, "layer_types": ["full_attention", "sliding_attention"]}, "model.mtp_depth"),
])
def test_mtp_settings_are_refused_in_one_line(changes, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(tiny_cfg(), **changes).validate()
    with pytest.raises(ConfigError, match="train.mtp_loss_weight"):
        TrainConfig(mtp_loss_weight=-0.1).validate()


def test_a_forward_asking_for_mtp_without_modules_is_an_error():
    model = model_of(tiny_cfg(mtp_depth=0), torch.float32)
    with pytest.raises(ValueError, match="mtp_depth"):
        model(torch.zeros(1, 4, dtype=torch.long), mtp=True)


# --- self-speculative decoding with the MTP modules ------------------------------------------------------------

CYCLE = torch.tensor([3, 17, 8, 29, 11, 33, 5, 22, 9])


def cycle_model(steps: int) -> Transformer:
    """A 2-depth model trained `steps` AdamW steps (main + MTP loss) on a repeating 9-token cycle."""
    model = model_of(tiny_cfg(), torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        sequences = CYCLE[(torch.randint(0, 9, (8, 1), generator=gen) + torch.arange(25)) % 9]
        tokens, targets = sequences[:, :-1], sequences[:, 1:]
        documents = torch.zeros_like(tokens)
        logits, mtp_logits = model(tokens, document_ids=documents, mtp=True)
        loss_sum, n_valid = token_loss_sum(logits, targets)
        term, _ = mtp_loss_term(mtp_logits, targets, documents, mtp_valid_counts(targets, documents, 2), 1.0)
        (loss_sum / n_valid + term).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


@pytest.mark.parametrize(("steps", "prompt"), [(0, [1, 2, 3, 4, 5]), (12, [35, 3, 17, 8])])
def test_speculative_decoding_gives_greedys_tokens_and_drafts_what_the_full_forward_predicts(steps, prompt,
                                                                                            monkeypatch):
    from moetrain.evaluate import generate as generation

    model = cycle_model(steps)
    rounds = []
    draft = generation._draft

    def recording(model, tokens, *args):
        drafts, outputs = draft(model, tokens, *args)
        rounds.append((list(tokens), drafts, [h[-1].clone() for h in outputs]))
        return drafts, outputs

    monkeypatch.setattr(generation, "_draft", recording)
    greedy = generation.generate_tokens(model, [prompt], 24)[0]
    tokens, stats = generation.mtp_speculative_greedy(model, prompt, 24)
    assert tokens == greedy
    assert stats.proposed == 2 * stats.verify_forwards and stats.verify_forwards == len(rounds)
    if steps:  # partly trained: some drafts accepted, some not
        assert 0 < stats.acceptance_rate < 1
    # Each cached draft's logits are what a full forward over the committed tokens (and the drafts before) gives.
    with torch.no_grad():
        for committed, drafts, last_hidden in rounds:
            for k in (1, 2):
                _, depths = model(torch.tensor([committed + drafts[:k - 1]]), mtp=True)
                want = depths[k - 1][0, len(committed) - 2]
                got = model.output(model.mtp[k - 1].norm(last_hidden[k - 1]))
                assert int(want.argmax()) == drafts[k - 1] and torch.allclose(got, want, atol=1e-5, rtol=0)


def test_sample_reports_acceptance_speed_up_and_agreement_and_refuses_sampling():
    from moetrain.commands.sample import main as sample_main
    from moetrain.commands.sample import speculative_report
    from moetrain.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer("byte")
    model = model_of(dataclasses.replace(tiny_cfg(), vocab_size=tokenizer.vocab_size), torch.float32)
    text, report = speculative_report(model, tokenizer, "def ", 6)
    assert "drafts accepted" in report and "x the speed of plain greedy" in report and "tokens identical" in report
    with pytest.raises(ConfigError, match="--speculative mtp is greedy"):
        sample_main(["--run", "nowhere", "--speculative", "mtp", "--temperature", "0.5"])
