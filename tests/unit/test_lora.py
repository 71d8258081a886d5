"""LoRA in moetrain: what trains, how the routed-expert adapters compute, checkpoints, resume and bad input.

- Only adapters take gradients and optimizer state; the base stays bitwise unchanged through training,
  and PEFT's start (B = 0) leaves the model's output unchanged.
- Routed-expert adapters (per expert and shared) give the same output and adapter gradients in the loop,
  grouped-GEMM and memory-efficient implementations as an independent float64 reference computing
  x W_e + s (x A_eᵀ) B_eᵀ expert by expert.
- Through the CLI on a tiny Qwen3-MoE directory: the checkpoint holds adapters, optimizer state and
  buffers only; 2 + 2 resumed steps equal 4 straight ones bit for bit; `export-hf --lora adapter` and the
  merged export are written; a changed base, bad options and adapter directories for another model or
  with PEFT options moetrain does not compute end in one line, exit 2, nothing written.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import shutil
import weakref
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import hf_tiny
from moetrain import cli
from moetrain.config.job import JobConfig
from moetrain.config.lora import LoraConfig
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.config.train import TrainConfig
from moetrain.errors import ConfigError
from moetrain.model.experts import routed_experts
from moetrain.model.lora import adapter_parameters, fold
from moetrain.model.routing import routing_from_topk
from moetrain.train.build import build_model
from moetrain.train.loss import microbatch_loss, token_loss_sum
from moetrain.train.optim import build_optimizer
from stdlib_corpus import copy_stdlib_modules

ALL_TARGETS = ["attention", "ffn", "shared_experts", "experts", "router"]


def small_model_config(**moe) -> ModelConfig:
    return ModelConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, ffn_hidden=24, n_dense_layers=1, max_seq_len=512,
                       moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=8, n_shared_experts=1, **moe))


def test_only_adapters_train_and_the_base_stays_bitwise_unchanged():
    cfg = small_model_config()
    lora = LoraConfig(rank=2, targets=ALL_TARGETS)
    plain = build_model(cfg, seed=3)
    model = build_model(cfg, seed=3, lora=lora)
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # B = 0: the adapted model starts as the base model
        assert torch.equal(model(x), plain(x))
    adapters = adapter_parameters(model)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(adapters)
    assert all(p.dtype == torch.float32 for p in adapters.values())
    base = {n: p.detach().clone() for n, p in model.named_parameters() if n not in adapters}
    optimizer = build_optimizer(model, TrainConfig(lr=1e-2))
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(adapters)
    for step in range(2):
        y = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(step))
        loss_sum, n_valid = token_loss_sum(model(y[:, :-1]), y[:, 1:])
        microbatch_loss(loss_sum, n_valid, n_valid, model.aux_loss()).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)
    assert all(p.abs().sum() > 0 for n, p in adapters.items() if n.endswith(("lora_B", "lora_B1", "lora_B2")))
    assert set(optimizer.state) == set(adapters.values())


def _expert_reference(x, routing, w1, w2, a1, b1, a2, b2, scale):
    """x W_e + s (x A_eᵀ) B_eᵀ per expert, SwiGLU between, float64, a Python loop (independent of `fold`)."""
    out = torch.zeros_like(x)
    sizes = routing.counts.tolist()
    for e, (tokens, scores) in enumerate(zip(routing.token_index.split(sizes), routing.scores.split(sizes),
                                             strict=True)):
        a1e, b1e, a2e, b2e = (t[min(e, t.shape[0] - 1)] for t in (a1, b1, a2, b2))
        rows = x[tokens]
        hidden = rows @ w1[e] + scale * (rows @ a1e.T) @ b1e.T
        gate, up = hidden.chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate) * up
        out = out.index_add(0, tokens, (act @ w2[e] + scale * (act @ a2e.T) @ b2e.T) * scores[:, None])
    return out


@pytest.mark.parametrize("stacks", [4, 1], ids=["per_expert", "shared"])
def test_expert_adapters_equal_a_float64_reference_in_every_impl(stacks):
    gen = torch.Generator().manual_seed(1)
    n_tokens, dim, n, n_experts, rank, scale = 10, 8, 6, 4, 3, 0.7
    x = torch.randn(n_tokens, dim, generator=gen, dtype=torch.float64)
    w1 = torch.randn(n_experts, dim, 2 * n, generator=gen, dtype=torch.float64)
    w2 = torch.randn(n_experts, n, dim, generator=gen, dtype=torch.float64)
    adapters = [torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
                for shape in ((stacks, rank, dim), (stacks, 2 * n, rank), (stacks, rank, n), (stacks, dim, rank))]
    topk = torch.stack([torch.randperm(n_experts, generator=gen)[:2] for _ in range(n_tokens)])
    routing = routing_from_topk(topk, torch.rand(n_tokens, 2, generator=gen, dtype=torch.float64), n_experts)
    grad_out = torch.randn(n_tokens, dim, generator=gen, dtype=torch.float64)
    want = _expert_reference(x, routing, w1, w2, *adapters, scale)
    want_grads = torch.autograd.grad(want, adapters, grad_out)
    for impl in ("loop", "grouped", "memory_efficient"):
        a1, b1, a2, b2 = adapters
        got = routed_experts(x, routing, fold(w1, a1, b1, scale), fold(w2, a2, b2, scale), "swiglu", impl)
        grads = torch.autograd.grad(got, adapters, grad_out)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=impl)
        for g, w in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=impl)


@pytest.mark.parametrize("changes, expected", [
    ({"rank": -1}, "lora.rank = -1 is invalid: must be >= 0"),
    ({"rank": 2, "targets": ["attention", "mlp"]}, "'mlp' is not a target"),
    ({"rank": 9}, "lora.rank = 9 is invalid: must be <= 8, the smallest dimension of the experts matrices"),
    ({"rank": 2, "targets": ["experts"], "dropout": 0.1}, "lora.dropout = 0.1 is invalid: must be 0 with targets"),
    ({"rank": 2, "targets": ["ffn"]}, "this model has no ffn to adapt"),
    ({"rank": 0, "init_from": "x"}, "lora.init_from = 'x' is invalid: needs lora.rank > 0"),
])
def test_bad_lora_options_fail_in_one_line(changes, expected):
    cfg = dataclasses.replace(small_model_config(), n_dense_layers=0)
    with pytest.raises(ConfigError) as err:
        JobConfig(model=cfg, lora=LoraConfig(**{"targets": ["attention", "experts"], **changes})).validate()
    assert expected in str(err.value) and "\n" not in str(err.value)


# ---- the CLI on a tiny Qwen3-MoE directory


@pytest.fixture(scope="module")
def base_and_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_cli")
    corpus = copy_stdlib_modules(root / "corpus", ("bisect.py", "colorsys.py", "keyword.py", "this.py", "stat.py"))
    return hf_tiny.save(hf_tiny.build_variant("qwen3_moe"), root / "base"), corpus


def lora_args(directory: Path, corpus: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["--model.init_from", f"hf:{directory}", "--data.tokenizer", str(directory),
            *hf_tiny.architecture_args(directory), "--data.source", "dir", "--data.path", str(corpus),
            "--data.glob", "*.py", "--data.seq_len", "24", "--data.heldout_fraction", "0.2", "--train.steps", "4",
            "--train.microbatch_size", "2", "--train.warmup_steps", "1", "--train.eval_every", "0",
            "--train.eval_batches", "1", "--train.sample_tokens", "0", "--train.num_threads", "1",
            "--checkpoint.every", "2", "--logging.run_dir", str(run_dir), "--logging.progress_bar", "False",
            "--train.lr", "1e-2", "--lora.rank", "2", "--lora.targets", "attention", "experts", "router", *extra]


def one_error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("moetrain: error: "), lines
    return lines[0]


def checkpoint_tensors(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    files = (run_dir / "checkpoints" / f"step_{step:08d}" / "tensors").glob("*.safetensors")
    return {k: v for f in files for k, v in load_file(str(f)).items()}


def test_lora_run_checkpoints_adapters_resumes_exactly_and_exports(base_and_corpus, tmp_path, capsys):
    directory, corpus = base_and_corpus
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert cli.main(["train", *lora_args(directory, corpus, straight)]) == 0
    assert cli.main(["train", *lora_args(directory, corpus, split), "--train.stop_at_step", "2"]) == 0
    assert cli.main(["train", *lora_args(directory, corpus, split), "--checkpoint.resume", "True"]) == 0
    saved = checkpoint_tensors(straight, 4)
    model_keys = {k for k in saved if k.startswith("model.")}
    assert model_keys and all(".lora_" in k or k.endswith("expert_bias") for k in model_keys)
    assert all(".lora_" in k for k in saved if k.startswith("optimizer."))
    resumed = checkpoint_tensors(split, 4)
    assert saved.keys() == resumed.keys() and all(torch.equal(v, resumed[k]) for k, v in saved.items())
    assert cli.main(["export-hf", "--run", str(split), "--out", str(tmp_path / "adapter"), "--lora", "adapter"]) == 0
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "pt") as f:
        assert "base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight" in set(f.keys())
    assert cli.main(["export-hf", "--run", str(split), "--out", str(tmp_path / "merged"), "--lora", "merged"]) == 0
    assert (tmp_path / "merged" / "config.json").is_file()
    capsys.readouterr()
    # continuing from the exported adapter directory starts from its adapters
    assert cli.main(["train", *lora_args(directory, corpus, tmp_path / "again", "--lora.init_from",
                                         str(tmp_path / "adapter")), "--train.steps", "2"]) == 0
    # the same run directory on another base (one weight changed) is refused before anything loads
    other = tmp_path / "other_base"
    shutil.copytree(directory, other)
    weights = next(other.glob("*.safetensors"))
    tensors = load_file(str(weights))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1
    save_file(tensors, str(weights), metadata={"format": "pt"})
    (other / "tokenizer.json").unlink()  # the run's tokenizer stays the first directory's
    capsys.readouterr()
    argv = lora_args(other, corpus, split)
    argv[argv.index("--data.tokenizer") + 1] = str(directory)
    assert cli.main(["train", *argv, "--checkpoint.resume", "True"]) == 2
    assert "is another base than the one checkpoint" in one_error_line(capsys)


def edited_adapter(source: Path, target: Path, **config_changes) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / "adapter_config.json").read_text())
    config.update(config_changes)
    (target / "adapter_config.json").write_text(json.dumps(config))
    return target


def test_bad_adapter_directories_and_options_fail_in_one_line_writing_nothing(base_and_corpus, tmp_path, capsys):
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    directory, corpus = base_and_corpus
    # a PEFT adapter of another family (OLMoE) as transformers + peft write it
    olmoe = get_peft_model(hf_tiny.build_variant("olmoe"), PeftLoraConfig(r=2, lora_alpha=16, target_modules=[
        "q_proj"]))
    olmoe.save_pretrained(tmp_path / "olmoe_adapter")
    ours = get_peft_model(hf_tiny.build_variant("qwen3_moe"), PeftLoraConfig(r=2, lora_alpha=16, target_modules=[
        "q_proj"]))
    ours.save_pretrained(tmp_path / "peft_adapter")
    run_dir = tmp_path / "run"
    cases = {
        "lora.rank = -2 is invalid": ["--lora.rank", "-2"],
        "'moe' is not a target": ["--lora.targets", "moe"],
        "lora.rank = 40 is invalid: must be <= 6, the smallest dimension of the router": ["--lora.rank", "40"],
        "targets other layers than this job's": ["--lora.init_from", str(tmp_path / "olmoe_adapter")],
        "sets use_dora = True, which moetrain does not implement": [
            "--lora.init_from", str(edited_adapter(tmp_path / "peft_adapter", tmp_path / "dora", use_dora=True))],
        "has r = 4, but the job's lora.rank = 2": [
            "--lora.init_from", str(edited_adapter(tmp_path / "peft_adapter", tmp_path / "r4", r=4))],
        "is not a PEFT adapter directory": ["--lora.init_from", str(tmp_path)],
    }
    capsys.readouterr()
    for expected, extra in cases.items():
        assert cli.main(["train", *lora_args(directory, corpus, run_dir), *extra]) == 2, expected
        assert expected in one_error_line(capsys), expected
        assert not run_dir.exists(), expected


def test_generation_with_adapters_equals_the_merged_model():
    from moetrain.evaluate.generate import generate_tokens
    from moetrain.model.lora import merge_adapters

    cfg = small_model_config()
    model = build_model(cfg, seed=4, lora=LoraConfig(rank=2, alpha=8.0, targets=ALL_TARGETS)).eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in adapter_parameters(model).values():
            param.copy_(torch.randn(param.shape, generator=gen))
    prompts = [[1, 2, 3, 4], [5, 6]]
    with torch.no_grad():
        adapted = generate_tokens(model, prompts, 6)
        merge_adapters(model)
        assert generate_tokens(model, prompts, 6) == adapted


@pytest.mark.parametrize("impl", ["memory_efficient", "grouped"])
def test_backward_refolds_the_expert_stacks_instead_of_keeping_them(monkeypatch, impl):
    from moetrain.model import lora as lora_module

    cfg = small_model_config(impl=impl)
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))

    folded = []  # weak references to the folded stacks of each forward

    def adapter_grads():
        model = build_model(cfg, seed=2, lora=LoraConfig(rank=2, targets=["experts"]))
        with torch.no_grad():
            for param in adapter_parameters(model).values():
                param.normal_(generator=torch.Generator().manual_seed(9))
        folded.clear()
        loss = model(x).square().mean()
        gc.collect()
        alive = [ref() is not None for ref in folded]
        loss.backward()
        return {n: p.grad for n, p in adapter_parameters(model).items()}, alive

    weights = lora_module.LoRAExpertWeights.weights

    def recorded_weights(self):
        stacks = weights(self)
        folded.extend(weakref.ref(t) for t in stacks)
        return stacks

    monkeypatch.setattr(lora_module.LoRAExpertWeights, "weights", recorded_weights)

    refolds = []

    class CountedRefold(lora_module._Refold):
        def __new__(cls, *args):
            refolds.append(args[0].shape)
            return super().__new__(cls, *args)

    monkeypatch.setattr(lora_module, "_Refold", CountedRefold)
    refolded, alive = adapter_grads()
    if impl == "memory_efficient":  # nothing keeps the folded stacks between forward and backward
        assert alive == [False, False]
    # memory-efficient: w1 and w2 of the one MoE layer, neither folded stack kept for backward; grouped (standard
    # autograd): what it saves of the stacks themselves (its GEMM of w1 saves a copy of its own)
    assert len(refolds) == (2 if impl == "memory_efficient" else 1)
    monkeypatch.setattr(lora_module.LoRAExpertWeights, "saving", lambda self, w1, w2: nullcontext())
    kept, alive = adapter_grads()
    if impl == "memory_efficient":  # what the recipe saves: without it autograd keeps both stacks
        assert alive == [True, True]
    assert all(torch.equal(refolded[n], kept[n]) for n in kept)


@pytest.mark.parametrize("shared", [False, True], ids=["per_expert", "shared"])
@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16])
def test_the_fold_into_a_reused_stack_equals_autograds_fold_bit_for_bit(shared, base_dtype):
    from moetrain.model import lora as lora_module

    gen = torch.Generator().manual_seed(4)
    n_experts, stacks = 4, 1 if shared else 4
    weight = torch.randn(n_experts, 8, 12, generator=gen).to(base_dtype)
    grad_out = torch.randn(n_experts, 8, 12, generator=gen)
    results = []
    for reused in (False, True):
        a = torch.randn(stacks, 3, 8, generator=torch.Generator().manual_seed(5)).requires_grad_()
        b = torch.randn(stacks, 12, 3, generator=torch.Generator().manual_seed(6)).requires_grad_()
        folded = (lora_module._FoldInto.apply(weight, a, b, 0.7, lora_module._stack_for("w1", weight, a)) if reused
                  else fold(weight, a, b, 0.7))
        (folded * grad_out).sum().backward()
        results.append((folded.detach().clone(), a.grad, b.grad))
    for plain, reused in zip(*results, strict=True):
        assert torch.equal(plain, reused)
