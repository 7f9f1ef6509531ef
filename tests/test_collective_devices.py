"""A collective transfer group with two ranks on one GPU is refused before
it forms (NCCL would fail with "Duplicate GPU detected" half way): the real
service, its simulated engines' receiving ranks and the real trainer client,
with only the platform mocked (this process's torch.cuda as a machine of
two GPUs). A trainer on its own GPU goes on to push over gloo."""
from __future__ import annotations

import time
from types import SimpleNamespace

import grpc
import pytest

torch = pytest.importorskip("torch")

from rollout_proto import rollout_pb2 as pb  # noqa: E402
from rollout_proto.devices import RankDevice, shared_device  # noqa: E402
from trainer_client import PromptGroup  # noqa: E402
from trainer_client.collective import free_port  # noqa: E402

from helpers import FAST_SIM, collect, connect, running, sim_config, unique  # noqa: E402

UUIDS = ["GPU-5f0c1e2a-0000-4000-8000-000000000000", "GPU-5f0c1e2a-1111-4000-8000-000000000001"]


@pytest.fixture
def gpus(monkeypatch):
    """torch.cuda as a machine with two GPUs; `gpus.current` is this
    process's current device (the trainer's, as torch.cuda.set_device sets it)."""
    state = SimpleNamespace(current=0)
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: len(UUIDS))
    monkeypatch.setattr(cuda, "current_device", lambda: state.current)
    monkeypatch.setattr(cuda, "get_device_properties", lambda i: SimpleNamespace(
        name="NVIDIA H100 80GB HBM3", uuid=UUIDS[int(i)], pci_domain_id=0, pci_bus_id=0x18 + int(i), pci_device_id=0))
    return state


def _engines_on(device: int, n: int = 1):
    return sim_config(num_engines=n, sim={**FAST_SIM, "device": device})


def _state_dict() -> dict:
    return {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5)}


async def _serves(client, version: int) -> None:
    """The fleet still samples, every token at `version`."""
    gid = unique("still")
    await client.submit([PromptGroup(prompt_token_ids=[1, 2], num_samples=2, max_tokens=6, group_id=gid)])
    assert all(s.min_version == s.max_version == version for s in await collect(client, gid, 2))


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
async def test_a_trainer_on_an_engines_gpu_is_refused_naming_both_ranks_and_the_fix(gpus, backend):
    gpus.current = 0
    async with running(_engines_on(0)) as service, connect(service, "dev") as client:
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.push_weights_collective(_state_dict(), 1, backend=backend, timeout_s=30)
        # Refused at once (not after the group's 30 s timeout), before any
        # rank joined; over NCCL before the trainer's communicator (vLLM's
        # NCCL trainer cannot even start on this machine).
        assert time.monotonic() - t0 < 10
        msg = err.value.details()
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, msg
        assert "rank 0 (the trainer, cuda:0 on host" in msg and "rank 1 (engine sim-0 worker 0, cuda:0" in msg, msg
        assert f"both on GPU {UUIDS[0]}" in msg, msg
        assert "torch.cuda.current_device()" in msg and "engine.devices" in msg, msg
        assert service.core.collective.plan_in_force is None and client._collective is None
        status = await client.status()
        assert status.policy_version == 0 and all(e.policy_version == 0 for e in status.engines)
        await _serves(client, 0)


async def test_a_trainer_on_a_gpu_of_its_own_pushes(gpus):
    gpus.current = 1
    async with running(_engines_on(0)) as service, connect(service, "dev") as client:
        reply = await client.push_weights_collective(_state_dict(), 1, backend="gloo", timeout_s=10)
        assert reply.applied_version == 1 and service.core.collective.plan_in_force is not None
        assert (await client.status()).policy_version == 1
        await _serves(client, 1)


async def test_init_without_the_plan_check_is_refused_before_any_engine_joins(gpus):
    """A trainer that skips GetWeightTransferPlan and claims an engine's GPU
    in InitWeightTransfer itself: refused before the engines wait for it."""
    async with running(_engines_on(1)) as service, connect(service, "dev") as client:
        request = pb.InitWeightTransferRequest(
            backend="gloo", master_address="127.0.0.1", master_port=free_port(), world_size=3, timeout_s=30,
            trainer_device=pb.TransferDevice(host="trainer-host", device="cuda:3", uuid=UUIDS[1]))
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client._stub.InitWeightTransfer(request)
        assert time.monotonic() - t0 < 10 and err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        msg = err.value.details()
        assert "rank 0 (the trainer, cuda:3 on host trainer-host)" in msg and UUIDS[1] in msg, msg
        assert "rank 1 (engine sim-0 worker 0, cuda:1 on host" in msg, msg
        assert service.core.collective.plan_in_force is None
        assert all(e._receiver is None for e in service.core.fleet.engines.values())  # nobody joined
        await _serves(client, 0)


async def test_two_engines_on_one_gpu_are_refused_naming_both(gpus, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # a trainer on the CPU: nothing to claim
    async with running(_engines_on(0, n=2)) as service, connect(service, "dev") as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.push_weights_collective(_state_dict(), 1, backend="gloo", timeout_s=30)
        msg = err.value.details()
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, msg
        assert "rank 1 (engine sim-0 worker 0, cuda:0" in msg and "rank 2 (engine sim-1 worker 0, cuda:0" in msg, msg
        assert "engine.devices" in msg and "the trainer" not in msg, msg
        await _serves(client, 0)


def test_only_one_physical_gpu_conflicts():
    a = RankDevice("node-a", "cuda:0", "", "0000:18:00")
    # The same PCI slot on two hosts is two GPUs; a UUID is one GPU whatever
    # each process (or container) calls its host and the device.
    b = RankDevice("node-b", "cuda:0", "", "0000:18:00")
    assert shared_device([(0, "the trainer", a), (1, "engine e worker 0", b)]) is None
    assert "rank 1" in shared_device([(0, "the trainer", a), (1, "engine e worker 0", a)])
    same = [(0, "the trainer", RankDevice("box-1", "cuda:0", UUIDS[0])),
            (1, "engine e worker 0", RankDevice("box-2", "cuda:2", UUIDS[0]))]
    assert UUIDS[0] in shared_device(same)
    cpus = [(r, f"rank {r}", RankDevice("node-a")) for r in range(3)]
    assert shared_device(cpus) is None
