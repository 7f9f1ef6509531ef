"""The engine fleet as Ray actors on a local Ray cluster: a head and one
worker node, each a separate set of Ray processes on this machine.

The cluster is conftest's `ray_cluster`, shared by the module. The
simulated-engine tests start services of their own (quick); the vLLM tests
share conftest's `ray_vllm_service`, 2 real vLLM CPU engines as actors, one
per node, started after the simulated tests are done with the cluster's CPUs."""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from rollout_service.service import RolloutService  # noqa: E402
from trainer_client import PromptGroup, RolloutClient  # noqa: E402

from helpers import (FAST_SIM, add_ray_node, bundled_weights, check_versions, collect, perturbed,  # noqa: E402
                     ray_config, rollout_through_a_kill, unique, vllm_model, wait_until)


def test_ray_flag_and_toml_table_select_ray_placement(tmp_path):
    import argparse

    from rollout_service.cli import _add_service_flags, _config
    from rollout_service.config import load_config

    parser = argparse.ArgumentParser()
    _add_service_flags(parser)
    cfg = _config(parser.parse_args(["--ray", "--num-engines", "8"]))
    assert (cfg.engine.placement_backend, cfg.engine.ray.address, cfg.engine.num_engines) == ("ray", "auto", 8)
    cfg = _config(parser.parse_args(["--ray", "10.0.0.1:6379", "--set", "engine.ray.gpus_per_engine=2"]))
    assert (cfg.engine.ray.address, cfg.engine.ray.gpus_per_engine) == ("10.0.0.1:6379", 2.0)
    assert _config(parser.parse_args([])).engine.placement_backend == "auto"
    (tmp_path / "c.toml").write_text('[engine]\nplacement_backend = "ray"\n[engine.ray]\nstrategy = "PACK"\nengines_per_actor = 4\n')
    cfg = load_config(tmp_path / "c.toml")
    assert (cfg.engine.placement_backend, cfg.engine.ray.strategy, cfg.engine.ray.engines_per_actor) == ("ray", "PACK", 4)


async def test_sim_actors_serve_push_weights_and_survive_a_killed_actor(ray_cluster):
    # Steps of 20 ms: the shortest response lasts over a second, so that a
    # request on sim-1 is seen mid-flight even when a loaded host coalesces
    # the actor's event batches (at 4 ms a whole response could arrive in one).
    service = RolloutService(ray_config(ray_cluster, kind="sim", num_engines=4, cpus=0.5,
                                        sim=dict(FAST_SIM, decode_base_s=0.02)))
    await service.start()
    core = service.core
    try:
        engines = list(core.engines.values())
        assert all(e.placement == "ray" and e.actor_pid != os.getpid() for e in engines)
        assert len({e.node_id for e in engines}) >= 2  # spread over the nodes
        async with RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id=unique("ray")) as client:
            victim = core.engines["sim-1"]
            pid, restarts = victim.actor_pid, victim.restarts
            # Mid-rollout, with an engine down: the others apply the push now,
            # the recreated actor when it is back.
            samples = await rollout_through_a_kill(client, core, "sim-1")
            after = unique("after")
            await client.submit([PromptGroup(prompt_token_ids=[1, 7, i], num_samples=4, max_tokens=50, group_id=f"{after}-{i}")
                                 for i in range(8)])
            later = await collect(client, after, 32, timeout=60)
            status = await client.status()
        assert len({s.sample_id for s in samples}) == 128 and len(samples) == 128
        assert all(s.finish_reason in ("stop", "length") for s in samples)
        for s in samples:
            check_versions(s, {0, 1})
        assert all(s.min_version == s.max_version == 1 for s in later)
        # The killed actor's requests went on elsewhere from their partial responses.
        resumed = [s for s in samples if "sim-1" in s.engines[:-1]]
        assert resumed and status.counters["tokens_reprefilled"] > 0
        assert status.counters["ray_actor_deaths"] >= 1 and status.counters["engine_restarts"] >= 1
        # A new actor, on the current weights.
        await wait_until(lambda: victim.restarts == restarts + 1 and victim.load().state == "ready"
                         and not core.is_restarting("sim-1"), 60, "the actor to come back")
        assert victim.actor_pid not in (None, pid)
        assert victim.load().policy_version == 1
    finally:
        await service.stop()


async def test_speculation_of_an_engine_in_an_actor_is_declared_and_mirrored(ray_cluster):
    """`engine.speculation` of a Ray engine reaches the actor's engine (depth
    schedule, draft weights) and mirrors its statistics and draft version;
    `describe()` says where and what the engine is."""
    from rollout_service.engines.weights import StagedWeights, WeightTensor

    spec = {"method": "draft_model", "num_speculative_tokens": 3, "schedule": [[1, 64, 3]]}
    service = RolloutService(ray_config(ray_cluster, kind="sim", num_engines=2, cpus=0.5, spec=spec,
                                        sim=dict(FAST_SIM, decode_base_s=0.002)))
    await service.start()
    core = service.core
    try:
        engine = core.engines["sim-0"]
        assert engine.speculation is not None and engine.speculation.has_draft_model
        d = engine.describe()
        assert (d.placement, d.kind, d.speculation, d.kv_capacity_tokens) == ("ray", "sim", "draft_model",
                                                                               engine.load().kv_capacity_tokens)
        await engine.speculation.set_schedule([[1, 64, 2]])
        weights = StagedWeights([WeightTensor("w", "float32", (4,), memoryview(np.ones(4, np.float32)).cast("B"))])
        await engine.speculation.update_draft_weights(1, weights)
        assert engine.speculation.draft_version == 1
        async with RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id=unique("rspec")) as client:
            prefix = unique("rs")
            await client.submit([PromptGroup(prompt_token_ids=[1, 5, i], num_samples=2, max_tokens=100,
                                             group_id=f"{prefix}-{i}", metadata={"sim.target_lengths": "80"})
                                 for i in range(4)])
            await collect(client, prefix, 8, timeout=60)
        await wait_until(lambda: engine.speculation.monitor.draft_tokens > 0, 10, "the actor's speculation statistics")
        status = engine.speculation.status()
        assert status.schedule == [(1, 64, 2)] and status.draft_version == 1 and status.max_k == 3
        assert 0 < status.accepted_tokens < status.draft_tokens
    finally:
        await service.stop()


async def test_sim_actors_report_their_devices_and_receive_a_collective_push(ray_cluster):
    """Engines in actors say where their ranks compute through the actor
    (the collective group's device check: CPU ranks, nothing to refuse) and
    receive a gloo push there."""
    import socket

    import torch

    service = RolloutService(ray_config(ray_cluster, kind="sim", num_engines=2, cpus=0.5, sim=dict(FAST_SIM)))
    await service.start()
    try:
        (device,) = await service.core.engines["sim-0"].transfer_devices()
        assert (device.device, device.key, device.host) == ("cpu", None, socket.gethostname())
        async with RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id=unique("rcoll")) as client:
            reply = await client.push_weights_collective({"w": torch.ones(64, 64)}, 1, backend="gloo", timeout_s=30)
        assert reply.applied_version == 1
        assert all(e.load().policy_version == 1 for e in service.core.engines.values())
    finally:
        await service.stop()


async def test_a_dead_node_s_engines_come_back_when_a_node_joins(ray_cluster):
    """The worker node dies: its engines' requests finish on the head's
    engines; the engines stay down (no free resources) until a new node
    joins, then come back on it."""
    service = RolloutService(ray_config(ray_cluster, kind="sim", num_engines=4, cpus=0.5,
                                        sim=dict(FAST_SIM, decode_base_s=0.01)))
    await service.start()
    core = service.core
    try:
        on_worker = [e for e in core.engines.values() if e.node_id == ray_cluster.worker.node_id]
        assert on_worker
        async with RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id=unique("node")) as client:
            prefix = unique("n")
            await client.submit([PromptGroup(prompt_token_ids=[1, 9, i], num_samples=4, max_tokens=1000, group_id=f"{prefix}-{i}",
                                             metadata={"sim.target_lengths": "200,900"}) for i in range(16)])
            await wait_until(lambda: any(r.engine_id == on_worker[0].engine_id and r.token_ids for r, _ in core.running.values()),
                             30, "tokens on the worker node")
            ray_cluster.remove_node(ray_cluster.worker, allow_graceful=False)
            await wait_until(lambda: all(e.load().state != "ready" for e in on_worker), 60, "the node's death to be seen")
            samples = await collect(client, prefix, 64, timeout=180)
            assert all(e.load().state != "ready" for e in on_worker)  # no resources: still down
            dead_node = ray_cluster.worker.node_id
            ray_cluster.worker = add_ray_node(ray_cluster)
            await wait_until(lambda: all(e.load().state == "ready" and not core.is_restarting(e.engine_id) for e in on_worker),
                             90, "the engines to come back on the new node")
            assert dead_node not in {e.node_id for e in on_worker}
            again = unique("again")
            await client.submit([PromptGroup(prompt_token_ids=[1, 9, i], num_samples=4, max_tokens=40, group_id=f"{again}-{i}")
                                 for i in range(8)])
            later = await collect(client, again, 32, timeout=60)
        assert len({s.sample_id for s in samples}) == 64
        dead = {e.engine_id for e in on_worker}
        assert any(dead & set(s.engines[:-1]) for s in samples)  # resumed elsewhere from partials
        assert {e for s in later for e in s.engines} >= dead
    finally:
        await service.stop()


# -- real vLLM engines as Ray actors ---------------------------------------------------------


def _logprob_gaps(samples, weights_by_version) -> float:
    """Largest gap (nats) between a returned logprob and transformers'
    recomputation with the weights its version tag names."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(vllm_model(), dtype=torch.float32).eval()
    worst = 0.0
    for version, weights in weights_by_version.items():
        model.load_state_dict(weights, strict=False)
        model.tie_weights()
        for s in samples:
            mask = torch.tensor([v == version for v, _, n in s.versions for _ in range(n)])
            if not mask.any():
                continue
            ids = torch.tensor([s.prompt_token_ids + s.response_token_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(s.prompt_token_ids) - 1: -1]
            ref = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(s.response_token_ids)[:, None])[:, 0]
            gap = (ref - torch.tensor(s.logprobs, dtype=torch.float64)).abs()[mask]
            worst = max(worst, float(gap.max()))
    return worst


async def test_vllm_actors_on_two_nodes_push_weights_and_recover_a_killed_actor(ray_vllm_service):
    original = bundled_weights()
    new = perturbed(original, seed=1)
    service = ray_vllm_service  # carry-over `pause-resume`: every token's context is computed by its tag's weights
    core = service.core
    engines = list(core.engines.values())
    assert len({e.node_id for e in engines}) == 2  # one engine on each of two nodes
    async with RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id=unique("vray")) as client:
        v0 = (await client.status()).policy_version
        prefix = unique("v")
        prompts = [[1, 40, 41, 42, 14], [1, 55, 20, 33, 14], [1, 60, 61, 12, 30], [1, 25, 26, 27, 28]]
        tokens0 = core.counters["tokens_generated"]
        await client.submit([PromptGroup(prompt_token_ids=prompts[i % 4], num_samples=4, max_tokens=300,
                                         temperature=1.0, group_id=f"{prefix}-{i}") for i in range(16)])
        await wait_until(lambda: core.counters["tokens_generated"] > tokens0 + 200, 60, "tokens")
        reply = await client.push_weights(new, version=v0 + 1)  # mid-rollout
        assert reply.applied_version == v0 + 1
        victim = core.engines["vllm-0"]
        await wait_until(lambda: any(r.engine_id == "vllm-0" and len(r.token_ids) - r.segment_start > 5
                                     for r, _ in core.running.values()), 60, "tokens on vllm-0 after the push")
        pid, restarts = victim.actor_pid, victim.restarts
        os.kill(pid, signal.SIGKILL)
        samples = await collect(client, prefix, 64, timeout=300)
        await wait_until(lambda: victim.restarts == restarts + 1 and victim.load().state == "ready"
                         and not core.is_restarting("vllm-0"), 180, "the killed actor to come back")
        assert victim.actor_pid not in (None, pid)
        assert victim.load().policy_version == v0 + 1  # brought to the current weights
        # The new actor serves, on the pushed version.
        after = unique("after")
        await client.submit([PromptGroup(prompt_token_ids=prompts[i % 4], num_samples=2, max_tokens=30,
                                         temperature=1.0, group_id=f"{after}-{i}") for i in range(8)])
        later = await collect(client, after, 16, timeout=120)
        status = await client.status()
    assert len(samples) == 64 and len({s.sample_id for s in samples}) == 64
    assert all(s.finish_reason in ("stop", "length") for s in samples)
    for s in samples:
        check_versions(s, {v0, v0 + 1})
    assert any(s.min_version == v0 for s in samples) and any(s.max_version == v0 + 1 for s in samples)
    assert any("vllm-0" in s.engines[:-1] for s in samples)  # continued elsewhere from a partial
    assert status.counters["ray_actor_deaths"] >= 1 and status.counters["tokens_reprefilled"] > 0
    assert all(s.min_version == s.max_version == v0 + 1 for s in later)
    assert any(s.engines == ["vllm-0"] for s in later)
    # Each token's tag names the weights that sampled it.
    assert _logprob_gaps(samples + later, {v0: original, v0 + 1: new}) < 2e-3


async def test_vllm_actors_join_a_collective_push_and_a_restarted_actor_comes_back_at_its_version(ray_vllm_service):
    """Engines behind Ray join the trainer's transfer group like local ones:
    the bytes go from the trainer to the actors' vLLM workers (sent once),
    the version is live on both, the samples are the pushed weights'; an
    actor killed afterwards comes back serving that version."""
    new = perturbed(bundled_weights(), seed=2)
    service = ray_vllm_service
    core = service.core
    async with RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id=unique("vrayc")) as client:
        version = (await client.status()).policy_version + 1
        reply = await client.push_weights_collective(new, version=version, timeout_s=60, chunk_mb=4.0)
        assert reply.applied_version == version
        assert reply.bytes_received == sum(t.numel() * t.element_size() for t in new.values())
        status = await client.status()
        assert status.policy_version == version and all(e.policy_version == version for e in status.engines)
        prompts = [[1, 40, 41, 42, 14], [1, 55, 20, 33, 14], [1, 60, 61, 12, 30], [1, 25, 26, 27, 28]]
        prefix = unique("vc")
        await client.submit([PromptGroup(prompt_token_ids=p, num_samples=4, max_tokens=24, temperature=1.0,
                                         group_id=f"{prefix}-{i}") for i, p in enumerate(prompts)])
        samples = await collect(client, prefix, 16, timeout=180)
        victim = core.engines["vllm-1"]
        pid, restarts = victim.actor_pid, victim.restarts
        os.kill(pid, signal.SIGKILL)
        await wait_until(lambda: victim.restarts == restarts + 1 and victim.load().state == "ready"
                         and not core.is_restarting("vllm-1"), 180, "the killed actor to come back")
        assert victim.load().policy_version == version
        after = unique("vc-after")
        await client.submit([PromptGroup(prompt_token_ids=prompts[i % 4], num_samples=2, max_tokens=24,
                                         temperature=1.0, group_id=f"{after}-{i}") for i in range(8)])
        later = await collect(client, after, 16, timeout=180)
    assert {e for s in samples for e in s.engines} == {"vllm-0", "vllm-1"}
    assert any("vllm-1" in s.engines for s in later)
    assert all(s.min_version == s.max_version == version for s in samples + later)
    assert _logprob_gaps(samples + later, {version: new}) < 2e-3
