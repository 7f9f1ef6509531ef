"""PolyTrace readers: per-step length traces and the fitted Intern-S1 distributions.

Formats (see `workloads/polytrace/README.md`):

- `packed_lengths_step_N.jsonl`: one group per line, `input` is the prompt
  length, `output` the response length of each sample (tokens).
- `multiturn_workload_step_N.jsonl[.gz]`: one trajectory per line (Search-R1):
  `prompt_len`, per turn `completion_tokens`, per tool call its turn,
  `latency_s` and `response_token_len` (the observation), `prompt_group_id`.
- `fitted_distributions_intern_s1.json`: scipy `lognorm` parameters
  `(s, loc, scale)` of input and output lengths for math; for tool use the
  distribution of tool calls per session and, per call count, a Gaussian over
  per-session features (`total_input`, `total_output`, ...).
"""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import numpy as np

from rollout_service.bench.workloads import GroupShape, TrajectoryShape, Workload

_STEP = re.compile(r"packed_lengths_step_(\d+)\.jsonl$")
_MT_STEP = re.compile(r"multiturn_workload_step_(\d+)\.jsonl(\.gz)?$")


def is_multiturn(path: Path) -> bool:
    """A multi-turn trace file, or a folder holding some."""
    path = Path(path)
    if path.is_dir():
        return any(_MT_STEP.search(f.name) for f in path.iterdir())
    return bool(_MT_STEP.search(path.name))


def trajectory(row: dict) -> TrajectoryShape:
    """One trace trajectory: its turns' generated lengths and, after each
    turn but the last, the tool time and observation tokens of that turn's
    calls (several calls of one turn: their latencies and lengths summed)."""
    turns = [int(t["completion_tokens"]) for t in row["turns"]]
    n = len(turns)
    tool_s, obs = [0.0] * max(0, n - 1), [0] * max(0, n - 1)
    for call in row.get("tool_calls", ()):
        k = int(call["turn"])
        if k < n - 1:  # a call after the last turn was never answered in the trace
            tool_s[k] += float(call["latency_s"])
            obs[k] += int(call["response_token_len"])
    return TrajectoryShape(turns, tool_s, obs)


def read_multiturn_step(path: Path) -> tuple[list[GroupShape], int]:
    """One step's trajectory groups (by `prompt_group_id`, in file order) and
    the trace's per-turn generation cap (`max_new_tokens`)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    groups: dict[int, GroupShape] = {}
    cap = 0
    with opener(path, "rt") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            if row.get("validate"):
                continue
            cap = max([cap, *(int(t.get("max_new_tokens", 0)) for t in row["turns"])])
            t = trajectory(row)
            g = groups.setdefault(int(row["prompt_group_id"]), GroupShape(int(row["prompt_len"]), [], trajectories=[]))
            g.output_lens.append(t.generated)
            g.trajectories.append(t)
    return list(groups.values()), cap


def load_multiturn(path: Path, name: str) -> Workload:
    """Every `multiturn_workload_step_*.jsonl[.gz]` of a folder (step order), or one file."""
    path = Path(path)
    if path.is_dir():
        files = sorted((f for f in path.iterdir() if _MT_STEP.search(f.name)),
                       key=lambda f: int(_MT_STEP.search(f.name)[1]))
        if not files:
            raise ValueError(f"no multiturn_workload_step_*.jsonl files in {path}")
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"no trace at {path}")
    read = [read_multiturn_step(f) for f in files]
    steps = [s for s, _ in read if s]
    longest = max(sum(t.turn_lens) + sum(t.observation_lens) for s in steps for g in s for t in g.trajectories)
    cap = max(c for _, c in read) or max(L for s in steps for g in s for t in g.trajectories for L in t.turn_lens)
    source = f"PolyTrace {path.name}" if path.is_dir() else f"trace file {path.name}"
    # max_tokens: the budget of one turn; the whole response is bounded by the context only.
    return Workload(name, steps, max_tokens=cap, source=source,
                    params={"turn_cap": cap, "longest_response": longest, "multi_turn": True})


def read_step(path: Path) -> list[GroupShape]:
    """One step's groups, in file order."""
    groups = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if row.get("validate"):
            continue  # validation prompts are not part of a training step
        groups.append(GroupShape(int(row["input"]), [int(x) for x in row["output"]]))
    return groups


def load_trace(path: Path, name: str, cap: int | None = None) -> Workload:
    """Every `packed_lengths_step_*.jsonl` of a folder (in step order), or one file.

    `cap` is the run's response cap (a length equal to it was truncated);
    without one the budget is the longest response in the trace."""
    path = Path(path)
    if path.is_dir():
        files = sorted((f for f in path.iterdir() if _STEP.search(f.name)), key=lambda f: int(_STEP.search(f.name)[1]))
        if not files:
            raise ValueError(f"no packed_lengths_step_*.jsonl files in {path}")
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"no trace at {path}")
    steps = [read_step(f) for f in files]
    steps = [s for s in steps if s]
    longest = max(L for s in steps for g in s for L in g.output_lens)
    source = f"PolyTrace {path.name}" if path.is_dir() else f"trace file {path.name}"
    return Workload(name, steps, max_tokens=max(cap or 0, longest), source=source, params={"cap": cap})


def _lognorm(params: list[float], size: int, rng: np.random.Generator) -> np.ndarray:
    from scipy.stats import lognorm

    s, loc, scale = params
    return lognorm.rvs(s, loc=loc, scale=scale, size=size, random_state=rng)


def _lengths(x: np.ndarray) -> list[int]:
    return [max(1, int(round(v))) for v in x]


def sample_fitted(path: Path, task: str, name: str, seed: int, steps: int, groups_per_step: int,
                  samples_per_group: int = 8) -> Workload:
    """Sample steps of groups from the fitted Intern-S1 distributions.

    Math: prompt and response lengths from the fitted lognormals (a group's
    samples share the prompt, their lengths are independent draws). Tool
    use: each sample is a session: a call count from its empirical
    distribution, then `total_input`/`total_output` from that count's
    Gaussian; the session is replayed as one response of `total_output`
    tokens (tool round-trips are not simulated)."""
    data = json.loads(Path(path).read_text())[task]
    rng = np.random.default_rng(seed)
    n = steps * groups_per_step
    if task == "math_task":
        prompts = _lengths(_lognorm(data["input_distribution"]["parameters"], n, rng))
        outputs = _lengths(_lognorm(data["output_distribution"]["parameters"], n * samples_per_group, rng))
        groups = [GroupShape(prompts[i], outputs[i * samples_per_group:(i + 1) * samples_per_group]) for i in range(n)]
        params = {"input_lognorm": data["input_distribution"]["parameters"],
                  "output_lognorm": data["output_distribution"]["parameters"]}
    else:
        counts = {int(k): v for k, v in data["call_count_distribution"].items()}
        keys = sorted(counts)
        p = np.array([counts[k] for k in keys], dtype=float)
        calls = rng.choice(keys, size=n * samples_per_group, p=p / p.sum())
        inputs = np.empty(len(calls))
        outputs = np.empty(len(calls))
        for c in set(calls.tolist()):
            model = data["sequence_models"][str(c)]
            names = model["feature_names"]
            idx = np.flatnonzero(calls == c)
            draws = rng.multivariate_normal(model["mean_vector"], model["covariance_matrix"], size=len(idx),
                                            check_valid="ignore")
            inputs[idx] = draws[:, names.index("total_input")]
            outputs[idx] = draws[:, names.index("total_output")]
        ins, outs = _lengths(inputs), _lengths(outputs)
        groups = [GroupShape(ins[i * samples_per_group], outs[i * samples_per_group:(i + 1) * samples_per_group])
                  for i in range(n)]
        params = {"call_counts": counts}
    step_groups = [groups[s * groups_per_step:(s + 1) * groups_per_step] for s in range(steps)]
    longest = max(L for g in groups for L in g.output_lens)
    return Workload(name, step_groups, max_tokens=longest, source=f"Intern-S1 fitted {task} (seed {seed})",
                    params={**params, "seed": seed})
