"""train.float8 under pipeline, expert and context parallelism: the Trainer's own step against one process with float8.

Every run goes through the Trainer (split_trainer_support's worker: fixed packed microbatches, SGD at a constant
rate, 2 steps) in param_dtype float32 over one global batch of 8 microbatches: one process, PP 2 x FSDP 2 (2 data
ranks of 4 microbatches) and FSDP 4 x EP 2 (4 data ranks of 2) with train.float8 = "tensorwise", and one process
and CP 2 x FSDP 2 (documents crossing the CP chunk boundaries) with "rowwise". Under FSDP the tensorwise
converted linears' weights are all-gathered in float8 with the scale of the whole weight (precomputed after each
optimizer step), so every float8 weight is the one one process casts from the same float32 master.

PP: a stage runs a microbatch's rows through its layers as one process runs them, so every float8 cast sees the
same tensor (the same amax, the same scale). What differs is float32 rounding alone: the loss sums across data
ranks and the reduce-scatter of the gradients (~1e-7 relative), which after an optimizer step can move a weight
element across a float8 rounding boundary. So losses, step-0 gradients and final parameters agree within 1e-5
relative (the FSDP float8 bound of test_float8_dist.py), not merely within the float8 error (~2^-4).

EP: the routed experts' grouped GEMMs (torchao's rowwise grouped recipe) scale the forward's and the input
gradient's operands per token row and per weight column, which do not depend on which tokens share a group, so
the losses and every gradient but the routed experts' weights agree within 1e-5 as under PP. The experts' weight
gradients X^T dY are scaled per column over the expert's token group, which under EP holds both EP ranks' tokens
for the expert and in one process one microbatch's: other amaxes. The scales are powers of two, so a cast under
either scale gives the same value unless the element falls in e4m3's subnormal range (below 2^-15 of its
column's amax; there the error is at most amax x 2^-9 / 448 ~ 4.4e-6 amax), far inside the 2^-3 |X|^T|dY| that
two float8 GEMMs' error bounds allow; asserted within 1e-4 of the largest entry (measured below 2e-6).

CP (rowwise only; tensorwise is refused there): a rank's linears see only its chunk of each sequence. The rowwise
recipe's scales are powers of two, per token row and per weight column in the forward and the input-gradient
GEMMs (split-independent) and per column over the tokens in the weight-gradient GEMMs (the subnormal argument
above). What else differs is float32 rounding (ring attention's merged softmax against one pass), which can move
a float8 cast across a rounding boundary now and then: losses and final parameters within 1e-5, gradients within
1e-4 of their largest entry. Tensorwise scales are amaxes over the whole tensor, not powers of two, so under CP
every cast would differ (a 12-microbatch run of this test: losses 1.2e-3 apart, a norm's gradient 0.30 of its largest
entry), which is why it is refused.

The checkpoint: each stage part is converted, but the rank's whole part (which shares the stages' modules) is what
the trainer saves, so the state-dict hook that turns a float8-gathered weight back into its plain float32 shard
must sit on the converted linears: a checkpoint of a PP 2 x FSDP 2 float8 model, read into a plain model in one
process (as export-hf does), holds the float32 masters bit for bit.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from split_parity_support import TINY_MOE, initial_state, load_full_state
from split_trainer_support import job_config, make_batches, trainer_worker

from moetrain.model.transformer import Transformer
from moetrain.parallel.mesh import JobMesh
from moetrain.testing.multirank import run_on_ranks

pytest.importorskip("torchao.float8")

WORLD, MICRO = 4, 2  # microbatches per step of each of the EP layout's 4 data ranks
CFG = replace(TINY_MOE, vocab_size=259)  # the byte tokenizer's vocabulary (the trainer's data)
PP_LAYOUT, EP_LAYOUT = {"pp": 2, "dp_shard": 2}, {"dp_shard": 4, "ep": 2}
CP_LAYOUT = {"cp": 2, "dp_shard": 2}
CONVERTED_LINEARS = {"wq", "wk", "wv", "wo", "w1", "w2", "w3"}  # in attention, the dense FFN and the shared expert


def float8_job(parallel: dict, grad_accum: int = MICRO, recipe: str = "tensorwise"):
    cfg = job_config(CFG, parallel)
    cfg.train.float8, cfg.train.grad_accum = recipe, grad_accum
    return cfg.validate()


def pipeline_checkpoint(cfg, state: dict, directory: str) -> tuple[str, list[str]]:
    """Save a PP x FSDP float8 pipeline holding `state`; the checkpoint's path and the float8-gathered weights."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from moetrain.checkpoint.storage import save_checkpoint
    from moetrain.train.build import build_pipeline

    job = JobMesh.from_config(cfg.parallel, dist.get_world_size(), "cpu")
    pipeline = build_pipeline(cfg, job, weights="none")
    load_full_state(pipeline.model, {name: torch.from_numpy(value) for name, value in state.items()})
    gathered = [name for name, p in pipeline.model.named_parameters()
                if isinstance(p.to_local(), WeightWithDynamicFloat8CastTensor)]
    optimizer = torch.optim.SGD(pipeline.model.parameters(), lr=0.1)
    ref = save_checkpoint(directory, 1, pipeline.model, optimizer, {}, {}, 1)
    return str(ref.path), gathered


def worker(runs: list, checkpoint_cfg, state: dict, directory: str) -> dict:
    results = trainer_worker(runs)
    if dist.get_world_size() == 1:
        return {"runs": results}
    return {"runs": results, "checkpoint": pipeline_checkpoint(checkpoint_cfg, state, directory)}


def merge(per_rank: list[dict], index: int = 0) -> dict:
    """Run `index`'s result over the ranks: losses of rank 0, gradients and parameters of every stage."""
    merged = {"losses": per_rank[0]["runs"][index]["losses"], "grads": {}, "params": {}}
    for rank in sorted(per_rank, key=lambda r: r["runs"][index]["first"]):  # the first stage's embedding last
        for what in ("grads", "params"):
            merged[what].update(rank["runs"][index][what])
    return merged


def relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got.astype(np.float64) - want).max() / max(np.abs(want).max(), 1e-30))


def errors(got: dict, want: dict) -> dict[str, float]:
    assert got.keys() == want.keys()
    return {name: relative(value, want[name]) for name, value in got.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """One process, PP 2 x FSDP 2 and FSDP 4 x EP 2, all with float8, over one global batch of 12 microbatches;
    the PP layout's checkpoint."""
    directory = str(tmp_path_factory.mktemp("float8_split"))
    state = {name: t.numpy() for name, t in initial_state(CFG).items()}
    # [step][data rank][microbatch]: the EP layout's 4 data ranks of MICRO microbatches
    batches = [[rank[:MICRO] for rank in step] for step in make_batches(CFG, 4, seed=5)]
    pp_batches = [[step[0] + step[1], step[2] + step[3]] for step in batches]  # 2 data ranks of 2 MICRO
    pp_cfg = float8_job(PP_LAYOUT, 2 * MICRO)
    whole = [[[mb for rank in step for mb in rank]] for step in batches]
    one = run_on_ranks(worker, 1, [(float8_job({"dp_shard": 1}, 4 * MICRO, recipe), state, whole)
                                   for recipe in ("tensorwise", "rowwise")], None, state, directory)
    split = run_on_ranks(worker, WORLD, [(pp_cfg, state, pp_batches), (float8_job(EP_LAYOUT), state, batches),
                                         (float8_job(CP_LAYOUT, 2 * MICRO, "rowwise"), state, pp_batches)],
                         pp_cfg, state, directory, timeout=600)
    return {"one": merge(one), "one rowwise": merge(one, 1), "pp": merge(split), "ep": merge(split, 1),
            "cp": merge(split, 2), "split": split, "state": state}


def test_float8_under_pp_x_fsdp_equals_one_process_and_checkpoints_plain_weights(runs):
    from moetrain.checkpoint.layout import CheckpointRef
    from moetrain.checkpoint.storage import load_model_weights

    expected, got = runs["one"], runs["pp"]
    for step, (a, b) in enumerate(zip(got["losses"], expected["losses"], strict=True)):
        assert abs(a - b) <= 1e-5 * abs(b), (step, got["losses"], expected["losses"])
    worst = errors(got["grads"], expected["grads"]) | {f"param {n}": e for n, e in
                                                      errors(got["params"], expected["params"]).items()}
    name = max(worst, key=worst.__getitem__)
    print(f"PP: losses {got['losses']} vs {expected['losses']}; worst {name}: {worst[name]:.2e}")
    assert worst[name] <= 1e-5, (name, worst[name])
    # Every stage's converted weights gathered in float8 (the attention and dense/shared SwiGLU linears).
    split = runs["split"]
    gathered = sorted({name for rank in split for name in rank["checkpoint"][1]})
    assert len(gathered) == 14 and {n.split(".")[1] for n in gathered} == {"0", "1"}, gathered
    plain = Transformer(CFG)
    load_model_weights(CheckpointRef(1, Path(split[0]["checkpoint"][0])), plain)
    for name, param in plain.named_parameters():
        assert param.dtype == torch.float32 and torch.equal(param.detach(), torch.from_numpy(runs["state"][name])), name


def test_float8_experts_under_ep_against_one_process(runs):
    expected, got = runs["one"], runs["ep"]
    for step, (a, b) in enumerate(zip(got["losses"], expected["losses"], strict=True)):
        assert abs(a - b) <= 1e-5 * abs(b), (step, got["losses"], expected["losses"])
    routed = {n for n in got["grads"] if ".moe.experts." in n}
    assert routed == {"layers.1.moe.experts.w1", "layers.1.moe.experts.w2"}
    grads, params = errors(got["grads"], expected["grads"]), errors(got["params"], expected["params"])
    others = {f"grad {n}": e for n, e in grads.items() if n not in routed}
    others |= {f"param {n}": e for n, e in params.items()}
    name = max(others, key=others.__getitem__)
    print(f"EP: losses {got['losses']} vs {expected['losses']}; worst {name}: {others[name]:.2e}; routed experts' "
          f"gradients {({n: f'{grads[n]:.2e}' for n in sorted(routed)})}")
    assert others[name] <= 1e-5, (name, others[name])
    # The weight-gradient GEMMs' column scales come from other token groups; power-of-two scales leave every cast
    # but the subnormal ones unchanged (module docstring): far inside the 2^-3 |X|^T|dY| of two float8 GEMMs.
    for name in routed:
        assert grads[name] <= 1e-4, (name, grads[name])


def test_rowwise_float8_under_cp_against_one_process(runs):
    one, cp = runs["one rowwise"], runs["cp"]
    for step, (a, b) in enumerate(zip(cp["losses"], one["losses"], strict=True)):
        assert abs(a - b) <= 1e-5 * abs(b), (step, cp["losses"], one["losses"])
    grads, params = errors(cp["grads"], one["grads"]), errors(cp["params"], one["params"])
    linears = {n for n in grads if n.endswith(".weight") and n.rsplit(".", 2)[-2] in CONVERTED_LINEARS}
    others = {n: e for n, e in grads.items() if n not in linears}
    g, o, p = (max(d, key=d.__getitem__) for d in ({n: grads[n] for n in linears}, others, params))
    print(f"CP rowwise: losses {cp['losses']} vs {one['losses']}; worst gradient of a float8 linear {g}: "
          f"{grads[g]:.2e}; of another parameter {o}: {others[o]:.2e}; worst final parameter {p}: {params[p]:.2e}")
    assert params[p] <= 1e-5, (p, params[p])
    assert max(grads[g], others[o]) <= 1e-4, (g, grads[g], o, others[o])
