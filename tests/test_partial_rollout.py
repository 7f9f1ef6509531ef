"""Partial rollout across policy versions, on real vLLM CPU engines."""
from __future__ import annotations

import asyncio
import contextlib

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from rollout_service.partial import CarryOverConfig  # noqa: E402
from trainer_client import PromptGroup, StepRollout  # noqa: E402

from helpers import bundled_weights, collect, unique, wait_until  # noqa: E402

PROMPT = [1, 40, 41, 42, 14]


@contextlib.contextmanager
def carry_mode(service, **kw):
    saved = service.core.carry_over
    service.core.carry_over = CarryOverConfig(**kw)
    try:
        yield
    finally:
        service.core.carry_over = saved


async def _push_mid_generation(service, client, prefix, n=8, max_tokens=400, attempts=5):
    """Submit a group, push weights once some of it is half-way, collect it.
    On a busy machine a whole group can finish between two looks (its tokens
    arrive in a few large deltas): then it tries again with a fresh group."""
    for attempt in range(attempts):
        gid = f"{prefix}-{attempt}"
        await client.submit([PromptGroup(prompt_token_ids=PROMPT, num_samples=n, max_tokens=max_tokens,
                                         temperature=1.0, group_id=gid)])
        group = service.core.groups.get(gid)
        if group is None:
            continue  # already complete
        deadline = asyncio.get_running_loop().time() + 120
        while not any(len(r.token_ids) >= 10 and r.finish_reason is None for r in group.requests):
            if all(r.finish_reason is not None for r in group.requests):
                break  # finished before we saw it half-way
            assert asyncio.get_running_loop().time() < deadline, "no sample reached 10 tokens in 120 s"
            await asyncio.sleep(0.005)
        else:
            break
    else:
        pytest.fail(f"{attempts} groups finished before any sample was seen half-way")
    old = service.core.policy_version
    reply = await client.push_weights(bundled_weights(), version=old + 1)
    assert reply.applied_version == old + 1
    return old, await collect(client, gid, n, timeout=240)


def _spans(s):
    return [(v, n) for v, _, n in s.versions]


async def test_continue_mode_tags_old_then_new_version(vllm_service, vclient):
    counters0 = (await vclient.status()).counters
    with carry_mode(vllm_service, mode="continue"):
        old, samples = await _push_mid_generation(vllm_service, vclient, unique("cont"))
    carried = [s for s in samples if len(s.versions) == 2]
    assert carried, [(_spans(s), s.finish_reason) for s in samples]
    for s in carried:
        (v0, n0), (v1, n1) = _spans(s)
        assert (v0, v1) == (old, old + 1) and n0 > 0 and n1 > 0
        assert s.engines and len(s.engines) == 1  # kept generating where it was
    for s in samples:
        assert sum(n for _, n in _spans(s)) == len(s.response_token_ids)
    counters = (await vclient.status()).counters
    assert counters["tokens_carried"] > counters0.get("tokens_carried", 0)


async def test_pause_resume_mode_reprefills_and_keeps_old_tokens(vllm_service, vclient):
    before = (await vclient.status()).counters.get("tokens_reprefilled", 0)
    with carry_mode(vllm_service, mode="pause-resume"):
        old, samples = await _push_mid_generation(vllm_service, vclient, unique("pause"))
    carried = [s for s in samples if len(s.versions) == 2]
    assert carried
    for s in carried:
        (v0, n0), (v1, n1) = _spans(s)
        assert (v0, v1) == (old, old + 1) and n0 > 0 and n1 > 0
        assert len(s.engines) == 2  # aborted with its partial, resumed by re-prefill
    assert (await vclient.status()).counters["tokens_reprefilled"] > before


async def test_restart_mode_discards_and_regenerates_under_new_weights(vllm_service, vclient):
    before = (await vclient.status()).counters.get("tokens_discarded", 0)
    with carry_mode(vllm_service, mode="restart"):
        old, samples = await _push_mid_generation(vllm_service, vclient, unique("restart"))
    restarted = [s for s in samples if s.min_version == old + 1]
    assert restarted
    for s in samples:
        assert len(s.versions) == 1  # never a mix
    assert (await vclient.status()).counters["tokens_discarded"] > before


async def test_max_version_lag_bounds_staleness_and_loses_nothing(vllm_service, vclient):
    with carry_mode(vllm_service, mode="continue", max_version_lag=1, stale_action="restart"):
        prefix = unique("lag")
        groups = [PromptGroup(prompt_token_ids=PROMPT, num_samples=4, max_tokens=400, temperature=1.0,
                              group_id=f"{prefix}-{i}") for i in range(6)]
        await vclient.submit(groups)
        delivered = []
        # The version serving when each sample finished (a client may read it
        # after a later push): what the lag is bounded against.
        version_at_finish = {}

        def tap(sample):
            version_at_finish[sample.sample_id] = vllm_service.core.policy_version

        vllm_service.core.sample_taps.append(tap)

        async def consume():
            async for s in vclient.stream():
                if s.group_id.startswith(prefix):
                    delivered.append(s)
                    if len(delivered) == 24:
                        return

        task = asyncio.create_task(consume())
        for _ in range(3):
            await asyncio.sleep(0.4)  # pushes paced through the rollout: the behaviour under test
            if task.done():
                break
            v = vllm_service.core.policy_version
            await vclient.push_weights(bundled_weights(), version=v + 1)
        try:
            await asyncio.wait_for(task, 240)
        finally:
            vllm_service.core.sample_taps.remove(tap)
    assert len({s.sample_id for s in delivered}) == 24  # each once, none lost
    for s in delivered:
        current = version_at_finish[s.sample_id]
        assert s.min_version >= current - 1, (s.versions, current)
        assert s.finish_reason in ("stop", "length")


async def test_stale_groups_can_be_dropped_with_a_reason(vllm_service, vclient):
    with carry_mode(vllm_service, mode="continue", max_version_lag=0, stale_action="drop"):
        gid = unique("drop")
        await vclient.submit([PromptGroup(prompt_token_ids=PROMPT, num_samples=4, max_tokens=400, temperature=1.0,
                                          group_id=gid)])
        group = vllm_service.core.groups[gid]
        await wait_until(lambda: any(len(r.token_ids) >= 5 and r.finish_reason is None for r in group.requests),
                         120, "a sample of the group 5 tokens in", interval=0.005)
        await vclient.push_weights(bundled_weights(), version=vllm_service.core.policy_version + 1)
        samples = await collect(vclient, gid, 4, timeout=120)
    assert len({s.sample_id for s in samples}) == 4
    dropped = [s for s in samples if s.drop_reason]
    assert dropped and all(s.drop_reason == "max_version_lag" and s.finish_reason == "aborted" for s in dropped)
    assert sum(s.group_complete for s in samples) == 1


async def test_step_rollout_hands_over_oldest_complete_groups(vllm_service, vclient):
    prefix = unique("step")

    def prompts():
        i = 0
        while True:
            yield PromptGroup(prompt_token_ids=[1, 20 + i % 40, 14], num_samples=2, max_tokens=200, temperature=1.0,
                              group_id=f"{prefix}-{i}")
            i += 1

    steps = StepRollout(vclient, prompts(), groups_per_step=3, over_provision=2.0)
    seen = set()
    for step in range(3):
        groups = await asyncio.wait_for(steps.next_step(), 240)
        assert len(groups) == 3
        for g in groups:
            assert len(g) == 2 and g[0].group_id not in seen
            seen.add(g[0].group_id)
        await vclient.push_weights(bundled_weights(), version=vllm_service.core.policy_version + 1)
    assert steps.in_flight <= 6
