"""Workloads: what a load test submits, step by step.

A `Workload` is a list of steps; a step is a list of GRPO groups, each a
prompt length and the response length of every sample (token counts). The
simulated engine generates exactly those lengths (through the
`sim.target_lengths` hint); a real engine generates what its model generates.

Named workloads (`load_workload(name)`):

| name | source |
|---|---|
| `math` | PolyTrace `math_dapo_32b/` (DAPO, Qwen2.5-32B): 6 steps x 96 groups x 8 |
| `code` | PolyTrace `code_deepcoder_14b/` (DeepCoder 14B, 16K cap): 5 steps x 16 x 8 |
| `video` | PolyTrace `video_vl_7b/` (Qwen2.5-VL-7B): 10 steps x 64 x 8 |
| `intern-math` | lognormal fits of Intern-S1 math lengths, sampled with a seed |
| `intern-tool` | Intern-S1 tool-use sessions (call count, then a Gaussian per count) |
| `synthetic` | a heavy-tailed generator with named parameters (`synthetic:median=300,sigma=1.2`) |
| `tiny-reasoner` | real prompts of `rollout_service.tasks` (the bundled tiny model's tasks) |
| `search-r1` | PolyTrace `search_r1_multiturn/` (multi-turn search agent): 3 steps x 256 groups x 8 trajectories |
| a path | a folder of `packed_lengths_step_*.jsonl` (or `multiturn_workload_step_*.jsonl[.gz]`) files, or one such file |

A multi-turn workload's groups carry a `TrajectoryShape` per sample: the
generated length of each turn, and between turns the tool's latency and the
observation's length; `output_lens` is then each trajectory's generated
tokens (what is trained on).

The PolyTrace folder is `$ROLLOUT_WORKLOADS_DIR` (default: the traces
installed with the package, `rollout_service/bench/traces/`).

`length_scale` multiplies every prompt and response length (at least 1 token)
so that a run on real engines fits a small machine while keeping the shape of
the distribution; reports state the factor.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

BUNDLED_TRACES = Path(__file__).resolve().parents[1] / "traces"


def workloads_dir() -> Path:
    """Where the PolyTrace data lives: `$ROLLOUT_WORKLOADS_DIR` or the bundled traces."""
    return Path(os.environ.get("ROLLOUT_WORKLOADS_DIR") or BUNDLED_TRACES)


@dataclass(slots=True)
class TrajectoryShape:
    """One multi-turn trajectory: tokens generated per turn, and after each
    turn but the last the tool's latency (seconds) and the observation's
    length (tokens) appended before the next turn."""

    turn_lens: list[int]
    tool_s: list[float]
    observation_lens: list[int]

    @property
    def generated(self) -> int:
        return sum(self.turn_lens)


@dataclass(slots=True)
class GroupShape:
    """One GRPO group of a workload (lengths in tokens).

    `prompt_token_ids` is set when the workload has real prompts
    (tiny-reasoner); otherwise the driver synthesises `prompt_len` ids.
    `problem` is kept for reward checks of real generations."""

    prompt_len: int
    output_lens: list[int]
    prompt_token_ids: list[int] | None = None
    problem: object | None = None
    trajectories: list[TrajectoryShape] | None = None  # multi-turn: one per sample
    prompt_text: str | None = None  # a text prompt (prompt files): sent as text, `prompt_len` unknown (0)

    @property
    def num_samples(self) -> int:
        return len(self.output_lens)


@dataclass(slots=True)
class Workload:
    """Steps of groups, plus what a run needs to submit them.

    `max_tokens` is the per-sample generation budget (the trace's cap where
    it has one: a trace length at the cap is generated as a truncated,
    `length`-finished sample)."""

    name: str
    steps: list[list[GroupShape]]
    max_tokens: int
    source: str
    length_scale: float = 1.0
    params: dict[str, object] = field(default_factory=dict)
    vocab_size: int = 0  # > 0 when prompt ids must come from a real vocabulary

    @property
    def multi_turn(self) -> bool:
        return any(g.trajectories for step in self.steps for g in step)

    @property
    def max_turns(self) -> int:
        return max((len(t.turn_lens) for step in self.steps for g in step for t in (g.trajectories or ())), default=0)

    @property
    def groups_per_step(self) -> int:
        return len(self.steps[0]) if self.steps else 0

    def output_lengths(self) -> np.ndarray:
        return np.array([L for step in self.steps for g in step for L in g.output_lens], dtype=np.int64)

    def resized(self, steps: int | None = None, groups_per_step: int | None = None) -> "Workload":
        """The same workload with `steps` steps of `groups_per_step` groups.
        Steps repeat cyclically when more are asked than the source has; a
        step asked for more groups than its source step has continues with
        the groups of the following steps (no group repeats within a step
        unless the whole workload is smaller than one step)."""
        n_steps = steps or len(self.steps)
        pool = [g for step in self.steps for g in step]
        starts = np.cumsum([0] + [len(step) for step in self.steps])
        out = []
        for s in range(n_steps):
            k = s % len(self.steps)
            n = groups_per_step or len(self.steps[k])
            if n <= len(self.steps[k]):
                out.append(self.steps[k][:n])
            else:
                out.append([pool[(starts[k] + i) % len(pool)] for i in range(n)])
        return self._with_steps(out)

    def _with_steps(self, steps: list[list[GroupShape]]) -> "Workload":
        """This workload with other steps (its own parameters copied)."""
        return Workload(self.name, steps, self.max_tokens, self.source, self.length_scale, dict(self.params),
                        self.vocab_size)

    def split(self, parts: int) -> list["Workload"]:
        """The steps cut into `parts` consecutive workloads, in order (the
        first ones a step longer when the steps do not divide evenly)."""
        if not 1 <= parts <= len(self.steps):
            raise ValueError(f"cannot split {len(self.steps)} steps into {parts} parts")
        bounds = np.cumsum([0] + [len(a) for a in np.array_split(np.arange(len(self.steps)), parts)])
        return [self._with_steps(self.steps[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]

    def describe(self) -> dict:
        """Summary statistics (tokens) for reports."""
        L = self.output_lengths()
        per_step = [[x for g in step for x in g.output_lens] for step in self.steps]
        util = [float(np.mean(s) / np.max(s)) for s in per_step if s]
        srt = np.sort(L)[::-1]
        top = srt[: max(1, len(srt) // 10)]
        return {
            "name": self.name,
            "source": self.source,
            "length_scale": self.length_scale,
            "steps": len(self.steps),
            "groups_per_step": self.groups_per_step,
            "samples_per_group": self.steps[0][0].num_samples if self.steps and self.steps[0] else 0,
            "max_tokens": self.max_tokens,
            "output_p50": float(np.percentile(L, 50)),
            "output_p90": float(np.percentile(L, 90)),
            "output_p99": float(np.percentile(L, 99)),
            "output_max": int(L.max()),
            "output_mean": float(L.mean()),
            "slot_utilisation_mean_over_max": float(np.mean(util)) if util else 0.0,
            "tail_10pct_token_share": float(top.sum() / L.sum()) if L.sum() else 0.0,
            "params": {k: v for k, v in self.params.items()},
        }


def scale_length(n: int, scale: float) -> int:
    return max(1, int(round(n * scale)))


def scaled(workload: Workload, scale: float) -> Workload:
    """Multiply every prompt and response length (and the cap) by `scale`."""
    if scale == 1.0:
        return workload
    steps = [
        [
            GroupShape(
                g.prompt_len if g.prompt_token_ids is not None or g.prompt_text else scale_length(g.prompt_len, scale),
                [scale_length(L, scale) for L in g.output_lens],
                g.prompt_token_ids,
                g.problem,
                [TrajectoryShape([scale_length(L, scale) for L in t.turn_lens], list(t.tool_s),
                                 [scale_length(L, scale) for L in t.observation_lens])
                 for t in g.trajectories] if g.trajectories else None,
                g.prompt_text,
            )
            for g in step
        ]
        for step in workload.steps
    ]
    return Workload(workload.name, steps, scale_length(workload.max_tokens, scale), workload.source,
                    workload.length_scale * scale, dict(workload.params), workload.vocab_size)


TRACES = {"math": "math_dapo_32b", "code": "code_deepcoder_14b", "video": "video_vl_7b"}
MULTI_TURN_TRACES = {"search-r1": "search_r1_multiturn"}
TRACE_CAPS = {"code": 16000}  # response caps stated by the trace (README); others: the longest sample
FITTED = {"intern-math": "math_task", "intern-tool": "tool_calling_task"}
WORKLOADS = (*TRACES, *MULTI_TURN_TRACES, *FITTED, "synthetic", "tiny-reasoner")


def load_workload(
    name: str,
    seed: int = 0,
    length_scale: float = 1.0,
    steps: int | None = None,
    groups_per_step: int | None = None,
) -> Workload:
    """A named workload (see the module docstring) or a path to trace files.

    `steps` and `groups_per_step` default to the trace's own; generated
    workloads (fitted, synthetic, tiny-reasoner) take them as their size."""
    from rollout_service.bench.workloads import polytrace, synthetic, tiny_reasoner

    base, _, arg = name.partition(":")
    if base in TRACES:
        w = polytrace.load_trace(workloads_dir() / TRACES[base], name=base, cap=TRACE_CAPS.get(base))
    elif base in MULTI_TURN_TRACES:
        w = polytrace.load_multiturn(workloads_dir() / MULTI_TURN_TRACES[base], name=base)
    elif Path(name).exists() and polytrace.is_multiturn(Path(name)):
        w = polytrace.load_multiturn(Path(name), name=Path(name).stem)
    elif base in FITTED:
        w = polytrace.sample_fitted(
            workloads_dir() / "fitted_distributions_intern_s1.json", FITTED[base], name=base, seed=seed,
            steps=steps or 4, groups_per_step=groups_per_step or 64,
        )
    elif base == "synthetic":
        params = synthetic.SyntheticParams.parse(arg)
        if steps:
            params.steps = steps
        if groups_per_step:
            params.groups_per_step = groups_per_step
        w = synthetic.generate(params, seed=seed)
    elif base == "tiny-reasoner":
        w = tiny_reasoner.generate(steps=steps or 4, groups_per_step=groups_per_step or 32, seed=seed, difficulty=arg or "default")
    elif Path(name).exists():
        w = polytrace.load_trace(Path(name), name=Path(name).stem)
    else:
        raise ValueError(
            f"unknown workload {name!r}: choose from {list(WORKLOADS)} or give a folder of "
            f"packed_lengths_step_*.jsonl files (or one file)"
        )
    w = w.resized(steps, groups_per_step)
    return scaled(w, length_scale)


__all__ = ["GroupShape", "Workload", "WORKLOADS", "load_workload", "scaled", "workloads_dir"]
