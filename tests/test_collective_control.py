"""The collective weight push's control plane and data plane on simulated
engines (each a gloo rank in the service's process): fast, no vLLM."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import grpc
import pytest

torch = pytest.importorskip("torch")

from rollout_proto import rollout_pb2 as pb  # noqa: E402
from trainer_client import PromptGroup  # noqa: E402
from trainer_client.collective import free_port  # noqa: E402

from helpers import collect, connect, running, sim_config, unique  # noqa: E402


@pytest.fixture(scope="module")
async def service():
    async with running(sim_config(num_engines=3)) as service:
        yield service


@pytest.fixture
async def client(service):
    async with connect(service, "coll-sim") as c:
        yield c


def _state_dict(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"big": torch.randn(700, 1000, generator=g), "empty": torch.zeros(0, 3),
            "small": torch.randn(7, generator=g), "half": torch.randn(300, 33, generator=g).to(torch.bfloat16)}


def _payload(sd) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


async def test_push_reaches_every_engine_and_the_trainer_sends_each_byte_once(service, client):
    sd = _state_dict()
    version = (await client.status()).policy_version + 1
    reply = await client.push_weights_collective(sd, version, timeout_s=10, chunk_mb=0.5)
    assert reply.applied_version == version and reply.bytes_received == _payload(sd)
    status = await client.status()
    assert status.policy_version == version and all(e.policy_version == version for e in status.engines)
    assert all(e.received_bytes == _payload(sd) for e in service.core.fleet.engines.values())
    # The stager's copy is what a restarted engine gets, byte for byte.
    from safetensors.torch import load_file

    staged = load_file(service.core.weight_sync.last.path)
    assert all(torch.equal(staged[k], sd[k]) for k in sd)
    # The group is kept: the next push does not form it again.
    plan = service.core.collective.plan_in_force
    reply = await client.push_weights_collective(_state_dict(1), version + 1, timeout_s=10, chunk_mb=0.5)
    assert reply.applied_version == version + 1 and service.core.collective.plan_in_force is plan
    # In broadcast mode gloo's root sends to every receiver (3 engines + the stager).
    reply = await client.push_weights_collective(sd, version + 2, timeout_s=10, chunk_mb=0.5, mode="broadcast")
    assert reply.bytes_received == 4 * _payload(sd)
    samples_version = version + 2
    gid = unique("after")
    await client.submit([PromptGroup(prompt_token_ids=[1, 2], num_samples=3, max_tokens=8, group_id=gid)])
    assert all(s.min_version == s.max_version == samples_version for s in await collect(client, gid, 3))


async def test_plan_names_the_ranks(client):
    plan = await client._stub.GetWeightTransferPlan(pb.WeightTransferPlanRequest(backend="gloo"))
    assert plan.world_size == 5 and list(plan.first_ranks) == [1, 2, 3] and plan.stager_rank == 4
    assert list(plan.engine_ids) == ["sim-0", "sim-1", "sim-2"]


async def test_bad_requests_name_the_field_and_the_service_stays_up(client):
    stub = client._stub
    port = free_port()
    cases = [
        (pb.InitWeightTransferRequest(backend="gloo", master_address="127.0.0.1", master_port=port, world_size=3),
         "world_size", "5 ranks"),
        (pb.InitWeightTransferRequest(backend="mpi", master_address="127.0.0.1", master_port=port, world_size=5),
         "backend", "gloo"),
        (pb.InitWeightTransferRequest(backend="gloo", master_address="", master_port=port, world_size=5),
         "master_address", "required"),
        (pb.InitWeightTransferRequest(backend="gloo", master_address="127.0.0.1", master_port=port, world_size=5,
                                      options_json="[1]"), "options_json", "object"),
        (pb.InitWeightTransferRequest(backend="gloo", master_address="127.0.0.1", master_port=port, world_size=5,
                                      options_json=json.dumps({"mode": "ring"})), "options_json", "mode"),
    ]
    for request, field, words in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.InitWeightTransfer(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert field in err.value.details() and words in err.value.details(), err.value.details()
    serving = (await client.status()).policy_version
    for request, field in [
        (pb.CollectiveUpdateRequest(version=serving + 1, tensors=[pb.TensorSpec(name="w", dtype="float99", shape=[2])]),
         "tensors[0].dtype"),
        (pb.CollectiveUpdateRequest(version=serving + 1), "tensors"),
        (pb.CollectiveUpdateRequest(version=0, tensors=[pb.TensorSpec(name="w", dtype="float32", shape=[2])]),
         "version"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.CollectiveUpdate(request):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()
    assert (await client.status()).policy_version == serving


async def test_stale_version_is_refused_before_anything_moves(client):
    serving = (await client.status()).policy_version
    if serving == 0:
        await client.push_weights_collective(_state_dict(), 1, timeout_s=10)
        serving = 1
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.push_weights_collective(_state_dict(), serving, timeout_s=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "version" in err.value.details()
    assert (await client.status()).policy_version == serving


class _DiesMidway(dict):
    """A state dict whose trainer "dies" after sending `after` tensors: it
    aborts its side of the group."""

    def __init__(self, sd, after: str, client) -> None:
        super().__init__(sd)
        self.after, self.client = after, client

    def __getitem__(self, name):
        if name == self.after:
            self.client._collective.engine.shutdown()  # the sender's group goes away
            raise ConnectionError("trainer died")
        return super().__getitem__(name)


async def test_trainer_dying_mid_transfer_leaves_the_previous_version(service, client):
    serving = (await client.status()).policy_version
    await client.push_weights_collective(_state_dict(), serving + 1, timeout_s=3)  # the group is formed
    serving += 1
    t0 = time.monotonic()
    with pytest.raises(Exception):
        await client.push_weights_collective(_DiesMidway(_state_dict(2), "small", client), serving + 1, timeout_s=3)
    # The service notices within the group's timeout, puts nothing live, and stays healthy.
    deadline = time.monotonic() + 20
    while service.core.collective.pushing is not None:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    assert time.monotonic() - t0 < 15
    status = await client.status()
    assert status.policy_version == serving and all(e.policy_version == serving for e in status.engines)
    assert service.core.collective.plan_in_force is None  # the group is closed after a failed transfer
    reply = await client.push_weights_collective(_state_dict(3), serving + 1, timeout_s=3)
    assert reply.applied_version == serving + 1


async def test_a_push_while_another_applies_is_refused(service, client):
    serving = (await client.status()).policy_version
    release = threading.Event()

    class Slow(dict):
        def __getitem__(self, name):
            if name == "small":
                release.wait(10)
            return super().__getitem__(name)

    first = asyncio.ensure_future(client.push_weights_collective(Slow(_state_dict()), serving + 1, timeout_s=10))
    deadline = time.monotonic() + 10
    while service.core.collective.pushing is None:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    async with connect(service, "coll-sim-2") as other:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in other._stub.CollectiveUpdate(pb.CollectiveUpdateRequest(
                    version=serving + 2, tensors=[pb.TensorSpec(name="w", dtype="float32", shape=[2])])):
                pass
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "being applied" in err.value.details()
    release.set()
    assert (await first).applied_version == serving + 1
