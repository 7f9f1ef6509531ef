"""Collective weight transfer, the engine side that is not vLLM's.

A collective push reaches the engines over a `torch.distributed` group
(`rollout_proto.collective` cuts the bytes): rank 0 is the trainer, then
each engine's receiving ranks in fleet order, then, optionally, the
service's own stager rank, which writes the push into a staging file as it
passes so that an engine that restarts later comes back at the current
version (`WeightSync.bring_up`) and a failed push can be rolled back.

`TransferInit` is what an engine needs to join the group. `GroupReceiver`
is a receiving rank in this process (a simulated engine, the stager): its
blocking receive runs in a thread.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence

from rollout_proto import collective as wire
from rollout_service.engines.weights import StagedWeights, StagingWriter, TensorSpec


@dataclass(frozen=True)
class TransferInit:
    """One engine's place in a collective transfer group."""

    backend: str  # "gloo" or "nccl"
    master_address: str
    master_port: int
    world_size: int
    rank_offset: int  # this engine's first rank
    timeout_s: float = wire.DEFAULT_TIMEOUT_S
    options: Mapping[str, object] = field(default_factory=dict)  # the backend's wire params

    def at(self, rank_offset: int) -> "TransferInit":
        return replace(self, rank_offset=rank_offset)

    @property
    def chunk_bytes(self) -> int:
        return int(self.options.get("chunk_bytes", wire.DEFAULT_CHUNK_BYTES))

    @property
    def mode(self) -> str:
        return str(self.options.get("mode", "chain"))


def specs_of(manifest: Sequence[tuple[str, str, tuple[int, ...]]]) -> list[wire.Spec]:
    return [wire.Spec(name, dtype, tuple(int(d) for d in shape)) for name, dtype, shape in manifest]


class GroupReceiver:
    """A receiving rank of the group in this process."""

    def __init__(self, init: TransferInit) -> None:
        if init.backend != "gloo":
            raise ValueError(f"a rank in the service process speaks gloo, not {init.backend!r}")
        self.init = init
        self.group = None
        self._store = None
        # A thread of its own: the receive blocks for the whole transfer, and
        # several ranks may live in this process.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rank-{init.rank_offset}")

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def join(self) -> None:
        i = self.init
        self.group, self._store = await self._run(
            wire.open_group, "gloo", i.master_address, i.master_port, i.rank_offset, i.world_size, i.timeout_s)

    async def receive(self, specs: list[wire.Spec], on_tensors: Callable[[list], None]) -> int:
        if self.group is None:
            raise RuntimeError("not in a transfer group")
        i = self.init
        return await self._run(wire.receive, self.group, i.rank_offset, i.world_size, specs,
                               i.chunk_bytes, on_tensors, i.mode, i.timeout_s)

    def close(self) -> None:
        group, self.group, self._store = self.group, None, None
        wire.abort_group(group)
        self._thread.shutdown(wait=False)


class Stager:
    """The stager rank: writes a collective push into a staging file as its
    bytes pass (no second copy in memory)."""

    def __init__(self, init: TransferInit) -> None:
        self.receiver = GroupReceiver(init)

    async def join(self) -> None:
        await self.receiver.join()

    async def receive(self, specs: list[wire.Spec]) -> StagedWeights:
        writer = StagingWriter([TensorSpec(s.name, s.dtype, s.shape, s.nbytes) for s in specs])

        def write(batch) -> None:
            import torch

            for _, t in batch:
                writer.feed(t.reshape(-1).view(torch.uint8).numpy())

        try:
            await self.receiver.receive(specs, write)
            return writer.finish()
        except BaseException:
            writer.abort()
            raise

    def close(self) -> None:
        self.receiver.close()
