"""Multi-turn replays: the trace environment, and the figures of a step of
trajectories.

A multi-turn workload (`search-r1`, or a folder of
`multiturn_workload_step_*.jsonl[.gz]`) submits groups of trajectories:
`MultiTurnSpec(max_turns=<the trace's most turns>, environment="trace")`,
each sample's traced turn lengths in `sim.turn_lengths` and its tool calls
in `trace.tool_s` / `trace.observation_lens`. The simulated engines run
with their prefix cache on (`SimParams.prefix_cache`), so a turn is charged
prefill only for the context its engine does not hold; the
`TraceEnvironment` sleeps each traced tool latency (virtual time) and
appends the traced number of observation tokens.

Per step, besides the single-turn figures:

- `prefix_cache_hit_rate`: of the context of requests continuing a
  response (a trajectory's later turns, and migrated requests) that existed
  before (everything but the observation just appended, which no cache can
  hold), the share found in their engine's prefix cache (whole blocks);
  `prefix_cache_hit_rate_of_context` divides by the whole context instead,
  observations included (the trace's own "52%" is this figure averaged per
  turn; by tokens, the trace's later turns could at best find 56%);
  `prefix_cache_hit_rate_all` counts first turns too;
- `engine_idle_while_tools`: engine time idle (no running sequence) while at
  least one tool call was in flight, as a fraction of the fleet's time in
  the step (sampled every `PROBE_INTERVAL_S`);
- `trained_tokens` and `trained_tokens_per_s`: tokens the policy generated
  (loss mask 1; observations excluded) delivered per second of makespan;
- `lower_bound_s`: the larger of the longest trajectory alone (its prompt
  and observations prefilled, one decode step per generated token at batch
  1, and its tool calls, one after another) and the fleet's total work
  (decode at full batches, plus the prefill no prefix cache can avoid: each
  group's prompt once and every observation) spread over the engines. A
  placement that moves a trajectory pays its context's prefill again, which
  the bound does not: the gap shows what lost prefix-cache hits cost.
"""
from __future__ import annotations

import numpy as np

from rollout_service.bench.driver import StepRecord
from research.metrics import CostModel, Counters, FleetProbe
from research.trace_env import NAME as ENV_NAME, TraceEnvironment
from rollout_service.bench.workloads import TrajectoryShape, Workload

__all__ = ["ENV_NAME", "PROBE_INTERVAL_S", "environment", "longest_response", "step_metrics", "summarise"]

PROBE_INTERVAL_S = 0.02  # tool calls last ~0.05-2.5 s in the Search-R1 trace


def environment(w: Workload) -> TraceEnvironment:
    return TraceEnvironment(vocab_size=w.vocab_size or 64)


def longest_response(w: Workload) -> int:
    """The longest trajectory's response (generated and observation tokens)."""
    return max((sum(t.turn_lens) + sum(t.observation_lens)
                for s in w.steps for g in s for t in (g.trajectories or ())), default=0)


def _shapes(record: StepRecord, w: Workload) -> list[tuple[int, TrajectoryShape, float, str]]:
    """(prompt length, traced trajectory, submission offset, group id) of each delivered sample."""
    out = []
    for c in record.samples:
        _, step, group = c.group_id.rsplit("-", 2)
        shape = w.steps[int(step[1:])][int(group[1:])]
        offset = record.group_submitted_at.get(c.group_id, record.submitted_at) - record.submitted_at
        out.append((shape.prompt_len, shape.trajectories[c.index], offset, c.group_id))
    return out


def lower_bound(record: StepRecord, cost: CostModel, engines: int, w: Workload) -> tuple[float, float, float]:
    """(bound, longest trajectory alone, total work / engines), seconds (module docstring)."""
    shapes = _shapes(record, w)
    if not shapes:
        return 0.0, 0.0, 0.0
    b, s, p = cost.decode_base_s, cost.decode_per_seq_s, cost.prefill_per_token_s
    chains = [off + p * (P + sum(t.observation_lens)) + t.generated * (b + s) + sum(t.tool_s)
              for P, t, off, _ in shapes]
    generated = sum(t.generated for _, t, _, _ in shapes)
    prompts = {gid: P for P, _, _, gid in shapes}
    prefill = sum(prompts.values()) + sum(sum(t.observation_lens) for _, t, _, _ in shapes)
    work = (b * generated / cost.max_seqs + s * generated + p * prefill) / engines
    longest = max(chains)
    return max(longest, work) * (1 - 1e-9), longest, work


def step_metrics(record: StepRecord, start: Counters, end: Counters, probe: FleetProbe | None, cost: CostModel,
                 engines: int, w: Workload) -> dict:
    span = record.makespan_s
    bound, longest, work = lower_bound(record, cost, engines, w)
    queried, hits = end.continued_queried - start.continued_queried, end.continued_hits - start.continued_hits
    reusable = max(0, queried - (end.observation_tokens - start.observation_tokens))
    all_q, all_h = end.prefix_queried - start.prefix_queried, end.prefix_hits - start.prefix_hits
    idle = 0.0
    tool_time = 0.0
    if probe is not None and probe.tools:
        t = np.array(probe.times)
        mask = (t >= record.submitted_at) & (t <= record.done_at)
        running = np.array(probe.running, dtype=float)[mask]
        tools = np.array(probe.tools)[mask]
        if len(tools):
            busy_tools = tools > 0
            idle = float(((running == 0) & busy_tools[:, None]).mean())
            tool_time = float(busy_tools.mean())
    trained = sum(c.trained_len for c in record.samples)
    return {
        "lower_bound_s": bound,
        "bound_longest_s": longest,
        "bound_work_s": work,
        "bound_shared_s": 0.0,
        "bound_batch_s": 0.0,
        "ratio_to_bound": span / bound if bound > 0 else None,
        "prefix_cache_queried_tokens": queried,
        "prefix_cache_reusable_tokens": reusable,
        "prefix_cache_hit_tokens": hits,
        "prefix_cache_hit_rate": min(1.0, hits / reusable) if reusable else 0.0,
        "prefix_cache_hit_rate_of_context": hits / queried if queried else 0.0,
        "prefix_cache_hit_rate_all": all_h / all_q if all_q else 0.0,
        "prefilled_tokens": end.prefilled - start.prefilled,
        "engine_idle_while_tools": idle,
        "tool_time_fraction": tool_time,
        "trained_tokens": trained,
        "trained_tokens_per_s": trained / span if span > 0 else 0.0,
        "turns": sum(c.turns for c in record.samples),
        "trajectories_delivered": len(record.samples),
    }


def summarise(steps: list[dict], records: list[StepRecord]) -> dict:
    """Run-level multi-turn figures (sums, and time-weighted means)."""
    spans = np.array([s["makespan_s"] for s in steps])
    total = float(spans.sum())
    queried = sum(s["prefix_cache_queried_tokens"] for s in steps)
    reusable = sum(s["prefix_cache_reusable_tokens"] for s in steps)
    hits = sum(s["prefix_cache_hit_tokens"] for s in steps)
    lbs = np.array([s["lower_bound_s"] for s in steps])
    trained = sum(s["trained_tokens"] for s in steps)
    return {
        "multi_turn": True,
        "lower_bound_s": float(lbs.mean()) if len(lbs) else 0.0,
        "ratio_to_bound": float(total / lbs.sum()) if lbs.sum() > 0 else None,
        "prefix_cache_hit_rate": min(1.0, hits / reusable) if reusable else 0.0,
        "prefix_cache_hit_rate_of_context": hits / queried if queried else 0.0,
        "prefix_cache_hit_rate_all": (sum(s["prefix_cache_hit_rate_all"] * s["makespan_s"] for s in steps) / total
                                      if total > 0 else 0.0),
        "prefilled_tokens": sum(s["prefilled_tokens"] for s in steps),
        "engine_idle_while_tools": (float(sum(s["engine_idle_while_tools"] * s["makespan_s"] for s in steps) / total)
                                    if total > 0 else 0.0),
        "tool_time_fraction": (float(sum(s["tool_time_fraction"] * s["makespan_s"] for s in steps) / total)
                               if total > 0 else 0.0),
        "trained_tokens": trained,
        "trained_tokens_per_s": trained / total if total > 0 else 0.0,
        "turns": sum(s["turns"] for s in steps),
    }
