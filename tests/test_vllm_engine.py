"""Real vLLM CPU engines behind the real server, on the bundled tiny model.

One service with 2 engines is shared by the session (vLLM start-up costs
~20 s per engine on a CPU)."""
from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import time

import grpc
import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from rollout_proto import rollout_pb2 as pb  # noqa: E402
from trainer_client import PromptGroup  # noqa: E402

from helpers import PROMPTS, bundled_weights, collect, max_logprob_gap, perturbed, unique, vllm_model  # noqa: E402

MODEL = vllm_model()


async def _greedy(client, prompts=PROMPTS, max_tokens=24) -> list[tuple[list[int], int]]:
    prefix = unique("greedy")
    await client.submit([PromptGroup(prompt_token_ids=p, num_samples=1, max_tokens=max_tokens, temperature=0.0,
                                     group_id=f"{prefix}-{i}") for i, p in enumerate(prompts)])
    got = {s.group_id: s for s in await collect(client, prefix, len(prompts), timeout=120)}
    return [(got[f"{prefix}-{i}"].response_token_ids, got[f"{prefix}-{i}"].max_version) for i in range(len(prompts))]


async def _max_logprob_gap(vclient, weights) -> float:
    """Serve `weights`, sample, and compare every returned logprob with
    transformers' recomputation on the same weights (nats)."""
    version = (await vclient.status()).policy_version + 1
    await vclient.push_weights(weights, version=version)
    prefix = unique("lp")
    await vclient.submit([PromptGroup(prompt_token_ids=p, num_samples=2, max_tokens=40, temperature=1.0,
                                      group_id=f"{prefix}-{i}") for i, p in enumerate(PROMPTS)])
    samples = await collect(vclient, prefix, 2 * len(PROMPTS), timeout=120)
    assert all(s.min_version == s.max_version == version for s in samples)
    return max_logprob_gap(samples, MODEL, weights)


async def test_logprobs_match_transformers_recomputation(vclient):
    # Stated tolerance: 1e-3 nats per token (float32 on both sides, different kernels).
    assert await _max_logprob_gap(vclient, bundled_weights()) < 1e-3


async def test_pushed_tied_embedding_reaches_the_output_layer(vclient):
    """The tiny model ties lm_head to the embedding: a push that changes only
    the embedding must change the output layer too (CPU repacking)."""
    w = bundled_weights()
    g = torch.Generator().manual_seed(1)
    emb = "model.embed_tokens.weight"
    w[emb] = w[emb] + 0.3 * w[emb].std() * torch.randn(w[emb].shape, generator=g)
    assert await _max_logprob_gap(vclient, w) < 1e-3
    await vclient.push_weights(bundled_weights(), version=(await vclient.status()).policy_version + 1)


@pytest.mark.parametrize("to", ["engine", "queue"])
async def test_migrated_request_continues_from_its_prefix(vllm_service, vclient, to):
    from rollout_service.tasks import make_problem, prompt_token_ids

    core = vllm_service.core
    prompt = prompt_token_ids(make_problem("collatz", [27]))  # a long answer: 111 steps
    gid = unique("ref")
    await vclient.submit([PromptGroup(prompt_token_ids=prompt, num_samples=1, max_tokens=400, temperature=0.0, group_id=gid)])
    [ref] = await collect(vclient, gid, 1)
    assert len(ref.response_token_ids) >= 40, "the reference answer is too short to migrate half-way"
    gid = unique("mig")
    await vclient.submit([PromptGroup(prompt_token_ids=prompt, num_samples=1, max_tokens=400, temperature=0.0, group_id=gid)])
    req = core.groups[gid].requests[0]
    deadline = time.time() + 60
    while len(req.token_ids) < 8 or req.engine_id is None:
        assert time.time() < deadline and req.finish_reason is None
        await asyncio.sleep(0.002)
    source = req.engine_id
    target = next(e for e in core.engines if e != source)
    # To an engine, or back to the head of the service's queue (the tail
    # isolation's move when every other engine is full): placement restarts it.
    await core.migrate(req, target if to == "engine" else None)
    [s] = await collect(vclient, gid, 1, timeout=60)
    assert s.num_migrations == 1 and len(s.engines) == 2 and s.engines[0] == source
    if to == "engine":
        assert s.engines[1] == target
    # Greedy decoding continued from the same prefix gives the un-migrated
    # answer; each token's logprob is the one its engine computed after the
    # re-prefill, and the version tags cover both segments.
    assert s.response_token_ids == ref.response_token_ids
    assert max(abs(a - b) for a, b in zip(s.logprobs, ref.logprobs)) < 1e-3
    assert s.versions == [(ref.max_version, 0, len(s.response_token_ids))]


def _header(version, tensors, override=None):
    specs = []
    for name, t in tensors.items():
        raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        spec = pb.TensorSpec(name=name, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape),
                             byte_length=len(raw), sha256=hashlib.sha256(raw).hexdigest())
        specs.append(spec)
    for (i, key), value in (override or {}).items():
        if key == "shape":
            del specs[i].shape[:]
            specs[i].shape.extend(value)
        else:
            setattr(specs[i], key, value)
    return pb.WeightsHeader(version=version, tensors=specs)


async def _raw_push(client, header, payload: bytes):
    msgs = [pb.WeightsChunk(header=header)] + [pb.WeightsChunk(data=payload[i:i + 65536]) for i in range(0, len(payload), 65536)]
    return await client._stub.PushWeights(iter(msgs))


async def test_corrupt_weight_pushes_leave_the_old_version_serving(vclient):
    before_version = (await vclient.status()).policy_version
    before = await _greedy(vclient)
    w = bundled_weights()
    name = next(iter(w))
    one = {name: w[name]}
    raw = one[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    flipped = bytearray(raw)
    flipped[10] ^= 0xFF
    cases = [
        ("bad checksum", _header(before_version + 1, one), bytes(flipped), "sha256"),
        ("truncated", _header(before_version + 1, one), raw[: len(raw) // 2], "data"),
        ("wrong shape", _header(before_version + 1, one, {(0, "shape"): [7, 7], (0, "byte_length"): 196}), raw[:196], "shape"),
        ("unknown name", _header(before_version + 1, one, {(0, "name"): "model.no_such.weight"}), raw, "unknown tensor"),
    ]
    for label, header, payload, word in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _raw_push(vclient, header, payload)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, label
        assert word in err.value.details(), (label, err.value.details())
    assert (await vclient.status()).policy_version == before_version
    assert await _greedy(vclient) == before


async def test_a_file_or_stream_that_does_not_fit_the_model_is_refused_naming_the_tensor(vclient, tmp_path):
    """Name, shape or dtype off: refused before anything is applied, on both paths."""
    from safetensors.torch import save_file

    before_version = (await vclient.status()).policy_version
    before = await _greedy(vclient)
    w = bundled_weights()
    name = next(n for n, t in w.items() if t.dim() == 2)
    cases = [
        ("unknown name", {**{k: v for k, v in w.items() if k != name}, "model.no_such.weight": w[name]},
         "'model.no_such.weight'"),
        ("wrong shape", {**w, name: w[name][:-1].contiguous()}, f"{name!r} has shape"),
        ("int dtype", {**w, name: w[name].to(torch.int32)}, f"{name!r} has dtype int32"),
    ]
    for label, sd, words in cases:
        path = str(tmp_path / f"{label.replace(' ', '_')}.safetensors")
        save_file(sd, path)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await vclient.push_weights_file(path, version=before_version + 1)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (label, err.value.details())
        assert words in err.value.details(), (label, err.value.details())
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await vclient.push_weights(sd, version=before_version + 1)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (label, err.value.details())
        assert words in err.value.details(), (label, err.value.details())
    assert (await vclient.status()).policy_version == before_version
    assert await _greedy(vclient) == before


async def test_pushed_weights_change_outputs_and_tag_versions(vclient):
    start = (await vclient.status()).policy_version
    w = bundled_weights()
    await vclient.push_weights(w, version=start + 1)
    start += 1
    original = await _greedy(vclient)
    reply = await vclient.push_weights(perturbed(w), version=start + 1)
    assert reply.applied_version == start + 1
    changed = await _greedy(vclient)
    assert [t for t, _ in changed] != [t for t, _ in original]
    assert all(v == start + 1 for _, v in changed)
    await vclient.push_weights(w, version=start + 2)
    restored = await _greedy(vclient)
    assert [t for t, _ in restored] == [t for t, _ in original]
    assert all(v == start + 2 for _, v in restored)


async def test_fast_path_push_from_a_file(vclient):
    start = (await vclient.status()).policy_version
    await vclient.push_weights(bundled_weights(), version=start + 1)
    original = await _greedy(vclient)
    await vclient.push_weights(perturbed(bundled_weights()), version=start + 2)
    assert [t for t, _ in await _greedy(vclient)] != [t for t, _ in original]
    reply = await vclient.push_weights_file(os.path.join(MODEL, "model.safetensors"), version=start + 3)
    assert reply.applied_version == start + 3
    again = await _greedy(vclient)
    assert [t for t, _ in again] == [t for t, _ in original]
    assert all(v == start + 3 for _, v in again)


async def test_each_engine_reports_where_its_weight_reload_went(vllm_service, vclient, caplog):
    caplog.set_level(logging.INFO, logger="rollout_service.engines.vllm")
    start = (await vclient.status()).policy_version
    await vclient.push_weights_file(os.path.join(MODEL, "model.safetensors"), version=start + 1)
    tensors = len(bundled_weights())
    engines = list(vllm_service.core.engines.values())
    for engine in engines:
        report = engine.last_reload
        assert report["tensors"] == tensors
        assert report["pid"] != os.getpid()  # measured in the engine's worker process
        assert 0 < report["read_s"] <= report["wall_s"] and report["cpu_s"] > 0
    lines = [m for m in caplog.messages if f"reloaded {tensors} tensors in" in m]
    assert {m.split()[0] for m in lines} >= {e.engine_id for e in engines}


async def test_killed_engine_loses_no_sample_and_comes_back(vllm_service, vclient):
    core = vllm_service.core
    victim = core.engines["vllm-0"]
    restarts = victim.restarts
    version = (await vclient.status()).policy_version
    prefix = unique("kill")
    await vclient.submit([PromptGroup(prompt_token_ids=PROMPTS[i % 4], num_samples=4, max_tokens=200, temperature=1.0,
                                      group_id=f"{prefix}-{i}") for i in range(8)])
    deadline = time.time() + 60
    while not any(r.engine_id == "vllm-0" and len(r.token_ids) > 5 for r, _ in core.running.values()):
        assert time.time() < deadline
        await asyncio.sleep(0.05)
    os.kill(victim.engine_core_pid, signal.SIGKILL)
    samples = await collect(vclient, prefix, 32, timeout=240)
    assert len({s.sample_id for s in samples}) == 32
    assert all(s.finish_reason in ("stop", "length") for s in samples)
    assert all(s.max_version == version for s in samples)
    deadline = time.time() + 180
    while not (victim.restarts == restarts + 1 and victim.load().state == "ready" and not core.is_restarting("vllm-0")):
        assert time.time() < deadline, "the killed engine did not come back"
        await asyncio.sleep(0.5)
    assert victim.load().policy_version == version  # restarted on the current weights
    assert (await vclient.status()).counters["engine_restarts"] >= 1


async def test_kv_use_is_reported_in_tokens_of_the_engines_real_cache(vllm_service, vclient):
    """`load().kv_capacity_tokens` is the engine core's cache (blocks x block
    size), the size `kv_cache_gib` buys at the model's KV bytes per token;
    `kv_used_tokens` grows while requests run."""
    import json

    engine = vllm_service.core.engines["vllm-1"]
    cache = engine._llm.vllm_config.cache_config
    capacity = engine.load().kv_capacity_tokens
    assert capacity == cache.num_gpu_blocks * cache.block_size > 0
    assert engine.describe().kv_capacity_tokens == capacity and engine.describe().dtype == "float32"
    hf = json.loads(open(os.path.join(MODEL, "config.json")).read())
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    kv_bytes_per_token = 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * head_dim * 4  # K and V, float32
    budget = engine.kv_cache_gib * 1024**3
    assert 0.9 * budget <= capacity * kv_bytes_per_token <= budget

    idle = engine.load().kv_used_tokens
    prefix = unique("kv")
    await vclient.submit([PromptGroup(prompt_token_ids=PROMPTS[i % 4], num_samples=4, max_tokens=300, temperature=1.0,
                                      group_id=f"{prefix}-{i}") for i in range(8)])
    peak = 0
    done = asyncio.ensure_future(collect(vclient, prefix, 32, timeout=180))
    while not done.done():
        peak = max(peak, engine.load().kv_used_tokens)
        await asyncio.sleep(0.01)
    await done
    # At least the prompts of the requests running together, at most the cache.
    assert idle < 4 * len(PROMPTS[0]) <= peak <= capacity, (idle, peak)


async def test_min_tokens_holds_the_end_token_back_until_that_many_tokens(vclient):
    """`min_tokens = max_tokens` asks for exactly `max_tokens` (what a
    benchmark's fixed lengths need): a greedy response that ended at its end
    token goes on past it, and what came before is the same tokens."""
    prefix = unique("min")
    groups = [PromptGroup(prompt_token_ids=p, num_samples=1, max_tokens=160, temperature=0.0,
                          group_id=f"{prefix}-{i}") for i, p in enumerate(PROMPTS)]
    await vclient.submit(groups)
    free = {s.group_id: s for s in await collect(vclient, prefix, len(PROMPTS), timeout=120)}
    ended = [g for g in groups if free[g.group_id].finish_reason == "stop"]
    assert ended, "the tiny reasoner ends some greedy answers before 160 tokens"
    forced = unique("min-forced")
    await vclient.submit([PromptGroup(prompt_token_ids=g.prompt_token_ids, num_samples=1, max_tokens=160,
                                      min_tokens=160, temperature=0.0, group_id=f"{forced}-{i}")
                          for i, g in enumerate(ended)])
    got = {s.group_id: s for s in await collect(vclient, forced, len(ended), timeout=120)}
    for i, g in enumerate(ended):
        short, long = free[g.group_id].response_token_ids, got[f"{forced}-{i}"].response_token_ids
        assert len(long) == 160 and got[f"{forced}-{i}"].finish_reason == "length"
        assert long[:len(short) - 1] == short[:-1]  # the same answer up to where it had ended
