"""Collective weight pushes into real vLLM CPU engines (the gloo backend of
vLLM's weight-transfer API), on the bundled tiny model: the trainer sends
each byte once over a gloo group whose other ranks are the engines' workers
and the service's stager."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from trainer_client import PromptGroup  # noqa: E402

from helpers import (PROMPTS, bundled_weights, collect, connect, max_logprob_gap, perturbed, unique,  # noqa: E402
                     vllm_model, wait_until)

MODEL = vllm_model()
TIMEOUT_S = 15.0  # the group's bound on every wait, kept short for the failure cases


@pytest.fixture
async def client(vllm_service):
    async with connect(vllm_service, "coll") as c:
        yield c


async def _push(client, weights, version, **kw):
    kw.setdefault("timeout_s", TIMEOUT_S)
    kw.setdefault("chunk_mb", 4.0)
    return await client.push_weights_collective(weights, version, **kw)


async def _sample_gap(client, weights, version) -> float:
    """Sample at temperature 1 and compare every logprob with transformers'
    recomputation on `weights` (nats); every token must carry `version`."""
    prefix = unique("lp")
    await client.submit([PromptGroup(prompt_token_ids=p, num_samples=2, max_tokens=32, temperature=1.0,
                                     group_id=f"{prefix}-{i}") for i, p in enumerate(PROMPTS)])
    samples = await collect(client, prefix, 2 * len(PROMPTS), timeout=180)
    assert all(s.min_version == s.max_version == version for s in samples)
    return max_logprob_gap(samples, MODEL, weights)


def _payload(weights) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


async def test_collective_push_serves_the_pushed_weights(vllm_service, client):
    version = (await client.status()).policy_version + 1
    w = perturbed(bundled_weights())
    reply = await _push(client, w, version)
    assert reply.applied_version == version
    assert reply.bytes_received == _payload(w)  # sent once for 2 engines and the stager (chain)
    status = await client.status()
    assert status.policy_version == version and all(e.policy_version == version for e in status.engines)
    assert await _sample_gap(client, w, version) < 1e-3
    # The staged copy (for engines that restart) holds the pushed weights.
    from safetensors.torch import load_file

    staged = load_file(vllm_service.core.weight_sync.last.path)
    assert all(torch.equal(staged[k], w[k]) for k in w)


async def test_push_mid_rollout_loses_and_duplicates_nothing(vllm_service, client):
    start = (await client.status()).policy_version
    prefix = unique("mid")
    await client.submit([PromptGroup(prompt_token_ids=PROMPTS[i % 4], num_samples=2, max_tokens=120, temperature=1.0,
                                     group_id=f"{prefix}-{i}") for i in range(6)])
    core = vllm_service.core
    deadline = time.time() + 60
    while not any(len(r.token_ids) > 4 for r, _ in core.running.values()):
        assert time.time() < deadline
        await asyncio.sleep(0.05)
    await _push(client, bundled_weights(), start + 1)
    samples = await collect(client, prefix, 12, timeout=240)
    assert len({s.sample_id for s in samples}) == 12
    assert all(s.finish_reason in ("stop", "length") for s in samples)
    assert any(s.min_version == start and s.max_version == start + 1 for s in samples)  # spans the push
    for s in samples:
        versions = s.token_versions()
        assert len(versions) == len(s.response_token_ids) == len(s.logprobs)
        assert versions == sorted(versions)


async def test_manifest_mismatch_is_refused_naming_the_tensor(client):
    before = (await client.status()).policy_version
    w = bundled_weights()
    name = "model.layers.0.mlp.down_proj.weight"
    bad_shape = dict(w, **{name: w[name][:, :-1].contiguous()})
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _push(client, bad_shape, before + 1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name in err.value.details()
    bad_name = dict(w, **{"model.layers.0.mlp.nonsense.weight": torch.zeros(2)})
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _push(client, bad_name, before + 1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nonsense" in err.value.details()
    bad_dtype = dict(w, **{name: w[name].to(torch.int32)})
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _push(client, bad_dtype, before + 1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name in err.value.details()
    assert (await client.status()).policy_version == before


class _Stalling:
    """A state dict whose iteration stalls (a trainer that hangs mid-send)
    after `after` tensors, until released (or twice the group's timeout)."""

    def __init__(self, weights, after: int) -> None:
        self.weights, self.after = weights, after
        import threading

        self.release = threading.Event()
        self.stalled = threading.Event()  # set when the send reaches the stall

        self.stall_at = list(weights)[after]

    def items(self):
        return self.weights.items()

    def keys(self):
        return self.weights.keys()

    def __getitem__(self, name):
        if name == self.stall_at:
            self.stalled.set()
            self.release.wait(TIMEOUT_S * 2)
        return self.weights[name]


async def test_trainer_stalling_mid_transfer_leaves_the_previous_version(vllm_service, client):
    before = (await client.status()).policy_version
    w = bundled_weights()
    stall = _Stalling(perturbed(w), after=len(w) // 2)
    original = [s for s in await _greedy_tokens(client)]
    t0 = time.monotonic()
    push = asyncio.ensure_future(_push(client, stall, before + 1))
    # A second push while this one applies is refused, clearly.
    await wait_until(stall.stalled.is_set, 60, "the trainer to stall half-way through its weights")
    async with connect(vllm_service, "coll2") as other:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _push(other, w, before + 2)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "being applied" in err.value.details()
    with pytest.raises(Exception):
        await push
    stall.release.set()
    assert time.monotonic() - t0 < TIMEOUT_S * 4  # bounded by the group's timeout
    status = await client.status()
    assert status.policy_version == before and all(e.state == "ready" for e in status.engines)
    assert await _greedy_tokens(client) == original  # the previous weights, whole
    # And the next push forms the group again and applies.
    reply = await _push(client, w, before + 1)
    assert reply.applied_version == before + 1


@pytest.mark.parametrize("receive", ["staged", "direct"])
async def test_generation_goes_on_while_a_staged_collective_push_is_received(vllm_service, client, receive):
    """A trainer that sends slowly (it stalls half-way for a few seconds):
    with `collective_receive = "staged"` (the default) the engines go on
    generating with the serving version while they receive, and pause only
    to load the weights; `"direct"` loads as the bytes arrive and so stops
    generation for the whole transfer."""
    core = vllm_service.core
    for engine in core.engines.values():
        engine.collective_receive = receive
    try:
        before = (await client.status()).policy_version
        w = bundled_weights()
        stall = _Stalling(perturbed(w), after=len(w) // 2)
        prefix = unique(f"gen-{receive}")
        n = 32
        await client.submit([PromptGroup(prompt_token_ids=PROMPTS[i % 4], num_samples=2, max_tokens=200,
                                         temperature=1.0, group_id=f"{prefix}-{i}") for i in range(n)])
        deadline = time.time() + 60
        while len(core.running) < 8:
            assert time.time() < deadline, "the groups did not start"
            await asyncio.sleep(0.05)
        push = asyncio.ensure_future(_push(client, stall, before + 1))
        deadline = time.monotonic() + 60
        while not stall.stalled.is_set():  # half the tensors sent; the trainer stalls
            assert time.monotonic() < deadline, "the trainer never reached the middle of its weights"
            await asyncio.sleep(0.05)
        # The measurement: tokens generated over 2 s while the trainer stalls
        # (after 0.5 s, so that a step that ran as the push began is not counted).
        await asyncio.sleep(0.5)
        tokens0, running0 = core.counters["tokens_generated"], len(core.running)
        await asyncio.sleep(2.0)
        generated = core.counters["tokens_generated"] - tokens0
        assert not push.done() and (await client.status()).policy_version == before
        stall.release.set()
        assert (await push).applied_version == before + 1
        samples = await collect(client, prefix, 2 * n, timeout=300)
        assert len({s.sample_id for s in samples}) == 2 * n
        assert running0 > 0
        if receive == "staged":
            assert generated > 20, f"{generated} tokens generated while the push was received"
        else:
            assert generated == 0, f"{generated} tokens generated while a direct receive held the engines"
    finally:
        for engine in core.engines.values():
            engine.collective_receive = "staged"


async def _greedy_tokens(client) -> list[list[int]]:
    prefix = unique("g")
    await client.submit([PromptGroup(prompt_token_ids=p, num_samples=1, max_tokens=16, temperature=0.0,
                                     group_id=f"{prefix}-{i}") for i, p in enumerate(PROMPTS)])
    got = {s.group_id: s.response_token_ids for s in await collect(client, prefix, len(PROMPTS), timeout=120)}
    return [got[f"{prefix}-{i}"] for i in range(len(PROMPTS))]


async def test_engine_restarted_after_a_collective_push_comes_back_at_its_version(vllm_service, client):
    core = vllm_service.core
    version = (await client.status()).policy_version + 1
    w = perturbed(bundled_weights())
    await _push(client, w, version)
    victim = core.engines["vllm-1"]
    restarts = victim.restarts
    os.kill(victim.engine_core_pid, signal.SIGKILL)
    deadline = time.time() + 240
    while not (victim.restarts == restarts + 1 and victim.load().state == "ready" and not core.is_restarting("vllm-1")):
        assert time.time() < deadline, "the killed engine did not come back"
        await asyncio.sleep(0.5)
    assert victim.load().policy_version == version
    assert await _sample_gap(client, w, version) < 1e-3  # both engines serve the pushed weights
    # The group lost a member: the next push forms it again by itself.
    reply = await _push(client, bundled_weights(), version + 1)
    assert reply.applied_version == version + 1


async def test_a_failed_push_with_no_copy_to_restore_serves_the_model_weights_tagged_version_0(vllm_service, client):
    """As on GPUs: no stager rank keeps a copy of a collective push, and an
    engine that loads it as it arrives (`direct`, as NCCL engines do)
    cannot go back to the serving version when a later push fails half-way:
    it restarts on the model directory's weights and tags what it samples
    version 0, never the serving version's tag on other weights. Only
    vllm-1 loads directly (one restart); vllm-0 receives staged, drops what
    it received and keeps serving."""
    core = vllm_service.core
    core.collective.stage = False
    victim = core.engines["vllm-1"]
    victim.collective_receive = "direct"
    try:
        version = (await client.status()).policy_version + 1
        w = perturbed(bundled_weights())
        await _push(client, w, version)
        restarts = {e.engine_id: e.restarts for e in core.engines.values()}
        stall = _Stalling(perturbed(w, seed=1), after=len(w) // 2)
        push = asyncio.ensure_future(_push(client, stall, version + 1))
        await wait_until(stall.stalled.is_set, 60, "the trainer to stall half-way through its weights")
        with pytest.raises(Exception):
            await push
        stall.release.set()
        await wait_until(lambda: victim.restarts == restarts["vllm-1"] + 1 and victim.load().state == "ready"
                         and not core.is_restarting("vllm-1"), 240, "vllm-1 to restart")
        status = await client.status()
        assert status.policy_version == version  # the service's version stays...
        # ...and each engine says what it serves.
        assert {e.engine_id: e.policy_version for e in status.engines} == {"vllm-0": version, "vllm-1": 0}
        assert core.engines["vllm-0"].restarts == restarts["vllm-0"]
        prefix = unique("tag")
        await client.submit([PromptGroup(prompt_token_ids=PROMPTS[i % 4], num_samples=2, max_tokens=32,
                                         temperature=1.0, group_id=f"{prefix}-{i}") for i in range(8)])
        samples = await collect(client, prefix, 16, timeout=180)
        on = {eid: [s for s in samples if s.engines == [eid]] for eid in ("vllm-0", "vllm-1")}
        assert on["vllm-1"] and all(s.min_version == s.max_version == 0 for s in on["vllm-1"])
        assert all(s.min_version == s.max_version == version for s in on["vllm-0"])
        assert max_logprob_gap(on["vllm-1"], MODEL, bundled_weights()) < 1e-3  # the model directory's weights
        assert max_logprob_gap(on["vllm-0"], MODEL, w) < 1e-3
    finally:
        core.collective.stage = True
        victim.collective_receive = "staged"
