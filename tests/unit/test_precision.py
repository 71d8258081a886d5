"""One-rank mixed precision (moetrain.parallel.precision): bf16 compute copies of float32 masters.

The reference is computed directly: a bf16 copy of the model runs each microbatch on its own,
and its per-microbatch gradients are upcast and summed in float32. The masters must receive
exactly that (up to one bf16 rounding for norm
and tied weights, see below), stay float32 parameters under their own names, and be what the optimizer updates.
"""

import copy

import pytest
import torch

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.model.transformer import Transformer
from moetrain.parallel.precision import compute_copy
from moetrain.train.build import build_model


def tiny_model(tie: bool = False) -> Transformer:
    moe = MoEConfig(n_experts=4, top_k=2, expert_hidden=16)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, n_dense_layers=1,
                      max_seq_len=32, moe=moe, tie_embeddings=tie)
    return build_model(cfg)


def microbatches(n: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (2, 16), generator=generator) for _ in range(n)]


def objective(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, 64), tokens[:, 1:].reshape(-1))


def reference_grads(model: Transformer, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    low = copy.deepcopy(model).to(torch.bfloat16)
    total: dict[str, torch.Tensor] = {}
    for tokens in batches:
        low.zero_grad(set_to_none=True)
        objective(low, tokens).backward()
        for name, param in low.named_parameters():
            if param.grad is not None:
                grad = param.grad.float()
                total[name] = total[name] + grad if name in total else grad
    return total


@pytest.mark.parametrize("n", [1, 3])  # one backward (each copy inside its gradient buffer) or several
def test_master_gradients_are_the_float32_sum_of_bf16_microbatch_gradients(n):
    for tie in (False, True):
        model = tiny_model(tie)
        batches = microbatches(n)
        expected = reference_grads(model, batches)
        masters = {name: param for name, param in model.named_parameters()}
        copies = compute_copy(model, ParallelConfig(param_dtype="bfloat16", reduce_dtype="float32"))
        with copies.compute(backwards=n):
            assert all(p.dtype == torch.bfloat16 for p in model.parameters())
            where = {name: p.data_ptr() for name, p in model.named_parameters()}
            for tokens in batches:
                objective(model, tokens).backward()
        params = dict(model.named_parameters())
        # One backward: the bf16 copy was the head of the bytes that now hold its float32 gradient.
        assert all((where[name] == p.grad.data_ptr()) == (n == 1) for name, p in params.items())
        assert params.keys() == masters.keys() == expected.keys()
        for name, param in params.items():
            assert param is masters[name] and param.dtype == torch.float32, name
            assert param.grad.dtype == torch.float32, name
            if param.ndim >= 2 and not tie:
                torch.testing.assert_close(param.grad, expected[name], rtol=0, atol=0, msg=name)
            else:
                # nn.RMSNorm's fused backward hands a float32 leaf its weight gradient unrounded, and a
                # tied weight's two contributions are summed in float32, where the bf16 reference
                # rounds once more per microbatch.
                scale = expected[name].abs().max()
                torch.testing.assert_close(param.grad, expected[name], rtol=2**-7, atol=2**-8 * scale, msg=name)
        assert all(t.dtype == torch.float32 for t in model.state_dict().values() if t.is_floating_point())


def test_compute_copies_follow_the_optimizer_updates():
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    copies = compute_copy(model, ParallelConfig(param_dtype="bfloat16"))
    tokens = microbatches(1)[0]
    for _ in range(2):
        with copies.compute(backwards=1):  # the copies inside the gradient buffers, refilled at each entry
            objective(model, tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    # The next forward runs on the updated weights, rounded to bf16 once.
    with torch.no_grad(), copies.compute():
        got = objective(model, tokens)
    assert all(p.grad is None for p in model.parameters())  # evaluation leaves no gradients behind
    with torch.no_grad():
        expected = objective(copy.deepcopy(model).to(torch.bfloat16), tokens)
    assert float(got) == float(expected)


def test_a_forward_after_the_declared_backwards_fails_instead_of_reading_freed_weights():
    model = tiny_model()
    copies = compute_copy(model, ParallelConfig(param_dtype="bfloat16"))
    tokens = microbatches(1)[0]
    with pytest.raises(RuntimeError, match="storage"), copies.compute(backwards=1):
        objective(model, tokens).backward()
        objective(model, tokens)  # the weights' bytes are gradients now
    with pytest.raises(RuntimeError), copies.compute(backwards=1):
        loss = objective(model, tokens)
        loss.backward(retain_graph=True)
        loss.backward()  # a second backward: its gradients would land where the first ones are
    with pytest.raises(ValueError, match="backwards"), copies.compute(backwards=-1):
        pass


def test_no_compute_copy_in_float32():
    assert compute_copy(tiny_model(), ParallelConfig()) is None
