"""Engines in host processes of this machine (`engine.placement_backend =
"process"`): the same engines as in the server's process, their deltas sent
to the server in batches; real services on loopback ports, the real client,
simulated engines in real host processes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from rollout_service.config import EngineConfig, ProcessConfig, ServiceConfig
from trainer_client import PromptGroup, RolloutClient

from helpers import (FAST_SIM, check_versions, collect, free_port, rollout_through_a_kill, running, unique, wait_until,
                     wait_until_sync)


def process_config(num_engines: int, per_host: int, **engine) -> ServiceConfig:
    engine.setdefault("sim", dict(FAST_SIM))
    return ServiceConfig(grpc_port=0, http_port=0, engine=EngineConfig(
        kind="sim", num_engines=num_engines, placement_backend="process",
        process=ProcessConfig(engines_per_host=per_host, heartbeat_s=0.1), **engine))


def test_the_backend_is_chosen_by_flag_or_table_and_a_wrong_one_is_named(tmp_path):
    from rollout_service.config import load_config
    from rollout_service.factory import fleet_plan

    (tmp_path / "c.toml").write_text('[engine]\nplacement_backend = "process"\n[engine.process]\nengines_per_host = 4\n')
    cfg = load_config(tmp_path / "c.toml", ["engine.num_engines=8"])
    assert (cfg.engine.placement_backend, cfg.engine.process.engines_per_host) == ("process", 4)
    cfg = load_config(None, ["engine.placement_backend=\"nowhere\""])
    with pytest.raises(ValueError, match="engine.placement_backend must be one of auto, local, process, ray, got 'nowhere'"):
        fleet_plan(cfg.engine, None)
    from rollout_service.engines.proc_fleet import make_process_engines

    with pytest.raises(ValueError, match="engine.process.nice must be 0-19, got 25"):
        make_process_engines([], nice=25)


async def test_a_load_snapshot_older_than_a_weight_updates_reply_does_not_put_the_old_version_back():
    """Under Ray an event batch read before a weight update can reach the
    server after the update's reply: the engine keeps the newer snapshot, so
    GetStatus does not show the old version on an engine that serves the new."""
    from rollout_service.engines.ray_host import EventBatch

    async with running(process_config(1, 1)) as service:
        engine = service.core.engines["sim-0"]
        await wait_until(lambda: engine.load().state == "ready", 30, "the engine to start")
        stale = (*engine._stamp, engine.load())  # a batch's snapshot, still on its way
        assert stale[2].policy_version == 0
        async with RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id=unique("stale")) as client:
            assert (await client.push_weights({"w": np.ones((8, 8), np.float32)}, version=1)).applied_version == 1
            engine.host.dispatch(EventBatch({"sim-0": stale}))
            status = await client.status()
        assert engine.load().policy_version == 1
        assert status.policy_version == 1 and [e.policy_version for e in status.engines] == [1]


async def test_engines_in_hosts_serve_push_weights_and_survive_a_killed_host():
    """Two host processes of two engines each: every sample once, each token
    tagged with the version that sampled it; a SIGKILLed host's requests go
    on elsewhere from their partial responses, and its engines come back in
    a new host on the current weights."""
    cfg = process_config(4, 2, sim=dict(FAST_SIM, decode_base_s=0.01, max_run_steps=1))
    async with running(cfg) as service:
        core = service.core
        engines = list(core.engines.values())
        pids = {e.host_pid for e in engines}
        assert all(e.placement == "process" for e in engines) and len(pids) == 2 and os.getpid() not in pids
        assert engines[0].host_pid == engines[1].host_pid != engines[2].host_pid
        async with RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id=unique("proc")) as client:
            victim = core.engines["sim-1"]
            pid, restarts = victim.host_pid, victim.restarts
            samples = await rollout_through_a_kill(client, core, "sim-1")
            await wait_until(lambda: victim.restarts == restarts + 1 and victim.load().state == "ready"
                             and not core.is_restarting("sim-1"), 60, "the host to come back")
            assert victim.host_pid not in (None, pid) and victim.load().policy_version == 1
            after = unique("after")
            await client.submit([PromptGroup(prompt_token_ids=[1, 7, i], num_samples=4, max_tokens=50,
                                             group_id=f"{after}-{i}") for i in range(8)])
            later = await collect(client, after, 32, timeout=60)
            status = await client.status()
        stopping = time.monotonic()
    # The service stops promptly: each host ends once all of its engines have closed.
    assert time.monotonic() - stopping < 10
    assert len({s.sample_id for s in samples}) == 128 and len(samples) == 128
    assert all(s.finish_reason in ("stop", "length") for s in samples)
    for s in samples:
        check_versions(s, {0, 1})
    assert any(s.max_version == 1 for s in samples) and all(s.min_version == s.max_version == 1 for s in later)
    resumed = [s for s in samples if "sim-1" in s.engines[:-1] or "sim-0" in s.engines[:-1]]
    assert resumed and status.counters["tokens_reprefilled"] > 0
    assert status.counters["host_deaths"] >= 1 and status.counters["engine_restarts"] >= 1
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


async def test_a_host_s_speculation_and_its_draft_weights_are_mirrored():
    """`engine.speculation` of an engine in a host reaches the host's engine
    (depth schedule, draft weights through the staged file) and mirrors its
    statistics and draft version."""
    from rollout_service.engines.weights import StagedWeights, WeightTensor

    spec = {"method": "draft_model", "num_speculative_tokens": 3, "schedule": [[1, 64, 3]]}
    cfg = process_config(2, 2, spec=spec, sim=dict(FAST_SIM, decode_base_s=0.002))
    cfg.engine.process.nice = 5
    async with running(cfg) as service:
        engine = service.core.engines["sim-0"]
        assert psutil.Process(engine.host_pid).nice() == psutil.Process().nice() + 5  # below the server
        d = engine.describe()
        assert (d.placement, d.kind, d.speculation) == ("process", "sim", "draft_model")
        await engine.speculation.set_schedule([[1, 64, 2]])
        weights = StagedWeights([WeightTensor("w", "float32", (4,), memoryview(np.ones(4, np.float32)).cast("B"))])
        await engine.speculation.update_draft_weights(1, weights)
        async with RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id=unique("pspec")) as client:
            prefix = unique("ps")
            await client.submit([PromptGroup(prompt_token_ids=[1, 5, i], num_samples=2, max_tokens=100,
                                             group_id=f"{prefix}-{i}", metadata={"sim.target_lengths": "80"})
                                 for i in range(4)])
            samples = await collect(client, prefix, 8, timeout=60)
        assert all(len(s.response_token_ids) == 80 for s in samples)
        await wait_until(lambda: engine.speculation.monitor.draft_tokens > 0, 10, "the host's speculation statistics")
        status = engine.speculation.status()
        assert status.schedule == [(1, 64, 2)] and status.draft_version == 1
        assert 0 < status.accepted_tokens < status.draft_tokens


async def test_the_same_tokens_as_engines_in_the_server_s_process():
    """Hosting changes where an engine runs, not what it samples: the same
    groups give the same tokens, logprobs and version tags in both places."""
    groups = [dict(prompt_token_ids=[1, 9, i], num_samples=4, max_tokens=200, seed=i,
                   metadata={"sim.target_lengths": "17,90,150,3"}) for i in range(6)]

    prefix = unique("s")  # the same group ids in both services: a simulated token depends on its request's id

    async def run(cfg) -> dict:
        async with running(cfg) as service:
            async with RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id=unique("same")) as client:
                await client.submit([PromptGroup(group_id=f"{prefix}-{i}", **g) for i, g in enumerate(groups)])
                got = await collect(client, prefix, 24, timeout=60)
        return {(s.group_id.rsplit("-", 1)[1], s.index): (s.response_token_ids, s.logprobs, s.versions) for s in got}

    sim = dict(FAST_SIM, decode_base_s=0.002, max_run_steps=1)  # a delta per token: the hosts' token runs
    local = await run(ServiceConfig(grpc_port=0, http_port=0, engine=EngineConfig(kind="sim", num_engines=1, sim=sim)))
    hosted = await run(process_config(1, 1, sim=sim))
    assert len(hosted) == 24 and hosted == local
    assert sorted(len(t) for t, _, _ in local.values())[:4] == [3] * 4


async def test_a_host_that_cannot_build_its_engines_fails_their_start_naming_it():
    """A host whose engine cannot be built exits; starting its engine fails
    at once with an EngineError naming the host and its exit (the core's
    health watch would try again), not after the start timeout."""
    import functools

    from rollout_service.engines.base import EngineError
    from rollout_service.engines.proc_fleet import ProcessFleet, ProcessHost

    host = ProcessHost(ProcessFleet(), 0, {"broken-0": functools.partial(int, "not an engine")}, heartbeat_s=0.1)
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"engine host 0 \(broken-0\) exited before it was ready \(exit code 1"):
        await host.ensure()
    assert time.monotonic() - t0 < 60 and not host.alive


def test_a_killed_server_leaves_no_host_behind(tmp_path):
    """Hosts end with the server: SIGKILL the server, and its host processes
    exit within seconds (they see their link close)."""
    port = free_port()
    cmd = [sys.executable, "-m", "rollout_service", "serve", "--engine", "sim", "--num-engines", "4",
           "--set", "engine.placement_backend=process", "--set", "engine.process.engines_per_host=2",
           "--grpc-port", str(port), "--http-port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        server = psutil.Process(proc.pid)
        wait_until_sync(lambda: len(server.children()) == 2 or proc.poll() is not None, 60, "two host processes")
        assert proc.poll() is None, proc.stderr.read()
        hosts = server.children()
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        t0 = time.monotonic()
        gone, alive = psutil.wait_procs(hosts, timeout=30)
        assert not alive, f"hosts still running {time.monotonic() - t0:.0f} s after the server's death"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


async def test_a_vllm_engine_in_a_host_serves_the_weights_pushed_to_it(own_vllm_engines):
    """A real vLLM engine (its `AsyncLLM` and output processing) in a host
    process: it serves, reports its worker's device, a push reaches it
    through the staged file, and every token's logprob is the pushed
    weights' (transformers' recomputation)."""
    from helpers import bundled_weights, max_logprob_gap, perturbed, vllm_model, PROMPTS

    new = perturbed(bundled_weights(), seed=3)
    cfg = ServiceConfig(grpc_port=0, http_port=0, engine=EngineConfig(
        kind="vllm", num_engines=1, model=vllm_model(), max_model_len=1024, max_seqs=8, placement_backend="process",
        process=ProcessConfig(engines_per_host=1)))
    async with running(cfg) as service:
        engine = service.core.engines["vllm-0"]
        assert engine.placement == "process" and engine.host_pid not in (None, os.getpid())
        # Where its worker computes is reported through the host (selftest's device check).
        [worker] = await engine.device_report()
        assert worker["device"] == "cpu" and worker["cores"] and worker["pid"] not in (os.getpid(), engine.host_pid)
        async with RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id=unique("pvllm")) as client:
            reply = await client.push_weights(new, version=1)
            assert reply.applied_version == 1
            prefix = unique("pv")
            await client.submit([PromptGroup(prompt_token_ids=p, num_samples=2, max_tokens=24, temperature=1.0,
                                             group_id=f"{prefix}-{i}") for i, p in enumerate(PROMPTS)])
            samples = await collect(client, prefix, 8, timeout=120)
    assert all(s.min_version == s.max_version == 1 and s.engines == ["vllm-0"] for s in samples)
    assert sum(len(s.response_token_ids) for s in samples) > 8 * 5
    assert max_logprob_gap(samples, vllm_model(), new) < 2e-3


def _sim_tokens(params, request_id: str, total: int) -> tuple[list[int], list[float]]:
    """A simulated engine's tokens and logprobs for a request: a hash of
    (its seed, the request id, the position), the end token last."""
    from rollout_service.engines.sim import _M64, _hash_u64, _mix64

    key, tokens, logprobs = _hash_u64(params.seed, request_id), [], []
    for pos in range(total):
        h = _mix64((key + pos) & _M64)
        t, lp = h % params.vocab_size, -((h >> 32) % 1000) / 250.0
        if pos + 1 >= total:
            t, lp = params.eos_token_id, -0.1
        elif t == params.eos_token_id:
            t = (t + 1) % params.vocab_size
        tokens.append(t)
        logprobs.append(lp)
    return tokens, logprobs


async def test_a_request_migrated_between_hosts_mid_batch_continues_exactly():
    """Migration between engines in two hosts while the source host still
    holds tokens it has not sent (50 ms batches): the abort's partial is the
    engine's own account, so a migrated sample is exactly the source engine's
    tokens up to the move and the target's after it, none lost or repeated."""
    sim = dict(FAST_SIM, decode_base_s=0.005, max_run_steps=1)
    cfg = process_config(2, 1, sim=sim)
    cfg.engine.process.batch_ms = 50.0
    async with running(cfg) as service:
        core = service.core
        params = {eid: e.template.params for eid, e in core.engines.items()}
        async with RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id=unique("mig")) as client:
            prefix = unique("m")
            await client.submit([PromptGroup(prompt_token_ids=[1, 4, i], num_samples=2, max_tokens=400,
                                             group_id=f"{prefix}-{i}", metadata={"sim.target_lengths": "300"})
                                 for i in range(4)])
            await wait_until(lambda: sum(len(r.token_ids) > 40 for r, _ in core.running.values()) >= 4,
                             30, "requests 40 tokens in")
            for req in [r for r, _ in list(core.running.values()) if len(r.token_ids) > 40][:4]:
                await core.migrate(req, "sim-1" if req.engine_id == "sim-0" else "sim-0")
            samples = await collect(client, prefix, 8, timeout=60)
    migrated = [s for s in samples if len(s.engines) == 2]
    assert len(migrated) == 4 and all(s.num_migrations == 1 for s in migrated)
    for s in samples:
        assert len(s.response_token_ids) == 300 and sum(n for _, _, n in s.versions) == 300
        source = _sim_tokens(params[s.engines[0]], s.sample_id, 300)
        # The move is where the source engine's draw stops: the token and its
        # logprob (a token alone matches the target's draw 1 time in 64).
        moved_at = next((i for i, (t, lp) in enumerate(zip(s.response_token_ids, s.logprobs))
                         if t != source[0][i] or abs(lp - source[1][i]) > 1e-5), 300)
        assert s.response_token_ids[:moved_at] == source[0][:moved_at]
        assert s.logprobs[:moved_at] == pytest.approx(source[1][:moved_at])
        if len(s.engines) == 2:
            target = _sim_tokens(params[s.engines[1]], s.sample_id, 300)
            assert 40 < moved_at < 300
            assert s.response_token_ids[moved_at:] == target[0][moved_at:]
            assert s.logprobs[moved_at:] == pytest.approx(target[1][moved_at:])
        else:
            assert moved_at == 300
