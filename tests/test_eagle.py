"""EAGLE-style drafting on real vLLM CPU engines with the bundled reasoner:
a head built by `rollout-service build-eagle` serves with `method =
"eagle"`, never changes what is sampled, takes draft-weight pushes, follows
a policy push through the embeddings it shares with the target, and is
distilled online from the pushed policy.

The engines are conftest's: the fleet `eagle_service`, whose engine
speculates with the head `head_dir` builds once (a short build: 64
responses, 200 steps at draft depths 1-3), and `plain_engine` as the
reference (shared with test_spec_decode).
"""
from __future__ import annotations

import asyncio
import os

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from rollout_service.drafter import SpecRuntime, eagle  # noqa: E402
from rollout_service.engines.spec_config import SpecConfig  # noqa: E402
from rollout_service.engines.vllm import VllmEngine  # noqa: E402

from helpers import (PROMPT, assert_same_distribution, eagle_cfg, feed_samples, greedy_acceptance,  # noqa: E402
                     problem_prompts, sample, staged, swapped, vllm_model)

MODEL = vllm_model()


@pytest.fixture(scope="module")
def eagle_engine(eagle_service) -> VllmEngine:
    return next(iter(eagle_service.core.engines.values()))


@pytest.fixture(scope="module")
def fresh_dir(tmp_path_factory) -> str:
    """An untrained head, as `eagle.for_policy` starts one."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    return str(eagle.save(eagle.for_policy(policy, seed=7), tmp_path_factory.mktemp("eagle-fresh")))


def head_state(head_dir: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(head_dir, "model.safetensors"))


def test_an_eagle_method_without_a_head_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="engine.spec.model"):
        SpecConfig.from_dict({"method": "eagle"})
    with pytest.raises(ValueError, match="engine.spec.trainer.teacher"):
        SpecConfig.from_dict({"method": "eagle", "model": "/some/head", "train": True})


async def test_greedy_outputs_are_identical_with_an_eagle_head(eagle_engine, plain_engine):
    prompts = [PROMPT, [1, 88, 84, 87, 89, 5, 26, 5, 21, 5, 28, 4], [1, 70, 73, 73, 5, 28, 29, 28, 16, 23, 30, 25, 4]]
    accepted = 0
    for prompt in prompts:
        [(on, drafted, acc)] = await sample(eagle_engine, prompt, 1, max_tokens=80, temperature=0.0)
        [(off, _, _)] = await sample(plain_engine, prompt, 1, max_tokens=80, temperature=0.0)
        assert on == off and drafted > 0
        accepted += acc
    assert accepted > 0
    assert eagle_engine.describe().speculation == "eagle"


async def test_eagle_sampling_matches_plain_sampling(eagle_engine, plain_engine):
    await assert_same_distribution(eagle_engine, plain_engine, "speculative (EAGLE head)")


async def test_a_pushed_eagle_head_changes_acceptance_never_outputs(head_dir, fresh_dir, eagle_engine, plain_engine):
    """The draft-weight path reaches the EAGLE head: an untrained head's
    drafts are accepted less than the built one's, the outputs never move,
    and the built head's acceptance comes back exactly when it is pushed
    again."""
    prompts = problem_prompts(8, seed=404)
    reference = [ids for [(ids, _, _)] in await asyncio.gather(
        *(sample(plain_engine, p, 1, max_tokens=120, temperature=0.0) for p in prompts))]

    async def acceptance() -> float:
        done = await asyncio.gather(*(sample(eagle_engine, p, 1, max_tokens=120, temperature=0.0) for p in prompts))
        assert [ids for [(ids, _, _)] in done] == reference
        return sum(a for [(_, _, a)] in done) / sum(d for [(_, d, _)] in done)

    built = await acceptance()
    version = eagle_engine.speculation.draft_version
    await eagle_engine.speculation.update_draft_weights(version + 1, staged(head_state(fresh_dir)))
    untrained = await acceptance()
    await eagle_engine.speculation.update_draft_weights(version + 2, staged(head_state(head_dir)))
    restored = await acceptance()
    print(f"greedy acceptance: built head {built:.3f}, untrained {untrained:.3f}, built again {restored:.3f}")
    assert untrained < built - 0.1
    assert restored == pytest.approx(built, abs=1e-9)


async def test_an_eagle_head_follows_a_relabelled_policy_without_training(eagle_service, eagle_engine):
    """The pushed policy writes 3 and 7 the other way round (embedding rows
    swapped, tied to its output head). The head reads the policy's hidden
    states and shares its embeddings and output head, so with no training
    at all it drafts for the new policy exactly as it drafted for the old
    one on the relabelled prompts: the push reaches the shared weights, and
    the head does not lag the policy (a standalone drafter loses much of its
    acceptance here, test_spec_decode)."""
    from safetensors.torch import load_file

    from rollout_service.tasks import encode

    core = eagle_service.core
    original = load_file(os.path.join(MODEL, "model.safetensors"))
    [three], [seven] = encode("3"), encode("7")
    prompts = problem_prompts(16, seed=303)
    relabelled = [[{three: seven, seven: three}.get(t, t) for t in p] for p in prompts]
    before = await greedy_acceptance(eagle_engine, relabelled)
    await core.update_weights(core.policy_version + 1, staged(swapped(original, three, seven)))
    try:
        after = await greedy_acceptance(eagle_engine, prompts)
    finally:
        await core.update_weights(core.policy_version + 1, staged(original))
    print(f"EAGLE greedy acceptance: {before:.3f} on the relabelled prompts before the push, {after:.3f} after it")
    assert after == pytest.approx(before, abs=1e-9)


async def test_an_eagle_head_distilled_online_from_the_policy_drafts_better(head_dir, fresh_dir, eagle_service,
                                                                         eagle_engine):
    """`train = true` with `teacher = "policy"`, the trainer starting from an
    untrained head (also the one serving): one online round, in the
    trainer's process that holds the policy copy the head reads hidden
    states from, fits it to the policy on the engine's samples, and the
    pushed result drafts better on held-out prompts."""
    core = eagle_service.core
    held_out = problem_prompts(16, seed=202)
    version = eagle_engine.speculation.draft_version
    await eagle_engine.speculation.update_draft_weights(version + 1, staged(head_state(fresh_dir)))
    untrained = await greedy_acceptance(eagle_engine, held_out)
    runtime = SpecRuntime(core, SpecConfig.from_dict(eagle_cfg(fresh_dir, tune=False, train=True, trainer={
        "teacher": "policy", "min_new_samples": 10**9, "steps_per_round": 60, "nice": 0})))
    await runtime.start()
    trainer = runtime.trainer
    try:
        await feed_samples(trainer, eagle_engine, core.policy_version, problem_prompts(64, seed=101))
        record = await trainer.train_once()
        trained = await greedy_acceptance(eagle_engine, held_out)
        status = runtime.status().trainer
    finally:
        await runtime.stop()
        await eagle_engine.speculation.update_draft_weights(eagle_engine.speculation.draft_version + 1,
                                                            staged(head_state(head_dir)))
    print(f"EAGLE greedy acceptance on held-out prompts: untrained {untrained:.3f}, after one online round "
          f"{trained:.3f} ({record['examples']} samples, {record['seconds']:.1f} s; expected acceptance "
          f"{status.last_acceptance_before:.3f} -> {status.last_acceptance_after:.3f})")
    assert status.rounds == 1 and status.teacher == "policy"
    assert status.last_acceptance_after > status.last_acceptance_before + 0.1
    assert trained > untrained + 0.1
