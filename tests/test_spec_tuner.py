"""Speculation without real engines: configuration, the depth tuner, the
simulated engine's speculation model, sibling drafting, the exactness
statistics, and the load-test mechanisms (fast; no vLLM engine starts)."""
from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from rollout_service.config import load_config
from rollout_service.core.clock import run_virtual
from rollout_service.engines.types import EngineRequest, SamplingParams
from rollout_service.drafter import DepthTuner, TunerConfig, TunerLoop
from rollout_service.drafter.exactness import detectable_shift, homogeneity_test
from rollout_service.drafter.mechanisms import mechanism_spec
from rollout_service.drafter.runtime import SpecRuntime
from rollout_service.drafter.status import SpecStatus
from rollout_service.engines.sim import SimEngine, SimParams
from rollout_service.engines.spec_config import SpecConfig, dense_lookup, normalize_schedule
from rollout_service.engines.spec_monitor import StepObservation
from rollout_service.engines.spec_status import DepthBucket
from rollout_service.engines.vllm_siblings import group_of, propose_from

from helpers import wait_until


def test_spec_config_maps_to_vllm_speculative_config():
    off = SpecConfig.from_dict({})
    assert not off.enabled and off.vllm_speculative_config(64) is None
    draft = SpecConfig.from_dict({"method": "draft_model", "model": "/m", "num_speculative_tokens": 3,
                                  "schedule": [[1, 4, 3], [5, 1000, 0]]}).vllm_speculative_config(64)
    assert draft == {"method": "draft_model", "model": "/m", "num_speculative_tokens": 3, "draft_sample_method": "greedy",
                     "num_speculative_tokens_per_batch_size": [(1, 4, 3), (5, 64, 0)]}
    ngram = SpecConfig.from_dict({"method": "ngram"}).vllm_speculative_config(8)
    assert ngram["method"] == "ngram" and ngram["prompt_lookup_max"] == 4
    siblings = SpecConfig.from_dict({"method": "siblings"}).vllm_speculative_config(8)
    assert siblings["method"] == "custom_class" and siblings["model"].endswith("SiblingProposer")


@pytest.mark.parametrize("bad, word", [
    ({"method": "eagle"}, "method"),
    ({"method": "ngram", "schedule": [[2, 4, 1]]}, "start at batch size 1"),
    ({"method": "ngram", "schedule": [[1, 4, 1], [3, 8, 2]]}, "overlap"),
    ({"method": "ngram", "train": True}, "train"),
    ({"method": "ngram", "no_such": 1}, "unknown"),
])
def test_bad_spec_config_names_the_field(bad, word):
    with pytest.raises(ValueError, match=word):
        SpecConfig.from_dict(bad)


def test_spec_table_loads_from_toml(tmp_path):
    path = tmp_path / "svc.toml"
    path.write_text('[engine]\nkind = "sim"\n[engine.spec]\nmethod = "ngram"\nschedule = [[1, 2, 4], [3, 64, 0]]\n')
    cfg = load_config(path, ["engine.spec.num_speculative_tokens=4", "engine.spec.tuner.epsilon=0.0"])
    assert isinstance(cfg.engine.spec, SpecConfig)
    assert cfg.engine.spec == SpecConfig(method="ngram", schedule=[[1, 2, 4], [3, 64, 0]], num_speculative_tokens=4,
                                         tuner={"epsilon": 0.0})


def test_a_flag_switches_speculation_on_and_a_bad_value_names_engine_spec():
    assert load_config(None, ["engine.spec.method=ngram"]).engine.spec.method == "ngram"
    with pytest.raises(ValueError, match="engine.spec.method"):
        load_config(None, ["engine.spec.method=medusa"])
    with pytest.raises(ValueError, match="engine.spec.no_such"):
        load_config(None, ["engine.spec.no_such=1"])


def test_dense_lookup_matches_vllm():
    utils = pytest.importorskip("vllm.v1.spec_decode.dynamic.utils")
    for schedule in ([(1, 4, 4), (5, 16, 2), (17, 64, 0)], [(1, 1, 3), (8, 20, 1)], [(1, 100, 2)]):
        normalized = normalize_schedule(schedule, 32, 3)
        assert dense_lookup(normalized, 32) == utils.build_dynamic_sd_schedule_lookup(list(schedule), 32, 3)


def _observe(tuner, rates: dict[int, float], batch=1, n=8):
    """Feed n steps per arm in force: tokens/s per sequence `rates[k]`."""
    for _ in range(n):
        k = tuner.choice[tuner.bucket_of(batch)]
        tuner.observe([StepObservation(batch, k, 0.1, round(rates[k] * 0.1 * batch))])
        tuner.choose()


def test_tuner_tries_every_depth_then_keeps_the_fastest():
    tuner = DepthTuner(TunerConfig(epsilon=0.0, min_observations=2, seed=1), max_k=4, max_seqs=64)
    rates = {0: 300, 1: 420, 2: 510, 3: 480, 4: 400}
    _observe(tuner, rates, n=40)
    assert tuner.choice[0] == 2 and tuner.best()[0] == 2
    assert set(tuner.state().buckets[0].observations) == {0, 1, 2, 3, 4}
    # Buckets never seen keep their initial choice.
    assert tuner.choice[-1] == 0


def test_tuner_follows_a_change_within_its_window():
    tuner = DepthTuner(TunerConfig(epsilon=0.2, window=8, min_observations=2, seed=0), max_k=2, max_seqs=8)
    _observe(tuner, {0: 300, 1: 200, 2: 100}, n=60)
    assert tuner.best()[0] == 0
    _observe(tuner, {0: 300, 1: 450, 2: 600}, n=200)  # the drafter got better
    assert tuner.best()[0] == 2


def test_tuner_ignores_pauses():
    tuner = DepthTuner(TunerConfig(epsilon=0.0, min_observations=2), max_k=1, max_seqs=8, initial=[(1, 8, 1)])
    tuner.observe([StepObservation(1, 1, 0.01, 3) for _ in range(4)])
    tuner.observe([StepObservation(1, 1, 5.0, 3)])  # a weight update between two steps
    assert len(tuner.arms[0][1].obs) == 4


def _sim(**spec) -> SimParams:
    values = dict(decode_base_s=0.004, decode_per_seq_s=0.0002, length_median=200, length_sigma=0.0)
    return SimParams(**{**values, **spec})


async def _generate(engine, n, length=200):
    async def one(i):
        req = EngineRequest(f"g/{i}", [1, 2, 3], [], SamplingParams(max_tokens=400), 400, {"target_length": str(length)})
        tokens = drafted = accepted = 0
        async for d in engine.add(req):
            tokens += len(d.token_ids)
            drafted += d.draft_tokens
            accepted += d.accepted_tokens
        return tokens, drafted, accepted

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    out = await asyncio.gather(*(one(i) for i in range(n)))
    return loop.time() - t0, out


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_sim_speculation_speeds_up_the_tail_only(method):
    """A simulated drafter (a draft model, or an EAGLE head: both run once per
    step even at K=0 on vLLM) speeds up a lone sequence by its acceptance
    and costs a full batch one draft pass per step."""
    run_virtual(_test_sim_speculation_speeds_up_the_tail_only(method))


async def _test_sim_speculation_speeds_up_the_tail_only(method):
    plain = SimEngine("plain", _sim())
    spec = SimEngine("spec", _sim(spec_method=method, spec_max_k=4, spec_acceptance=0.8, spec_draft_cost=0.05,
                                  spec_schedule=[[1, 4, 4], [5, 64, 0]]))
    for e in (plain, spec):
        await e.start()
    t_plain, _ = await _generate(plain, 1)
    t_spec, [(tokens, drafted, accepted)] = await _generate(spec, 1)
    length = 1 + 0.8 + 0.64 + 0.512 + 0.4096
    assert t_spec == pytest.approx(t_plain * (1 + 4 * 0.05) / length, rel=0.01)
    assert tokens == 200 and drafted == pytest.approx(200 * 4 / length, abs=2)
    assert accepted == pytest.approx(200 * (length - 1) / length, abs=2)
    # A full batch does not speculate; the drafter still runs once per step.
    t_plain, _ = await _generate(plain, 16)
    t_spec, out = await _generate(spec, 16)
    assert t_spec == pytest.approx(t_plain * 1.05, rel=0.01) and all(d == 0 for _, d, _ in out)
    assert spec.speculation.status().mean_acceptance_length == pytest.approx(length, rel=1e-6)
    assert plain.speculation is None and plain.describe().speculation == "off"
    for e in (plain, spec):
        await e.close()


def test_sim_stale_drafter_loses_acceptance_until_updated():
    run_virtual(_test_sim_stale_drafter_loses_acceptance_until_updated())


async def _test_sim_stale_drafter_loses_acceptance_until_updated():
    engine = SimEngine("s", _sim(spec_method="draft_model", spec_acceptance=0.8, spec_acceptance_drift=0.3,
                                 spec_schedule=[[1, 64, 3]], spec_max_k=3))
    await engine.start()
    fresh, _ = await _generate(engine, 1)
    await engine.update_weights(3, None)  # three policy versions later
    stale, _ = await _generate(engine, 1)
    await engine.speculation.update_draft_weights(1, None)
    caught_up, _ = await _generate(engine, 1)
    assert stale > fresh * 1.2 and caught_up == pytest.approx(fresh, rel=0.02)
    assert engine.speculation.draft_version == 1 and engine.speculation.status().draft_version == 1
    await engine.close()


@pytest.mark.parametrize("params, expected_k", [
    ({"spec_method": "draft_model", "spec_acceptance": 0.7, "spec_draft_cost": 0.02}, 4),  # a cheap, good drafter
    ({"spec_method": "ngram", "spec_ngram_acceptance": 0.3, "spec_ngram_draft_cost": 1.5}, 0),  # drafts cost more than they save
])
def test_tuner_loop_on_sim_engines_finds_the_profitable_depth(params, expected_k):
    run_virtual(_tuner_loop_finds(params, expected_k))


async def _tuner_loop_finds(params, expected_k):
    engine = SimEngine("s", _sim(spec_max_k=4, spec_schedule=[[1, 64, 2]], **params))
    await engine.start()
    loop = TunerLoop([engine], TunerConfig(epsilon=0.0, min_observations=1, interval_s=0.01))
    for _ in range(12):
        await _generate(engine, 1, length=40)
        await loop.tick()
    assert engine.speculation.status().buckets[0].best_k == expected_k
    await engine.close()


def test_sibling_suffix_match_proposes_the_continuation():
    sibling = np.array([1, 9, 5, 6, 7, 8, 2], dtype=np.int32)
    context = np.array([1, 9, 5, 6], dtype=np.int32)
    assert propose_from(context, [sibling, context], 3) == [7, 8, 2]
    assert propose_from(context, [sibling, context], 1) == [7]
    assert propose_from(np.array([4, 4, 3], dtype=np.int32), [sibling], 3) == []  # no match of 2+ tokens
    assert group_of("grp-1/3-a1b2c3d4") == "grp-1" and group_of("free-text-a1b2c3d4") is None


def test_homogeneity_test_separates_equal_from_different():
    rng = random.Random(0)
    weights = [1 + i for i in range(20)]
    a = rng.choices(range(20), weights, k=4000)
    b = rng.choices(range(20), weights, k=4000)
    c = rng.choices(range(20), [w if i else 40 * w for i, w in enumerate(weights)], k=4000)
    assert homogeneity_test(a, b).p_value > 1e-3
    assert homogeneity_test(a, c).p_value < 1e-6
    assert 0.02 < detectable_shift(6000, 6000, 100) < 0.05


def test_policy_mechanisms_switch_speculation_on():
    from research.policies import parse_policy

    policy = parse_policy("least-assigned+spec")
    spec, rest = mechanism_spec(policy.mechanisms)
    assert spec["method"] == "draft_model" and spec["train"] and spec["tune"] and rest == []
    assert mechanism_spec(parse_policy("spec-ngram").mechanisms)[0]["method"] == "ngram"
    siblings = mechanism_spec(parse_policy("length-aware+partial+spec-siblings").mechanisms)
    assert siblings[0]["method"] == "siblings" and siblings[0]["tune"] and siblings[1] == ["partial"]
    with pytest.raises(ValueError, match="two speculation"):
        mechanism_spec(["spec", "spec-ngram"])


def test_an_eagle_policy_needs_a_head_directory():
    """`spec-eagle` speculates with an EAGLE head: without `--spec model=DIR`
    the fleet is refused naming engine.spec.model, with one it is served."""
    from research.policies import parse_policy
    from research.targets import FleetSpec

    policy = parse_policy("length-aware+rebalance+partial+spec-eagle")
    with pytest.raises(ValueError, match="engine.spec.model: method 'eagle' needs an EAGLE head directory"):
        FleetSpec(engines=2, policy=policy, kind="vllm").engine_config()
    spec = FleetSpec(engines=2, policy=policy, kind="vllm", spec={"model": "/heads/eagle"}).engine_config().spec
    assert spec.method == "eagle" and spec.model == "/heads/eagle" and not spec.train


async def test_spec_runtime_on_sim_engines_refreshes_the_drafter_per_policy_version():
    from rollout_service.core.clock import Clock
    from rollout_service.core.rollout import RolloutCore
    from rollout_service.lifecycle.types import GroupSpec
    from rollout_service.scheduling import make_placement

    engines = [SimEngine(f"s{i}", _sim(spec_method="draft_model", spec_acceptance_drift=0.2, decode_base_s=0.0005))
               for i in range(2)]
    core = RolloutCore(engines, make_placement("least-assigned"), Clock())
    await core.start()
    runtime = SpecRuntime(core, SpecConfig.from_dict({"method": "draft_model", "train": True, "tune": True,
                                                      "trainer": {"min_new_samples": 4}}))
    await runtime.start()
    try:
        await core.update_weights(1, None)
        core.submit([GroupSpec("g", [1, 2, 3], 8, SamplingParams(max_tokens=64), metadata={"sim.target_lengths": "20"})])
        await wait_until(lambda: core.counters["samples_completed"] == 8, 30, "the group's 8 samples")
        await wait_until(lambda: runtime.status().trainer_rounds >= 1
                         and all(e.draft_version >= 1 for e in runtime.status().engines.values()),
                         30, "a drafter round pushed to every engine")
        status = runtime.status()
    finally:
        await runtime.stop()
        await core.stop()
    assert isinstance(status, SpecStatus)
    assert status.trained_on_policy_version == 1 and status.trainer_rounds == 1
    assert status.draft_version == 1 and all(e.draft_version == 1 for e in status.engines.values())
    assert all(isinstance(b, DepthBucket) for e in status.engines.values() for b in e.buckets)


async def test_service_runs_the_tuner_and_trainer_and_reports_them_in_get_status():
    """`[engine.spec]` with tune and train: the service itself runs the depth
    tuner and the online drafter, and GetStatus shows the depth per batch
    bucket with the tuner's measurements and the drafter's version."""
    import numpy as np

    from helpers import sim_config, unique
    from rollout_service.service import RolloutService
    from trainer_client import PromptGroup, RolloutClient

    spec = {"method": "draft_model", "tune": True, "train": True, "num_speculative_tokens": 3,
            "schedule": [[1, 4, 3], [5, 64, 0]], "tuner": {"interval_s": 0.05}, "trainer": {"min_new_samples": 4}}
    sim = {"decode_base_s": 0.0005, "decode_per_seq_s": 0.00002, "length_median": 60, "length_sigma": 0.3,
           "spec_acceptance_drift": 0.2}
    service = RolloutService(sim_config(num_engines=2, sim=sim, spec=spec))
    await service.start()
    try:
        async with RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id=unique("spec")) as client:
            await client.push_weights({"w": np.ones(4, dtype=np.float32)}, version=1)
            prefix = unique("tuned")
            await client.submit([PromptGroup(prompt_token_ids=[1, 2, 3], num_samples=4, max_tokens=128,
                                             group_id=f"{prefix}-{i}") for i in range(4)])
            got = 0
            async for group in client.groups():
                got += 1
                if got == 4:
                    break

            async def tuned_and_trained():
                st = await client.status()
                return st.spec.draft_version >= 1 and all(
                    e.tuner_decisions > 0 and any(b.observations for b in e.buckets) for e in st.spec.engines)

            # The tuner decides every interval, measured or not (on a loaded
            # host its first decisions can come before any): wait for both.
            await wait_until(tuned_and_trained, 30, "a measured tuner decision on each engine and a drafter round")
            st = await client.status()
    finally:
        await service.stop()
    assert st.spec.method == "draft_model" and st.spec.tune and st.spec.train
    assert st.spec.trained_on_policy_version == 1 and st.spec.draft_version >= 1
    assert len(st.spec.engines) == 2
    for eng in st.spec.engines:
        assert eng.tuner_decisions > 0 and eng.draft_tokens > 0
        assert eng.buckets[0].min_batch == 1 and all(b.num_speculative_tokens <= 3 for b in eng.buckets)
        measured = [b for b in eng.buckets if b.observations]
        assert measured and all(v > 0 for b in measured for v in b.tokens_per_s_per_seq.values())


async def test_the_online_drafter_trains_below_the_service_s_priority():
    """On a host where the drafter's training shares cores with the engines,
    generation comes first: the training process runs `nice` below the
    service (default 10); a niceness outside 0-19 is refused naming the field."""
    import os

    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from rollout_service.assets import tiny_draft_path
    from rollout_service.drafter import DrafterTrainer, TrainerConfig

    assert TrainerConfig.from_dict({}).nice == 10
    trainer = DrafterTrainer([], TrainerConfig.from_dict({"nice": 7}), str(tiny_draft_path()), lambda: 0)
    try:
        pool = trainer._ensure_pool()
        child = await asyncio.wrap_future(pool.submit(os.nice, 0))
    finally:
        await trainer.stop()
    assert child == os.nice(0) + 7
    with pytest.raises(ValueError, match="engine.spec.trainer.nice"):
        TrainerConfig.from_dict({"nice": 20})


def test_a_drafter_teacher_outside_the_known_ones_is_refused_naming_the_field():
    """`[engine.spec.trainer] teacher` is "samples" or "policy"; anything else
    (or a policy teacher without the policy's model) is refused at start-up
    with the field and the valid values in the message."""
    from rollout_service.assets import tiny_draft_path
    from rollout_service.drafter import DrafterTrainer, TrainerConfig

    assert TrainerConfig.from_dict({}).teacher == "samples"
    with pytest.raises(ValueError, match=r"engine.spec.trainer.teacher: must be one of samples, policy, got 'logits'"):
        TrainerConfig.from_dict({"teacher": "logits"})
    with pytest.raises(ValueError, match="engine.spec.trainer.distill_top_k"):
        TrainerConfig.from_dict({"teacher": "policy", "distill_top_k": 0})
    with pytest.raises(ValueError, match="needs the policy's model directory"):
        DrafterTrainer([], TrainerConfig.from_dict({"teacher": "policy"}), str(tiny_draft_path()), lambda: 0)
