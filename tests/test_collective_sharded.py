"""A trainer with several ranks (FSDP2: every parameter a DTensor shard)
pushes collectively with `push_weights_sharded`: every rank takes part in
each tensor's gather, rank 0 sends, every rank learns the version applied,
and a push that fails raises on every rank instead of hanging one. Two
trainer ranks (gloo, CPU) as processes, simulated engines in the service."""
from __future__ import annotations

import asyncio
import multiprocessing

import pytest

torch = pytest.importorskip("torch")

from helpers import free_port, running, sim_config  # noqa: E402

RANKS = 2


def full_state_dict() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(64, 48, generator=g), "norm": torch.randn(48, generator=g),
            "head": torch.randn(96, 48, generator=g).to(torch.bfloat16)}


def _rank(rank: int, port: int, address: str, versions: list[int], out) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from trainer_client import RolloutClient
    from trainer_client.collective import push_weights_sharded

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    mesh = init_device_mesh("cpu", (RANKS,))
    shards = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full_state_dict().items()}
    assert shards["embed"].to_local().shape[0] == 64 // RANKS  # each rank holds half

    async def push() -> list:
        got = []
        client = RolloutClient(address) if rank == 0 else None
        for version in versions:
            try:
                got.append(await push_weights_sharded(client, shards, version, timeout_s=10, chunk_mb=0.01))
            except Exception as exc:  # noqa: BLE001 - reported to the test
                got.append(f"{type(exc).__name__}: {exc}")
        if client is not None:
            await client.close()
        return got

    try:
        out.put((rank, asyncio.run(push())))
    finally:
        dist.destroy_process_group()


async def test_every_rank_of_a_sharded_trainer_takes_part_and_learns_the_applied_version():
    async with running(sim_config(num_engines=2)) as service:
        address = f"127.0.0.1:{service.grpc_port}"
        # The second push repeats the version: refused by the service, it must fail on both ranks.
        versions = [1, 1]
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, port, address, versions, out)) for r in range(RANKS)]
        for p in procs:
            p.start()
        results = {}
        loop = asyncio.get_running_loop()
        for _ in range(RANKS):
            rank, got = await loop.run_in_executor(None, out.get, True, 120)
            results[rank] = got
        for p in procs:
            await loop.run_in_executor(None, p.join, 30)
            assert p.exitcode == 0
        assert results[0][0] == results[1][0] == 1
        assert "FAILED_PRECONDITION" in results[0][1] or "version" in results[0][1], results[0][1]
        assert "failed on rank 0" in results[1][1]
        status = service.core.weight_sync
        assert status.version == 1
        # What the engines received is the whole model, gathered from the shards.
        from safetensors.torch import load_file

        staged = load_file(status.last.path)
        expected = full_state_dict()
        assert set(staged) == set(expected) and all(torch.equal(staged[k], expected[k]) for k in expected)
