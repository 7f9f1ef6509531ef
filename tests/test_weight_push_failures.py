"""A weight push that fails on an engine is reported as the engine's failure
(not as a bad request), and the previous version keeps serving."""
from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from trainer_client import PromptGroup, RolloutClient

from conftest import connect, running, sim_config, unique
from test_streaming import collect


@pytest.fixture(scope="module")
async def service():
    """Its own service: these tests break its engines' weight updates."""
    async with running(sim_config(num_engines=2)) as service:
        yield service


@pytest.fixture
async def rclient(service):
    async with connect(service, "push-fail") as c:
        yield c


def _break_updates(monkeypatch, engine, exc: BaseException, delay_s: float = 0.05) -> None:
    async def update_weights(version, weights):
        await asyncio.sleep(delay_s)  # as `asyncio.wait_for` does, past its timeout
        raise exc

    monkeypatch.setattr(engine, "update_weights", update_weights)


async def _still_serves(client: RolloutClient, version: int) -> None:
    assert (await client.status()).policy_version == version
    gid = unique("after-failed-push")
    await client.submit([PromptGroup(prompt_token_ids=[1, 4], num_samples=2, max_tokens=16, group_id=gid)])
    samples = await collect(client, gid, 2)
    assert all(s.min_version == s.max_version == version for s in samples)


async def test_engine_update_timeout_is_deadline_exceeded_naming_the_engine(service, rclient, monkeypatch):
    engines = list(service.core.engines.values())
    for engine in engines:  # all of them, so that no engine moves on alone
        _break_updates(monkeypatch, engine, TimeoutError())  # what a stuck vLLM engine raises
    before = (await rclient.status()).policy_version
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await rclient.push_weights({"w": np.ones(8, np.float32)}, version=before + 1)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details()
    assert all(e.engine_id in err.value.details() for e in engines), err.value.details()
    assert "file_path" not in err.value.details()
    await _still_serves(rclient, before)


async def test_engine_connection_failure_is_unavailable_naming_the_engine(service, rclient, monkeypatch):
    engines = list(service.core.engines.values())
    for engine in engines:
        _break_updates(monkeypatch, engine, ConnectionResetError(104, "Connection reset by peer"))
    before = (await rclient.status()).policy_version
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await rclient.push_weights({"w": np.ones(8, np.float32)}, version=before + 1)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    assert all(e.engine_id in err.value.details() for e in engines), err.value.details()
    assert "file_path" not in err.value.details()
    await _still_serves(rclient, before)


async def test_missing_weights_file_is_invalid_argument_naming_the_path(rclient, tmp_path):
    before = (await rclient.status()).policy_version
    for path in (tmp_path / "absent.safetensors", tmp_path):  # missing; a directory
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rclient.push_weights_file(str(path), version=before + 1)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "header.file_path" in err.value.details() and str(path) in err.value.details()
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await rclient.push_weights_file(str(tmp_path / "junk.safetensors"), version=before + 1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "header.file_path" in err.value.details()
    assert (await rclient.status()).policy_version == before


async def test_push_after_a_failed_one_applies(service, rclient):
    before = (await rclient.status()).policy_version
    reply = await rclient.push_weights({"w": np.ones(8, np.float32)}, version=before + 1)
    assert reply.applied_version == before + 1
    await _still_serves(rclient, before + 1)
