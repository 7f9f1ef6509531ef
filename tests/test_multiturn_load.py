"""The multi-turn load test: the Search-R1 trace, its environment, and a
small replay of it in virtual time under each policy."""
from __future__ import annotations

import asyncio

import pytest

from rollout_service.bench.driver import group_requests
from research.policies import parse_policy
from research.runner import RunConfig, run_policy
from research.trace_env import TraceEnvironment
from rollout_service.bench.workloads import load_workload
from rollout_service.core.clock import run_virtual
from rollout_service.engines.types import FinishReason
from rollout_service.lifecycle.types import EnvRequest


@pytest.fixture(scope="module")
def small():
    return load_workload("search-r1", steps=2, groups_per_step=12)


def test_the_search_r1_trace_loads_as_groups_of_trajectories():
    w = load_workload("search-r1")
    assert [len(s) for s in w.steps] == [256, 256, 256]
    assert all(g.num_samples == 8 and len(g.trajectories) == 8 for s in w.steps for g in s)
    assert w.max_turns == 5 and w.max_tokens == 3000
    first = w.steps[0][0].trajectories[0]  # the trace's first line
    assert first.turn_lens == [40, 131]
    assert first.observation_lens == [1027]
    assert first.tool_s == pytest.approx([0.07405877])
    assert w.steps[0][0].output_lens[0] == 171  # generated tokens (what is trained on)
    assert all(len(t.tool_s) == len(t.observation_lens) == len(t.turn_lens) - 1
               for s in w.steps for g in s for t in g.trajectories)


def test_the_trace_environment_sleeps_the_traced_latency_and_ends_after_the_last_turn(small):
    g = group_requests(small, 0, "t", 64)[0]
    meta = g.metadata()
    traj = g.trajectories[1]
    env = TraceEnvironment()

    async def ask(turn):
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        reply = await env(EnvRequest("s1", g.group_id, 1, turn, [], [], [], FinishReason.STOP, meta))
        return reply, loop.time() - t0

    async def main():
        return [await ask(k) for k in range(len(traj.turn_lens))]

    replies = run_virtual(main())
    for k, (reply, waited) in enumerate(replies[:-1]):
        assert len(reply.observation_token_ids) == traj.observation_lens[k] and not reply.done
        assert waited == pytest.approx(traj.tool_s[k], abs=1e-6)
    assert replies[-1][0].done
    again = run_virtual(ask(0))[0]
    assert again.observation_token_ids == replies[0][0].observation_token_ids  # deterministic ids


@pytest.mark.parametrize("policy", ["least-assigned", "affinity", "affinity+partial", "affinity+rebalance"])
def test_every_trajectory_is_delivered_with_its_traced_turns(small, policy):
    result = run_policy(RunConfig(small, engines=4, progress=False), parse_policy(policy))
    s = result.summary
    delivered = s.get("samples_delivered_with_drain", s["samples_delivered"])
    assert delivered == s["samples_submitted"] == 2 * 12 * 8
    assert s["duplicate_samples"] == 0
    turns = {t: len(traj.turn_lens) for step in small.steps for g in step for t in [id(g)]
             for traj in g.trajectories}
    assert s["turns"] >= len(turns)
    if not policy.endswith("partial"):
        assert s["trained_tokens"] == sum(t.generated for step in small.steps for g in step for t in g.trajectories)
        assert s["ratio_to_bound"] >= 1.0


def test_affinity_finds_later_turns_context_cached_and_least_assigned_does_not(small):
    cfg = RunConfig(small, engines=8, progress=False)
    base = run_policy(cfg, parse_policy("least-assigned")).summary
    aff = run_policy(cfg, parse_policy("affinity")).summary
    assert aff["prefix_cache_hit_rate"] >= 0.9
    assert base["prefix_cache_hit_rate"] < 0.75  # a turn lands where its prefix is only by chance
    assert aff["prefilled_tokens"] < base["prefilled_tokens"]
