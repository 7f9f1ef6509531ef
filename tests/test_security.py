"""Authentication, TLS and a stalled weight push, against the real server."""
from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from rollout_proto import rollout_pb2 as pb
from rollout_service.service import RolloutService
from trainer_client import PromptGroup, RolloutClient

from helpers import collect, self_signed, sim_config, unique

SUBMIT, WEIGHTS = "submit-secret-1", "weights-secret-2"


@pytest.fixture(scope="module")
async def secured(tmp_path_factory):
    cfg = sim_config(num_engines=1)
    cfg.auth.submit_tokens = [SUBMIT]
    cfg.auth.weights_tokens = [WEIGHTS]
    cfg.push_idle_timeout_s = 1.0
    service = RolloutService(cfg)
    await service.start()
    yield service
    await service.stop()


def _addr(service):
    return f"127.0.0.1:{service.grpc_port}"


async def _submit_ok(client):
    gid = unique("auth")
    await client.submit([PromptGroup(prompt_token_ids=[1, 5], num_samples=2, max_tokens=8, group_id=gid)])
    assert len(await collect(client, gid, 2)) == 2


async def test_requests_without_or_with_a_wrong_token_are_unauthenticated(secured):
    for token in (None, "wrong"):
        async with RolloutClient(_addr(secured), token=token) as c:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.submit([PromptGroup(prompt_token_ids=[1, 5], num_samples=1, max_tokens=4)])
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in c.stream():
                    break
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with RolloutClient(_addr(secured), token=SUBMIT) as c:
        await _submit_ok(c)  # the server keeps serving


async def test_submit_only_token_cannot_push_weights(secured):
    async with RolloutClient(_addr(secured), token=SUBMIT) as c:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.push_weights({"w": np.ones(4, np.float32)}, version=100)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert (await c.status()).policy_version < 100
    async with RolloutClient(_addr(secured), token=WEIGHTS) as c:
        v = (await c.status()).policy_version + 1
        assert (await c.push_weights({"w": np.ones(4, np.float32)}, version=v)).applied_version == v


async def test_tokens_never_appear_in_the_printed_configuration(secured):
    text = secured.config.describe()
    assert SUBMIT not in text and WEIGHTS not in text


async def test_http_endpoints_need_a_token_but_health_does_not(secured):
    import aiohttp

    base = f"http://127.0.0.1:{secured.http_port}"
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{base}/healthz") as r:
            assert r.status == 200
        async with s.post(f"{base}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}) as r:
            assert r.status == 401
        async with s.post(f"{base}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2},
                          headers={"Authorization": f"Bearer {SUBMIT}"}) as r:
            assert r.status == 200


async def test_stalled_weight_push_is_abandoned_and_old_version_serves(secured):
    async with RolloutClient(_addr(secured), token=WEIGHTS) as c:
        before = (await c.status()).policy_version
        a = np.arange(1024, dtype=np.float32)

        async def stalled():
            import hashlib

            spec = pb.TensorSpec(name="w", dtype="float32", shape=[1024], byte_length=a.nbytes,
                                 sha256=hashlib.sha256(a.tobytes()).hexdigest())
            yield pb.WeightsChunk(header=pb.WeightsHeader(version=before + 1, tensors=[spec]))
            yield pb.WeightsChunk(data=a.tobytes()[:100])
            await asyncio.sleep(30)  # the trainer hangs

        t0 = asyncio.get_running_loop().time()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c._stub.PushWeights(stalled(), metadata=c._md)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert asyncio.get_running_loop().time() - t0 < 10
        assert (await c.status()).policy_version == before
        await _submit_ok(c)


async def test_tls_serves_grpc_and_http(tmp_path):
    import ssl

    import aiohttp

    cert, key = self_signed(tmp_path)
    cfg = sim_config(num_engines=1)
    cfg.tls.cert_file, cfg.tls.key_file = cert, key
    service = RolloutService(cfg)
    await service.start()
    try:
        async with RolloutClient(f"localhost:{service.grpc_port}", tls_ca_file=cert) as c:
            await _submit_ok(c)
        trust = ssl.create_default_context(cafile=cert)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"https://localhost:{service.http_port}/healthz", ssl=trust) as r:
                assert r.status == 200 and (await r.json())["status"] == "ok"
    finally:
        await service.stop()
