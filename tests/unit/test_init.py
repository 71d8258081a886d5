"""Init catalog: acceptance on configs/tiny_moe.toml, truncation, determinism, block drawing, CLI."""

import json
import math
import typing
from pathlib import Path

import pytest
import torch

from moetrain.cli import main as cli_main
from moetrain.commands.init_report import build_initialised, report_rows
from moetrain.commands.init_report import main as report_main
from moetrain.config.job import JobConfig, load
from moetrain.config.model import InitScheme
from moetrain.errors import ConfigError, ModelError
from moetrain.model.init import KINDS, SCHEMES, Dims, Rule, _draw_rows, classify, get_scheme

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_moe.toml"


@pytest.fixture(scope="module")
def tiny_cfg():
    return load(TINY).model


def test_catalog_has_the_required_schemes_each_cited_and_complete():
    required = {"llama", "gpt-oss", "depth-total", "olmo-normal", "olmo-mitchell", "olmo-megatron", "gpt2",
                "megatron", "neox"}
    assert required <= set(SCHEMES)
    for scheme in SCHEMES.values():
        assert set(scheme.rules) == set(KINDS), scheme.name
        assert "@" in scheme.doc or "arXiv" in scheme.doc, f"{scheme.name} docstring cites no commit"


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_acceptance_every_large_parameter_within_5_percent_and_inside_the_cutoff(name, tiny_cfg):
    rows = report_rows(build_initialised(tiny_cfg, name, seed=0), name)
    assert {r["kind"] for r in rows} >= {"embedding", "qkv", "attn_out", "ffn_gate", "ffn_up", "ffn_down",
                                         "router", "expert_gate", "expert_up", "expert_down", "lm_head", "norm"}
    for row in rows:
        if row["dist"] == "ones":
            assert row["measured_std"] == 0 and row["measured_mean"] == 1, row["name"]
            continue
        if row["numel"] >= 10_000:
            assert abs(row["measured_std"] / row["target_std"] - 1) < 0.05, row
            # the mean of N draws has std target/sqrt(N): 6 of those is a generous bound
            assert abs(row["measured_mean"]) < 6 * row["target_std"] / math.sqrt(row["numel"]), row
        if row["cutoff"] is not None:
            assert row["max_abs"] <= row["cutoff"], row


def test_llama_gives_the_fused_gate_and_up_halves_their_own_std(tiny_cfg):
    rows = {r["name"]: r for r in report_rows(build_initialised(tiny_cfg, "llama"), "llama")}
    gate, up = rows["layers.2.moe.experts.w1[gate]"], rows["layers.2.moe.experts.w1[up]"]
    assert gate["shape"] == up["shape"] == [16, 256, 128]
    assert gate["sigma"] == 0.02 and up["sigma"] == pytest.approx(0.02 / math.sqrt(6))
    assert abs(up["measured_std"] / up["target_std"] - 1) < 0.05
    assert rows["tok_embeddings.weight"]["target_std"] == 1.0
    assert rows["output.weight"]["cutoff"] == pytest.approx(3 * 256 ** -0.5)


def test_depth_dependence_of_the_schemes_in_closed_form(tiny_cfg):
    def sigma(scheme, name):
        segs = classify(name, tiny_cfg)
        return SCHEMES[scheme].rules[segs[0].kind].sigma(segs[0].dims)

    wo = "layers.3.attention.wo.weight"
    assert sigma("llama", wo) == pytest.approx(0.02 / math.sqrt(8))  # per layer, l = 3
    assert sigma("depth-total", wo) == pytest.approx(0.02 / math.sqrt(8))  # 2L = 8 too: check another layer
    assert sigma("depth-total", "layers.0.attention.wo.weight") == pytest.approx(0.02 / math.sqrt(8))
    assert sigma("llama", "layers.0.attention.wo.weight") == pytest.approx(0.02 / math.sqrt(2))
    assert sigma("olmo-mitchell", "layers.0.feed_forward.w2.weight") == pytest.approx(1 / math.sqrt(2 * 512))
    assert sigma("olmo-mitchell", "layers.1.moe.experts.w2") == pytest.approx(1 / math.sqrt(2 * 128 * 2))
    assert sigma("neox", wo) == pytest.approx(2 / 4 / math.sqrt(256))
    assert sigma("neox", "layers.0.attention.wq.weight") == pytest.approx(math.sqrt(2 / (5 * 256)))
    assert sigma("olmo-megatron", "tok_embeddings.weight") == pytest.approx(0.02)  # OLMo main: no sqrt(d)


@pytest.mark.parametrize("scale, sigma", [(False, 0.02), (True, 0.02 * math.sqrt(256))])
def test_olmo_megatron_embedding_is_002_unless_scaled(scale, sigma):
    # OLMo main's full_megatron: wte std = init_std, times sqrt(d_model) only with scale_emb_init; ±3σ.
    cfg = load(TINY).model
    cfg.init_scheme, cfg.init_scale_embedding = "olmo-megatron", scale
    weight = build_initialised(cfg, "olmo-megatron").tok_embeddings.weight.detach().double()
    truncated_std = sigma * math.sqrt(1 - 2 * 3 * math.exp(-4.5) / math.sqrt(2 * math.pi) / math.erf(3 / math.sqrt(2)))
    assert abs(weight.std().item() / truncated_std - 1) < 0.02
    assert weight.abs().max().item() <= 3 * sigma
    # Every other parameter is the same with or without the flag.
    assert get_scheme("olmo-megatron", scale).rules["qkv"] is get_scheme("olmo-megatron").rules["qkv"]


def test_scaled_embedding_belongs_to_olmo_megatron_only():
    with pytest.raises(ModelError, match=r"model.init_scale_embedding = True is invalid with init scheme 'llama'"):
        get_scheme("llama", scale_embedding=True)


def test_truncated_std_formula_and_cutoff_against_sampling():
    rule = Rule("trunc_normal", "1", lambda d: 1.0, cutoff_sigmas=1.0)
    values = _draw_rows(rule, Dims(1, 1), (200, 1000), 0, 200, seed=0, name="x", label="")
    assert values.abs().max() <= 1.0
    # independent reference: numerically integrate x^2 phi(x) over [-1, 1], divided by the mass
    x = torch.linspace(-1, 1, 200_001, dtype=torch.float64)
    phi = torch.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    exact = math.sqrt(torch.trapezoid(x * x * phi, x) / torch.trapezoid(phi, x))
    assert rule.target_std(Dims(1, 1)) == pytest.approx(exact, rel=1e-6)
    assert values.std().item() == pytest.approx(exact, rel=0.01)


@pytest.mark.parametrize("shape", [(300, 7), (5, 40000), (1000,)])
def test_drawing_any_row_range_equals_slicing_the_full_draw(shape):
    rule = Rule("normal", "1", lambda d: 1.0)
    full = _draw_rows(rule, Dims(1, 1), shape, 0, shape[0], seed=3, name="p", label="")
    for start, end in [(0, 1), (1, shape[0]), (shape[0] // 3, shape[0] // 2 + 1), (shape[0] - 1, shape[0])]:
        part = _draw_rows(rule, Dims(1, 1), shape, start, end, seed=3, name="p", label="")
        assert torch.equal(part, full[start:end])


def test_deterministic_given_a_seed_and_sensitive_to_seed_and_scheme():
    cfg = load(TINY).model
    cfg.n_layers, cfg.dim, cfg.moe.n_experts = 2, 64, 4
    a = build_initialised(cfg, "llama", seed=11).state_dict()
    b = build_initialised(cfg, "llama", seed=11).state_dict()
    c = build_initialised(cfg, "llama", seed=12).state_dict()
    d = build_initialised(cfg, "gpt2", seed=11).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    weights = [k for k in a if k.endswith(("wq.weight", "experts.w1"))]
    assert weights and not any(torch.equal(a[k], c[k]) for k in weights)
    # llama and gpt2 differ in these stds (1.0 vs 0.02, depth-scaled vs 0.02)
    for key in ("tok_embeddings.weight", "layers.0.feed_forward.w3.weight", "output.weight"):
        assert a[key].std() > 1.2 * d[key].std() or d[key].std() > 1.2 * a[key].std(), key
    assert torch.equal(a["layers.1.moe.expert_bias"], torch.zeros(4))


def test_config_names_exactly_the_catalog_schemes_in_order():
    # moetrain.config.model types model.init_scheme without importing the model; the two lists must agree.
    assert typing.get_args(InitScheme) == tuple(SCHEMES)


def test_unknown_scheme_and_unknown_parameter_are_rejected(tiny_cfg):
    with pytest.raises(ModelError, match=r"'nope' is unknown; valid schemes: llama, gpt-oss"):
        get_scheme("nope")
    with pytest.raises(ValueError, match="no init rule"):
        classify("layers.0.attention.bias", tiny_cfg)
    cfg = JobConfig()
    cfg.model.init_scheme = "bogus"
    with pytest.raises(ConfigError, match=r"model.init_scheme = 'bogus' is invalid: valid schemes: llama"):
        cfg.validate()


def test_init_report_json_has_the_documented_keys(capsys):
    assert report_main(["--config", str(TINY), "--scheme", "neox", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {"name", "shape", "dist", "target_std", "measured_std", "measured_mean", "cutoff"} <= set(rows[0])
    names = [r["name"] for r in rows]
    assert "tok_embeddings.weight" in names and "layers.1.moe.experts.w1[up]" in names


def test_init_report_text_and_cli_error_path(capsys):
    assert cli_main(["init-report", "--config", str(TINY), "--scheme", "olmo-mitchell"]) == 0
    out = capsys.readouterr().out
    assert "layers.0.attention.wo.weight" in out and "cut ±3σ" in out
    assert cli_main(["init-report", "--config", str(TINY), "--scheme", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moetrain: error: init scheme 'nope' is unknown")


@pytest.mark.parametrize("scheme, sigma", [("llama", 256 ** -0.5), ("gpt2", 0.02), ("olmo-mitchell", 256 ** -0.5),
                                           ("neox", math.sqrt(2 / (5 * 256)))])
def test_tied_weight_follows_the_source(scheme, sigma):
    cfg = load(TINY).model
    cfg.tie_embeddings = True
    model = build_initialised(cfg, scheme)
    assert model.output.weight is model.tok_embeddings.weight
    row = next(r for r in report_rows(model, scheme) if r["name"] == "tok_embeddings.weight")
    assert row["sigma"] == pytest.approx(sigma)
    assert abs(row["measured_std"] / row["target_std"] - 1) < 0.05
