"""A synthetic heavy-tailed workload with named parameters.

Response length of sample j of group g (tokens):

    log L = log(median) + sigma * (sqrt(group_corr) * z_g + sqrt(1 - group_corr) * z_gj)

and with probability `tail_prob` a sample instead runs `tail_factor` times
longer than that (the rare runaway responses that set a step's makespan),
truncated at `cap`. `group_corr` is the share of the log-variance that the
samples of one prompt have in common (PolyTrace shows strong sibling
correlation). Prompt lengths are log-normal around `prompt_median`.

On the command line: `--workload synthetic:median=300,sigma=1.2,tail_prob=0.01`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from rollout_service.bench.workloads import GroupShape, Workload


@dataclass(slots=True)
class SyntheticParams:
    median: float = 400.0  # tokens
    sigma: float = 0.8
    group_corr: float = 0.5
    tail_prob: float = 0.02
    tail_factor: float = 8.0
    cap: int = 16384  # tokens
    prompt_median: float = 200.0  # tokens
    prompt_sigma: float = 0.4
    samples_per_group: int = 8
    groups_per_step: int = 64
    steps: int = 4

    @classmethod
    def parse(cls, text: str) -> "SyntheticParams":
        """`"median=300,sigma=1.2"` -> params; unknown names are an error."""
        p = cls()
        names = {f.name: f for f in dataclasses.fields(cls)}
        for item in filter(None, (s.strip() for s in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep or key not in names:
                raise ValueError(f"synthetic workload: bad parameter {item!r}; known: {sorted(names)}")
            setattr(p, key, int(float(value)) if names[key].type in (int, "int") else float(value))
        if not 0 <= p.group_corr <= 1 or not 0 <= p.tail_prob <= 1:
            raise ValueError("synthetic workload: group_corr and tail_prob must be in [0, 1]")
        return p


def generate(params: SyntheticParams, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    n, k = params.steps * params.groups_per_step, params.samples_per_group
    z_group = rng.standard_normal((n, 1))
    z_own = rng.standard_normal((n, k))
    logs = np.log(params.median) + params.sigma * (np.sqrt(params.group_corr) * z_group + np.sqrt(1 - params.group_corr) * z_own)
    lengths = np.exp(logs) * np.where(rng.random((n, k)) < params.tail_prob, params.tail_factor, 1.0)
    lengths = np.clip(np.round(lengths), 1, params.cap).astype(int)
    prompts = np.maximum(1, np.round(params.prompt_median * np.exp(params.prompt_sigma * rng.standard_normal(n)))).astype(int)
    groups = [GroupShape(int(prompts[i]), lengths[i].tolist()) for i in range(n)]
    steps = [groups[s * params.groups_per_step:(s + 1) * params.groups_per_step] for s in range(params.steps)]
    return Workload("synthetic", steps, max_tokens=params.cap, source=f"synthetic heavy tail (seed {seed})",
                    params={**dataclasses.asdict(params), "seed": seed})
