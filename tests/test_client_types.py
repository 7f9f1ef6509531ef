"""The client hands trainer authors plain Python values, and its blocking
face has the same signatures and docstrings as the asyncio one."""
from __future__ import annotations

import asyncio
import dataclasses
import inspect

import numpy as np

from trainer_client import (
    EngineStatus,
    PromptGroup,
    PushResult,
    RolloutClient,
    ServiceStatus,
    SyncRolloutClient,
)

from helpers import unique

CALLS = ("wait_ready", "submit", "submit_detailed", "ack", "abort", "push_weights", "push_weights_file",
         "push_weights_collective", "close_collective", "status", "continue_trajectory")
ITERATORS = ("stream", "groups", "trajectory_groups")


def _no_protobuf(value) -> None:
    """Nothing in `value` is a protobuf message or container."""
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            _no_protobuf(getattr(value, f.name))
    elif isinstance(value, dict):
        assert type(value) is dict, type(value)
        for k, v in value.items():
            _no_protobuf(k)
            _no_protobuf(v)
    elif isinstance(value, (list, tuple)):
        assert type(value) in (list, tuple), type(value)
        for v in value:
            _no_protobuf(v)
    else:
        assert value is None or type(value) in (int, float, str, bool), type(value)


def test_sync_client_has_the_async_clients_signatures_and_docstrings():
    for name in CALLS + ITERATORS:
        sync, async_ = getattr(SyncRolloutClient, name), getattr(RolloutClient, name)
        assert not inspect.iscoroutinefunction(sync) and not inspect.isasyncgenfunction(sync), name
        assert sync.__doc__ and sync.__doc__ == async_.__doc__, name
        s, a = inspect.signature(sync), inspect.signature(async_)
        assert s.parameters == a.parameters, name
        if name in CALLS:
            assert s == a, name
        else:
            assert s.return_annotation == a.return_annotation.replace("AsyncIterator", "Iterator"), name
    assert inspect.signature(SyncRolloutClient) == inspect.signature(RolloutClient)
    assert "consumer_id:" in RolloutClient.__doc__ and "version:" in RolloutClient.push_weights.__doc__


async def test_status_and_push_return_plain_dataclasses(sim_service, client):
    st = await client.status()
    assert isinstance(st, ServiceStatus) and st.spec is None
    assert all(isinstance(e, EngineStatus) for e in st.engines) and len(st.engines) == 2
    assert {e.engine_id for e in st.engines} == set(sim_service.core.engines)
    _no_protobuf(st)
    pushed = await client.push_weights({"w": np.ones(16, np.float32)}, version=st.policy_version + 1)
    assert isinstance(pushed, PushResult) and pushed.target == "policy"
    assert pushed.applied_version == st.policy_version + 1 and pushed.bytes_received == 16 * 4
    assert pushed.seconds > 0
    _no_protobuf(pushed)
    assert (await client.status()).policy_version == pushed.applied_version


async def test_sync_client_returns_the_same_values(sim_service):
    def run() -> tuple[ServiceStatus, PushResult, list]:
        with SyncRolloutClient(f"127.0.0.1:{sim_service.grpc_port}", consumer_id=unique("sync")) as c:
            c.wait_ready(10)
            before = c.status()
            pushed = c.push_weights({"w": np.ones(4, np.float32)}, version=before.policy_version + 1)
            gid = unique("sync")
            c.submit([PromptGroup(prompt_token_ids=[1, 3], num_samples=2, max_tokens=8, group_id=gid)])
            group = next(g for g in c.groups() if g[0].group_id == gid)
            return before, pushed, group

    before, pushed, group = await asyncio.to_thread(run)  # the service runs on this loop
    assert isinstance(before, ServiceStatus) and isinstance(pushed, PushResult)
    assert pushed.applied_version == before.policy_version + 1
    assert [s.index for s in group] == [0, 1] and all(s.min_version == pushed.applied_version for s in group)
