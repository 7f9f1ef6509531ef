"""The simulated engine's prefix cache: what a turn that finds its context
cached saves (virtual time), and the engine's prefix-cache counters."""
from __future__ import annotations

import asyncio

from rollout_service.core.clock import run_virtual
from rollout_service.engines.sim import SimEngine, SimParams
from rollout_service.engines.types import EngineRequest, SamplingParams

PROMPT = [3 + (7 * i) % 60 for i in range(1000)]
COST = dict(decode_base_s=0.004, decode_per_seq_s=0.0, prefill_per_token_s=0.001)


async def _generate(engine: SimEngine, rid: str, prompt: list[int], generated: list[int] | None = None,
                    length: int = 8, salt: str = "") -> tuple[list[int], float]:
    """One request to its end: its tokens and the seconds it took."""
    generated = list(generated or [])
    req = EngineRequest(rid, prompt, generated, SamplingParams(max_tokens=4096), max_new_tokens=length + 1,
                        hints={"target_length": str(len(generated) + length)}, cache_salt=salt)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    out: list[int] = []
    async for delta in engine.add(req):
        out += delta.token_ids
    return out, loop.time() - t0


def _run(params: SimParams, body):
    async def main():
        engine = SimEngine("e0", params)
        await engine.start()
        try:
            return await body(engine)
        finally:
            await engine.close()

    return run_virtual(main())


def test_a_turn_whose_context_is_cached_pays_only_the_new_tokens_prefill():
    async def body(engine):
        first, t_first = await _generate(engine, "traj-1", PROMPT)
        observation = [5] * 200
        context = first + observation
        _, t_next = await _generate(engine, "traj-1", PROMPT, context)  # the next turn, same engine
        load = engine.load()
        return t_first, t_next, load, len(PROMPT) + len(context)

    t_first, t_next, load, ctx = _run(SimParams(prefix_cache=True, **COST), body)
    # The first turn prefills its 1000 prompt tokens (1 s); the next one only
    # the observation and the partial block before it (<= 200 + 2 * 16 tokens).
    assert t_first > 1.0
    assert t_next < 0.25 + 8 * 0.004 + 0.01
    # Counters: the second lookup found everything but the tail of its context.
    assert load.prefix_cache_queried_tokens == len(PROMPT) + ctx
    assert ctx - 16 - 200 <= load.prefix_cache_hit_tokens <= ctx - 200
    assert load.prefix_cache_hit_rate > 0.4


def test_without_the_prefix_cache_every_turn_pays_its_whole_context():
    async def body(engine):
        first, _ = await _generate(engine, "traj-1", PROMPT)
        _, t_next = await _generate(engine, "traj-1", PROMPT, first + [5] * 200)
        return t_next, engine.load()

    t_next, load = _run(SimParams(**COST), body)
    assert t_next > (1000 + 8 + 200) * 0.001
    assert load.prefix_cache_hit_tokens == 0


def test_a_different_cache_salt_finds_nothing_cached():
    async def body(engine):
        await _generate(engine, "a", PROMPT, salt="v0")
        _, same = await _generate(engine, "b", PROMPT, salt="v0")
        hits_same = engine.load().prefix_cache_hit_tokens
        _, other = await _generate(engine, "c", PROMPT, salt="v1")
        return same, other, hits_same, engine.load().prefix_cache_hit_tokens

    same, other, hits_same, hits_after = _run(SimParams(prefix_cache=True, **COST), body)
    assert hits_same == (len(PROMPT) - 1) // 16 * 16  # whole blocks, the last token computed
    assert hits_after == hits_same  # the v1 request hit nothing
    assert other > 1.0 > 0.1 > same


def test_token_ids_are_the_same_when_a_trajectory_is_continued():
    """A turn continued from a partial response generates exactly the tokens
    an uninterrupted request would have at those positions, so a trajectory's
    context is the same tokens on whichever engine its turns run."""
    async def body(engine):
        whole, _ = await _generate(engine, "traj-9", PROMPT, length=40)
        head, _ = await _generate(engine, "traj-9", PROMPT, length=20)
        tail, _ = await _generate(engine, "traj-9", PROMPT, head[:-1] + [7], length=20)
        return whole, head, tail

    whole, head, tail = _run(SimParams(prefix_cache=True, **COST), body)
    assert head[:-1] == whole[:19]
    assert tail[:-1] == whole[20:39]


def test_cached_blocks_are_evicted_least_recently_used_first_within_the_free_capacity():
    others = [[3 + (11 * i + k) % 60 for i in range(1000)] for k in range(3)]

    async def body(engine):
        await _generate(engine, "a", PROMPT)
        for k, p in enumerate(others):  # 3 more prompts: the cache holds about 2 of the 4
            await _generate(engine, f"o{k}", p)
        _, t_old = await _generate(engine, "a2", PROMPT)  # the oldest: evicted
        _, t_new = await _generate(engine, "o2b", others[2])  # the newest: still cached
        return t_old, t_new

    t_old, t_new = _run(SimParams(prefix_cache=True, kv_capacity_tokens=2100, **COST), body)
    assert t_old > 1.0
    assert t_new < 0.1


def test_a_finished_groups_shared_prompt_is_found_by_its_siblings():
    async def body(engine):
        await _generate(engine, "g-0", PROMPT)
        runs = await asyncio.gather(*(_generate(engine, f"g-{i}", PROMPT) for i in range(1, 8)))
        return [t for _, t in runs], engine.load()

    times, load = _run(SimParams(prefix_cache=True, **COST), body)
    assert max(times) < 0.1
    assert load.prefix_cache_hit_tokens == 7 * ((len(PROMPT) - 1) // 16 * 16)
