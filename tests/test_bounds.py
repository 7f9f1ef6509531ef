"""Bounded memory and closed by default, against the real server: a consumer
that does not acknowledge is held at its bound and told so, samples kept
for acks count against the queue, `Abort(keep_partial)` never builds a
reply the transport cannot carry, a failure inside the service is a status
without paths, and a server beyond loopback needs a token."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import aiohttp
import grpc
import pytest

from rollout_proto import rollout_pb2 as pb
from rollout_service.service import RolloutService
from trainer_client import PromptGroup, RolloutClient

from helpers import collect, running, sim_config, unique, wait_until

SLOW_SIM = {"decode_base_s": 0.05}  # 20 steps a second: groups stay unfinished while a test looks


async def test_a_consumer_that_does_not_ack_is_held_at_max_unacked_samples_then_refused_naming_it():
    cfg = sim_config(num_engines=1)
    cfg.max_unacked_samples, cfg.unacked_wait_s = 8, 1.0
    async with running(cfg) as service, RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id="acks") as good:
        gid = unique("lag")
        await good.submit([PromptGroup(prompt_token_ids=[1, 5], num_samples=20, max_tokens=4, group_id=gid)])
        # A consumer that reads and never acknowledges: 8 samples, then held, then refused.
        stream = good._stub.StreamSamples(pb.StreamSamplesRequest(consumer_id="never-acks"))
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for event in stream:
                got.append(event.cursor)
        assert len(got) == 8
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_unacked_samples" in err.value.details() and "unacked_wait_s" in err.value.details()
        # One that acknowledges as it goes gets all 20 through the same bound.
        received = []

        async def read():
            async for s in good.stream(ack_every=4):
                received.append(s)
                if len(received) == 20:
                    return

        await asyncio.wait_for(read(), 30)
        assert sorted(s.index for s in received) == list(range(20))


async def test_samples_kept_for_an_ack_count_against_max_queued_samples():
    cfg = sim_config(num_engines=1)
    cfg.max_queued_samples = 10
    async with running(cfg) as service, RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id="c") as c:
        gid = unique("kept")
        await c.submit([PromptGroup(prompt_token_ids=[1, 5], num_samples=8, max_tokens=4, group_id=gid)])
        samples = await collect(c, gid, 8)  # received; acknowledged only below
        await wait_until(lambda: service.core.delivery.retained == 8, 10, "8 retained samples")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.submit([PromptGroup(prompt_token_ids=[1, 5], num_samples=4, max_tokens=4)])
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_queued_samples=10" in err.value.details() and "8 delivered and not acknowledged" in err.value.details()
        await c.ack(max(s.cursor for s in samples))
        await c.submit([PromptGroup(prompt_token_ids=[1, 5], num_samples=4, max_tokens=4)])  # room again


async def test_abort_keep_partial_over_the_message_limit_is_refused_and_aborts_nothing():
    cfg = sim_config(num_engines=1, max_seqs=512, sim={**SLOW_SIM})
    cfg.max_message_mb = 1
    async with running(cfg) as service, RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id="c") as c:
        # 96 groups x 8 samples, each carrying a 1,000-token prompt: ~1.5 MB with the room left for each.
        prompt = [1 + i % 98 for i in range(1000)]
        gids = await c.submit([PromptGroup(prompt_token_ids=prompt, num_samples=8, max_tokens=20)
                               for _ in range(96)], batch_id="big")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.abort(batch_id="big", keep_partial=True)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_message_mb=1" in err.value.details() and "nothing was aborted" in err.value.details()
        assert (await c.status()).open_groups == 96
        n, partials = await c.abort(group_ids=gids[:4], keep_partial=True)  # a few at a time fit
        assert n == 4 and len(partials) == 32 and all(p.prompt_token_ids == prompt for p in partials)
        n, _ = await c.abort(batch_id="big")
        assert n == 92


async def test_a_failure_inside_the_service_is_a_status_without_paths(sim_service, client, monkeypatch):
    def broken():
        raise PermissionError(13, "Permission denied", "/srv/rollout/secret/state.json")

    monkeypatch.setattr(sim_service.core, "status", broken)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.status()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert err.value.details() == "GetStatus: failed inside the service (PermissionError: Permission denied)"
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{sim_service.http_port}/v1/status") as r:
            body = await r.json()
    assert r.status == 503 and "/srv" not in body["error"]["message"] and "GET /v1/status" in body["error"]["message"]
    monkeypatch.undo()
    gid = unique("after-failure")  # the server keeps serving
    await client.submit([PromptGroup(prompt_token_ids=[1, 5], num_samples=2, max_tokens=4, group_id=gid)])
    assert len(await collect(client, gid, 2)) == 2


async def test_serving_beyond_loopback_without_a_token_is_refused_at_start_naming_the_keys():
    cfg = sim_config(num_engines=1)
    cfg.host = "0.0.0.0"
    with pytest.raises(ValueError) as err:
        await RolloutService(cfg).start()
    for key in ("auth.submit_tokens", "auth.weights_tokens", "--insecure-no-auth", "auth.insecure_no_auth"):
        assert key in str(err.value)
    cfg.auth.insecure_no_auth = True  # the explicit opt-out starts
    async with running(cfg) as service:
        async with RolloutClient(f"127.0.0.1:{service.grpc_port}") as c:
            assert (await c.status()).engines
    cfg.auth.insecure_no_auth, cfg.auth.submit_tokens = False, ["t"]  # so does a token
    async with running(cfg):
        pass


def test_the_serve_command_refuses_an_open_address_without_a_token_and_says_what_to_set():
    out = subprocess.run([sys.executable, "-m", "rollout_service.cli", "serve", "--engine", "sim", "--host", "0.0.0.0",
                          "--grpc-port", "0", "--http-port", "0"], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    assert out.returncode == 2
    assert "rollout-service: refusing to serve on host '0.0.0.0' without authentication" in out.stderr
    assert "Traceback" not in out.stderr


async def test_readyz_tells_a_caller_without_a_token_up_or_down_without_error_text(monkeypatch):
    import dataclasses

    cfg = sim_config(num_engines=1)
    cfg.auth.submit_tokens = ["secret"]
    async with running(cfg) as service, aiohttp.ClientSession() as s:
        url = f"http://127.0.0.1:{service.http_port}/readyz"
        async with s.get(url) as r:
            assert r.status == 200 and (await r.json())["ready"] is True
        real = service.core.status
        monkeypatch.setattr(service.core, "status", lambda: dataclasses.replace(
            real(), placement_error='File "/srv/x.py", line 3: KeyError', placement_errors=1))
        async with s.get(url) as r:
            body = await r.text()
            assert r.status == 503 and '"ready": false' in body and "/srv" not in body and "KeyError" not in body


async def test_a_consumer_that_connects_after_many_acknowledged_samples_is_not_held_at_the_bound():
    cfg = sim_config(num_engines=1)
    cfg.max_unacked_samples, cfg.unacked_wait_s = 8, 1.0
    async with running(cfg) as service, RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id="a") as a:
        received = []

        async def read(client, n):
            async for s in client.stream(ack_every=4):
                received.append(s)
                if len(received) == n:
                    return

        await a.submit([PromptGroup(prompt_token_ids=[1, 5], num_samples=20, max_tokens=4)])
        await asyncio.wait_for(read(a, 20), 30)
        await a.ack()
        async with RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id="late") as late:
            gid = unique("late")
            await late.submit([PromptGroup(prompt_token_ids=[1, 5], num_samples=2, max_tokens=4, group_id=gid)])
            assert [s.cursor for s in await collect(late, gid, 2, timeout=10)] == [21, 22]
