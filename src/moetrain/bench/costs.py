"""Per-(step, microbatch, replica group) cost draws shared by `bench sync` and `simulate`.

Both the benchmark and the simulator call `draw_costs` with the same spec and seed, so
the simulator predicts the step times of exactly the microbatch costs the benchmark ran.
A cost is a number in the unit of the cost model: seconds of sleep (`sleep`), samples
per microbatch (`batch`), mean document length (`packed`). Step k's draw depends only
on (seed, k), never on how many steps are drawn, so a longer run extends a shorter one.

All ranks of one replica group (the `dp_shard` ranks holding one copy of the model)
get the same cost: they run one microbatch together. Ranks are laid out row-major on
the (dp_replicate, dp_shard) mesh, so rank r belongs to replica group r // dp_shard.
A 1-D FSDP run over the same ranks uses the same mapping (rank r gets the cost of
group r // dp_shard), so every rank does the same work in every mode.

`load_trace` reads measured compute seconds of the same [steps, accum, groups] layout (a `bench sync`
JSON's "costs_s"). This module only draws and reads numbers; it must not time, sleep or touch torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from moetrain.args import read_input_json
from moetrain.errors import ConfigError

Distribution = Literal["bimodal", "lognormal", "constant"]
DISTRIBUTIONS: tuple[str, ...] = ("bimodal", "lognormal", "constant")


@dataclass(frozen=True)
class CostSpec:
    """A cost distribution.

    bimodal: `short` with probability 1 - p_long, `short * ratio` with probability p_long.
    lognormal: mean `short`, coefficient of variation `cv`.
    constant: always `short` (the zero-variance control).
    """

    distribution: Distribution = "bimodal"
    short: float = 0.04
    ratio: float = 4.0
    p_long: float = 0.5
    cv: float = 0.5

    def validate(self) -> CostSpec:
        if self.distribution not in DISTRIBUTIONS:
            raise ConfigError(f"cost.distribution {self.distribution!r} is invalid: valid are {DISTRIBUTIONS}")
        if not (self.short > 0 and math.isfinite(self.short)):
            raise ConfigError(f"cost.short = {self.short!r} is invalid: must be a finite number > 0")
        if not (self.ratio >= 1 and math.isfinite(self.ratio)):
            raise ConfigError(f"cost.ratio = {self.ratio!r} is invalid: must be a finite number >= 1")
        if not 0 <= self.p_long <= 1:
            raise ConfigError(f"cost.p_long = {self.p_long!r} is invalid: must be in [0, 1]")
        if not (self.cv >= 0 and math.isfinite(self.cv)):
            raise ConfigError(f"cost.cv = {self.cv!r} is invalid: must be a finite number >= 0")
        return self

    @property
    def long(self) -> float:
        return self.short * self.ratio

    def mean(self) -> float:
        if self.distribution == "bimodal":
            return self.short + self.p_long * (self.long - self.short)
        return self.short

    def std(self) -> float:
        if self.distribution == "bimodal":
            return (self.long - self.short) * math.sqrt(self.p_long * (1 - self.p_long))
        if self.distribution == "lognormal":
            return self.short * self.cv
        return 0.0

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        if self.distribution == "bimodal":
            is_long = rng.random(shape) < self.p_long
            return np.where(is_long, self.long, self.short)
        if self.distribution == "lognormal":
            # Parameters of the underlying normal that give mean `short` and the requested CV.
            sigma2 = math.log1p(self.cv**2)
            return rng.lognormal(math.log(self.short) - sigma2 / 2, math.sqrt(sigma2), shape)
        return np.full(shape, self.short)


def step_rng(seed: int, step: int) -> np.random.Generator:
    """The generator of one step: a function of (seed, step) only."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, step])))


def draw_costs(spec: CostSpec, seed: int, steps: int, accum: int, groups: int, first_step: int = 0) -> np.ndarray:
    """Costs [steps, accum, groups]: one per (step, microbatch, replica group)."""
    spec.validate()
    for name, value in (("steps", steps), ("accum", accum), ("groups", groups)):
        if value < 1:
            raise ConfigError(f"{name} = {value!r} is invalid: must be a positive integer")
    return np.stack([spec.sample(step_rng(seed, first_step + k), (accum, groups)) for k in range(steps)])


def replica_group_of(rank: int, shard: int) -> int:
    """Replica group (dp_replicate coordinate) of a rank on the row-major (replicate, shard) mesh."""
    return rank // shard


def costs_per_rank(costs: np.ndarray, shard: int) -> np.ndarray:
    """Expand [..., groups] group costs to [..., groups * shard] rank costs (rank r gets group r // shard)."""
    return np.repeat(costs, shard, axis=-1)


def as_batch_sizes(costs: np.ndarray) -> np.ndarray:
    """Round sample-count costs to whole samples (at least one) for the `batch` cost model."""
    return np.maximum(np.rint(costs), 1).astype(np.int64)


def expected_sum_of_max_bimodal(spec: CostSpec, accum: int, groups: int) -> float:
    """E[Σ_microbatches max_groups cost] for the bimodal spec: every microbatch waits for the slowest group."""
    p_any_long = 1 - (1 - spec.p_long) ** groups
    return accum * (spec.short + (spec.long - spec.short) * p_any_long)


def expected_max_of_sum_bimodal(spec: CostSpec, accum: int, groups: int) -> float:
    """E[max_groups Σ_microbatches cost] for the bimodal spec, exactly.

    A group's sum is short·accum + (long - short)·K with K ~ Binomial(accum, p), so
    E[max K] = Σ_{k>=1} P(max K >= k) = Σ_{k=1..accum} 1 - F(k-1)^groups.
    """
    pmf = [math.comb(accum, k) * spec.p_long**k * (1 - spec.p_long) ** (accum - k) for k in range(accum + 1)]
    cdf = np.cumsum(pmf)
    expected_max_k = sum(1 - cdf[k - 1] ** groups for k in range(1, accum + 1))
    return spec.short * accum + (spec.long - spec.short) * expected_max_k


def load_trace(path: str, replicate: int) -> np.ndarray:
    """Measured compute seconds [steps, accum, replicate] from a JSON file with a "costs_s" array."""
    try:
        costs = np.asarray(read_input_json(path, "--trace")["costs_s"], dtype=np.float64)
    except (KeyError, ValueError, TypeError, IndexError, RecursionError) as err:
        raise ConfigError(f"trace {path!r} has no numeric \"costs_s\" [steps][accum][groups] array ({err})") from None
    if costs.ndim != 3 or costs.shape[2] != replicate:
        raise ConfigError(f"trace {path!r} has costs_s of shape {costs.shape}: expected [steps, accum, {replicate}]")
    return costs
