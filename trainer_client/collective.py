"""The trainer's side of a collective weight push (`RolloutClient.
push_weights_collective`): the trainer is rank 0 of a `torch.distributed`
group whose other ranks are the engines' workers, and sends each byte once.

It runs vLLM's trainer-side weight-transfer engines: `nccl` on GPUs (vLLM's
`NCCLTrainerWeightTransferEngine`) and `gloo` on CPUs
(`GlooTrainerWeightTransferEngine`, from `rollout_proto.gloo_trainer`,
registered with vLLM's `WeightTransferTrainerFactory`), both driven through
`ServiceControl`, the
`VLLMWeightSyncClient` that speaks rollout.v1's control plane
(InitWeightTransfer, CollectiveUpdate). Without vLLM installed, gloo still
works (the engine class is used directly).

torch is imported lazily; this module never imports the service.
"""
from __future__ import annotations

import asyncio
import json
import socket
import sys
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any

import grpc

from rollout_proto import collective as wire
from rollout_proto import rollout_pb2 as pb
from rollout_proto.devices import RankDevice, trainer_device
from rollout_proto.dtypes import DTYPE_SIZES
from rollout_proto.gloo_trainer import GlooTrainerInitInfo, GlooTrainerWeightTransferEngine


@dataclass(frozen=True)
class ParamMeta:
    name: str
    dtype: Any  # torch.dtype
    shape: tuple[int, ...]


class StateDictSource:
    """A `WeightSource` over a state dict, set before each push."""

    def __init__(self) -> None:
        self.state_dict: Mapping[str, Any] = {}

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.state_dict.items()]

    def __iter__(self):
        for name in self.state_dict.keys():
            t = self.state_dict[name]
            full = getattr(t, "full_tensor", None)  # an FSDP shard: gathered here
            yield name, (full() if callable(full) else t).detach()


class ServiceControl:
    """`VLLMWeightSyncClient` over rollout.v1 (synchronous calls, made from
    a worker thread, each run on the client's event loop)."""

    def __init__(self, stub, metadata, loop: asyncio.AbstractEventLoop, backend: str, timeout_s: float) -> None:
        self._stub = stub
        self._md = metadata
        self._loop = loop
        self.backend = backend
        self.timeout_s = timeout_s
        self.version = 0
        self.manifest: list[pb.TensorSpec] = []
        self._call = None
        self.applied_version = 0
        self.seconds = 0.0
        self.device: pb.TransferDevice | None = None  # the sending rank's, checked by the service

    def _run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        options = {k: v for k, v in init_info.items()
                   if k not in ("master_address", "master_port", "world_size", "timeout_s", "rank_offset")}
        request = pb.InitWeightTransferRequest(
            backend=self.backend, master_address=init_info["master_address"],
            master_port=int(init_info["master_port"]), world_size=int(init_info["world_size"]),
            timeout_s=float(init_info.get("timeout_s", self.timeout_s)), options_json=json.dumps(options),
            trainer_device=self.device)
        async def init():
            await self._stub.InitWeightTransfer(request, metadata=self._md)

        self._run(init())

    async def _next(self, phase: int) -> pb.CollectiveUpdateEvent:
        event = await self._call.read()
        if event is None or event is grpc.aio.EOF:
            await self._call  # raises the call's status
            raise RuntimeError("the service ended the push without a status")
        if event.phase != phase:
            raise RuntimeError(f"the service sent phase {event.phase}, expected {phase}")
        return event

    def start_weight_update(self) -> None:
        async def start():
            self._call = self._stub.CollectiveUpdate(
                pb.CollectiveUpdateRequest(version=self.version, tensors=self.manifest), metadata=self._md)
            await self._next(pb.CollectiveUpdateEvent.ACCEPTED)

        self._run(start(), self.timeout_s + 60)

    def update_weights(self, update_info) -> None:
        self._run(self._next(pb.CollectiveUpdateEvent.RECEIVED), self.timeout_s * 4 + 120)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        event = self._run(self._next(pb.CollectiveUpdateEvent.LIVE), self.timeout_s * 4 + 120)
        self.applied_version = event.applied_version
        self.seconds = event.seconds

    def cancel(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            self._loop.call_soon_threadsafe(call.cancel)


def free_port(address: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def trainer_engine(init_info, control, source: StateDictSource):
    """vLLM's `WeightTransferTrainerFactory.trainer_init` for the init
    info's backend (gloo registered here if this process has not yet),
    driven through `control` (`ServiceControl` or `HttpControl`). For gloo
    in a process that has not loaded vLLM (importing it costs seconds), or
    without vLLM, the same gloo engine directly."""
    if init_info.backend == "gloo" and "vllm.distributed.weight_transfer.factory" not in sys.modules:
        return GlooTrainerWeightTransferEngine.trainer_init(init_info, client=control, source=source)
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    except ImportError:
        if init_info.backend != "gloo":
            raise RuntimeError(f"the {init_info.backend} backend needs vLLM installed in the trainer") from None
        return GlooTrainerWeightTransferEngine.trainer_init(init_info, client=control, source=source)
    if "gloo" not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine("gloo", GlooTrainerWeightTransferEngine)
    return WeightTransferTrainerFactory.trainer_init(init_info, client=control, source=source)


def init_info_for(backend: str, world_size: int, address: str, port: int, timeout_s: float,
                  chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES, mode: str = "chain"):
    """The trainer's (rank 0's) init info of `backend` for a group of
    `world_size` ranks whose store listens at `address`:`port`."""
    if backend == "gloo":
        return GlooTrainerInitInfo(address, port, world_size, timeout_s, chunk_bytes, mode)
    if backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        return NCCLTrainerInitInfo(master_address=address, master_port=port, world_size=world_size, rank=0)
    raise ValueError(f"unknown backend {backend!r}")


class HttpControl:
    """`VLLMWeightSyncClient` over vLLM's weight-transfer HTTP routes
    (`vllm serve`'s, or the service's side server's), as vLLM's
    `HTTPVLLMWeightSyncClient` speaks them, without importing vLLM. A call
    the server refuses raises RuntimeError naming the route, the status and
    the server's message."""

    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 300.0,
                 tls_ca_file: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {"Content-Type": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self.timeout_s = timeout_s
        self.tls_ca_file = tls_ca_file

    def _post(self, path: str, body: dict | None = None) -> None:
        import ssl
        import urllib.error
        import urllib.request

        request = urllib.request.Request(f"{self.base_url}/{path}", method="POST", headers=self.headers,
                                         data=json.dumps(body).encode() if body is not None else b"")
        ctx = ssl.create_default_context(cafile=self.tls_ca_file) if self.tls_ca_file else None
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s, context=ctx) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            raw = exc.read().decode(errors="replace")
            try:
                message = json.loads(raw)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = raw[:300]
            raise RuntimeError(f"POST /{path}: {exc.code}: {message}") from None
        except OSError as exc:  # URLError, a refused connection, a timeout
            raise RuntimeError(f"POST /{path}: {getattr(exc, 'reason', exc)}") from None

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._post("init_weight_transfer_engine", {"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self._post("shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self._post("start_weight_update")

    def update_weights(self, update_info) -> None:
        self._post("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("finish_weight_update", {"weight_version": weight_version} if weight_version is not None else None)


def device_pb(device: RankDevice) -> pb.TransferDevice:
    return pb.TransferDevice(host=device.host, device=device.device, uuid=device.uuid, pci_bus_id=device.pci_bus_id)


def manifest_of(state_dict: Mapping[str, Any]) -> list[pb.TensorSpec]:
    out = []
    for name, t in state_dict.items():
        dtype = str(t.dtype).removeprefix("torch.")
        shape = [int(d) for d in t.shape]
        n = wire.Spec(name, dtype, tuple(shape)).nbytes if dtype in DTYPE_SIZES else 0
        out.append(pb.TensorSpec(name=name, dtype=dtype, shape=shape, byte_length=n))
    return out


class CollectiveGroup:
    """A trainer's membership of the service's transfer group, kept across
    pushes (`RolloutClient.push_weights_collective` holds one)."""

    def __init__(self, stub, metadata, backend: str, address: str, port: int, timeout_s: float,
                 chunk_bytes: int, mode: str) -> None:
        self._stub = stub
        self._md = metadata
        self.backend = backend
        self.address = address
        self.port = port
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes
        self.mode = mode
        self.control: ServiceControl | None = None
        self.engine = None
        self.source = StateDictSource()
        self.plan: pb.WeightTransferPlan | None = None

    async def open(self) -> None:
        """Learn the group's shape and join it. The service first checks
        this rank's GPU against every engine worker's and refuses
        (FAILED_PRECONDITION, naming both ranks and the GPU) before any
        group or NCCL communicator exists on either side."""
        self.plan = await self._stub.GetWeightTransferPlan(
            pb.WeightTransferPlanRequest(backend=self.backend), metadata=self._md)
        device = device_pb(await asyncio.to_thread(trainer_device, self.plan.backend))
        if device.uuid or device.pci_bus_id:
            self.plan = await self._stub.GetWeightTransferPlan(
                pb.WeightTransferPlanRequest(backend=self.plan.backend, trainer_device=device), metadata=self._md)
        port = self.port or free_port(self.address)
        self.control = ServiceControl(self._stub, self._md, asyncio.get_running_loop(), self.plan.backend,
                                      self.timeout_s)
        self.control.device = device
        info = init_info_for(self.plan.backend, self.plan.world_size, self.address, port, self.timeout_s,
                             self.chunk_bytes, self.mode)
        self.engine = await asyncio.to_thread(trainer_engine, info, self.control, self.source)

    async def push(self, state_dict: Mapping[str, Any], version: int) -> tuple[int, float, int]:
        """(applied version, seconds from the request to live, bytes this rank sent)."""
        if self.engine is None:
            await self.open()
        self.source.state_dict = state_dict
        self.control.version = version
        self.control.manifest = manifest_of(state_dict)
        try:
            await asyncio.to_thread(self.engine.send_weights)
        finally:
            self.source.state_dict = {}
        sent = getattr(self.engine, "bytes_sent", None)
        if sent is None:  # vLLM's engines do not count: the payload, once
            sent = sum(s.byte_length for s in self.control.manifest)
        return self.control.applied_version, self.control.seconds, sent

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if self.control is not None:
            self.control.cancel()
        if engine is not None:
            engine.shutdown()


# -- trainers with several ranks (FSDP, DeepSpeed ZeRO-3) ------------------------


def _full_tensor(t):
    full = getattr(t, "full_tensor", None)  # an FSDP2 / DTensor shard: an all-gather every rank joins
    return full() if callable(full) else t


class _Lockstep(Mapping):
    """Rank 0's view of a sharded state dict: before it gathers a tensor it
    broadcasts which one, so that every other rank joins the same gather.
    Shapes and dtypes (the manifest) are read without gathering."""

    def __init__(self, state_dict: Mapping[str, Any], signal, gather) -> None:
        import threading

        self._sd, self._names = state_dict, list(state_dict)
        self._signal, self._gather = signal, gather
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._names)

    def __iter__(self):
        return iter(self._names)

    def items(self):
        return self._sd.items()

    def __getitem__(self, name: str):
        with self._lock:
            self._signal(self._names.index(name) + 1)
            return self._gather(self._sd[name]).detach()


async def push_weights_sharded(client, state_dict: Mapping[str, Any], version: int, *, group=None,
                               gather=None, **push_kwargs) -> int:
    """A collective push from a trainer with several ranks: EVERY rank calls
    this with its own (sharded) state dict, keys in the same order; rank 0 of
    `group` passes its `RolloutClient` (the others None) and sends. Each
    tensor is gathered whole by all ranks together, one at a time, as rank 0
    sends it (FSDP2's `full_tensor()` by default; `gather(tensor)` for
    another scheme, e.g. DeepSpeed's GatheredParameters), so no rank holds
    the whole model. Returns the version applied, on every rank; a push
    that fails raises on every rank.

    Every wait is bounded: the service's side by `timeout_s` (see
    `RolloutClient.push_weights_collective`, whose keyword arguments
    `push_kwargs` are), the ranks' lockstep by `group`'s own timeout
    (`torch.distributed.init_process_group(timeout=...)`)."""
    import torch
    import torch.distributed as dist

    gather = gather or _full_tensor
    src = dist.get_global_rank(group, 0) if group is not None else 0
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"

    def signal(value: int = 0) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.broadcast(t, src=src, group=group)
        return int(t.item())

    if dist.get_rank(group) != 0:
        names = list(state_dict)

        def follow() -> int:
            while (index := signal()) > 0:
                gather(state_dict[names[index - 1]])  # join rank 0's gather
            return signal()  # the version applied, or -1

        applied = await asyncio.to_thread(follow)
        if applied < 0:
            raise RuntimeError(f"the push of version {version} failed on rank 0")
        return applied
    if client is None:
        raise ValueError("client: rank 0 of the group sends and needs a RolloutClient")
    applied = -1
    try:
        result = await client.push_weights_collective(_Lockstep(state_dict, signal, gather), version, **push_kwargs)
        applied = int(result.applied_version)
        return applied
    finally:
        await asyncio.to_thread(lambda: (signal(0), signal(applied)))
