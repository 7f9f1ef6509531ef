"""vLLM's prefix cache behind `VllmEngine`: its own counters in the engine's
load, and `cache_salt` partitioning it (the bundled tiny model, float32, on
conftest's `plain_engine`; each test's prompt is one no other test sends)."""
from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("vllm")

from rollout_service.engines.types import EngineRequest, SamplingParams  # noqa: E402
from rollout_service.engines.vllm import VllmEngine  # noqa: E402

from helpers import unique, vllm_model  # noqa: E402

PROMPT = [1] + [3 + (13 * i) % 90 for i in range(599)]  # 600 tokens: several whole KV blocks


@pytest.fixture(scope="module")
def engine(plain_engine) -> VllmEngine:
    assert plain_engine.describe().dtype == "float32"
    return plain_engine


async def _counted(engine: VllmEngine, prompt: list[int], salt: str = "") -> tuple[int, int]:
    """Run one greedy request; the growth of (queried, hit) prompt tokens."""
    before = engine.load()
    req = EngineRequest(unique("pc"), prompt, [], SamplingParams(max_tokens=4, temperature=0.0), max_new_tokens=4,
                        cache_salt=salt)
    async for _ in engine.add(req):
        pass
    for _ in range(50):  # the stat logger records the scheduler's stats right after the step's outputs
        after = engine.load()
        if after.prefix_cache_queried_tokens > before.prefix_cache_queried_tokens:
            break
        await asyncio.sleep(0.05)
    return (after.prefix_cache_queried_tokens - before.prefix_cache_queried_tokens,
            after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens)


async def test_the_same_prompt_twice_is_found_in_vllms_prefix_cache(engine):
    prompt = PROMPT[:1] + [7] + PROMPT[2:]  # a prompt no other test sends
    queried, hits = await _counted(engine, prompt)
    assert queried == len(prompt) and hits == 0
    queried, hits = await _counted(engine, prompt)
    assert queried == len(prompt)
    assert hits >= len(prompt) // 2  # whole blocks of it, read from vLLM's own counters


async def test_a_different_cache_salt_does_not_hit_the_cached_prompt(engine):
    prompt = PROMPT[:1] + [8] + PROMPT[2:]
    _, first = await _counted(engine, prompt, salt="v0")
    _, same = await _counted(engine, prompt, salt="v0")
    _, other = await _counted(engine, prompt, salt="v1")
    _, unsalted = await _counted(engine, prompt)
    assert first == 0
    assert same >= len(prompt) // 2
    assert other == 0 and unsalted == 0


async def test_a_weight_update_keeps_the_cache_partitioned_by_version(engine):
    """A push does not flush vLLM's prefix cache: requests salted with the
    version that computed a prefix still find it (affinity survives the
    push); the new version's salt does not see it."""
    import os

    from rollout_service.engines.weights import StagedWeights

    prompt = PROMPT[:1] + [9] + PROMPT[2:]
    await _counted(engine, prompt, salt="v0")
    await engine.update_weights(engine.load().policy_version + 1,
                                StagedWeights([], source_path=os.path.join(vllm_model(), "model.safetensors")))
    _, old = await _counted(engine, prompt, salt="v0")
    _, new = await _counted(engine, prompt, salt="v1")
    assert old >= len(prompt) // 2
    assert new == 0
