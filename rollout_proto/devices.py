"""Which physical device each rank of a collective weight-transfer group
computes on, and the check that no two ranks share one (NCCL cannot put
two ranks of a group on one GPU: "Duplicate GPU detected", after the
group has half formed).

Both ends import this module: the trainer reports its sending rank
(`trainer_client.collective`), every engine worker its own
(`RolloutWorkerExtension.rollout_device`), and the service refuses a group
with a shared device before any rank joins (`core/collective.py`). torch
is imported lazily; nothing here initialises CUDA where the process has
not (NCCL's sending rank aside, which uses it anyway).
"""
from __future__ import annotations

import socket
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class RankDevice:
    """Where one rank computes. `uuid` is the GPU's UUID, unique across
    hosts; `pci_bus_id` (unique on its host only) stands in when there is
    none. Both empty: not a GPU (a CPU rank), never in conflict."""

    host: str = ""
    device: str = "cpu"  # "cuda:0" as this process numbers it
    uuid: str = ""
    pci_bus_id: str = ""

    @property
    def key(self) -> tuple[str, ...] | None:
        """The physical device, or None for a CPU rank."""
        if self.uuid:
            return ("uuid", self.uuid)
        if self.pci_bus_id:
            return ("pci", self.host, self.pci_bus_id)
        return None

    def describe(self) -> str:
        return f"{self.device} on host {self.host or '?'}"

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d) -> "RankDevice":
        return cls(str(d.get("host") or ""), str(d.get("device") or "cpu"), str(d.get("uuid") or ""),
                   str(d.get("pci_bus_id") or ""))


def cuda_device(index: int) -> RankDevice:
    """The identity of CUDA device `index` of this process."""
    import torch

    props = torch.cuda.get_device_properties(index)
    uuid = str(getattr(props, "uuid", "") or "")
    pci = ""
    if hasattr(props, "pci_bus_id"):
        domain, device = getattr(props, "pci_domain_id", 0), getattr(props, "pci_device_id", 0)
        pci = f"{domain:04x}:{props.pci_bus_id:02x}:{device:02x}"
    return RankDevice(socket.gethostname(), f"cuda:{index}", uuid, pci)


def cpu_device() -> RankDevice:
    """A rank on this host's CPU (nothing to check)."""
    return RankDevice(socket.gethostname())


def device_of(device) -> RankDevice:
    """The identity of a torch device (a CPU: no GPU to check)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return RankDevice(socket.gethostname(), device.type)
    return cuda_device(device.index if device.index is not None else torch.cuda.current_device())


def trainer_device(backend: str) -> RankDevice:
    """The device of the trainer's sending rank: NCCL sends from the current
    CUDA device; over gloo the current CUDA device of a process that uses
    one (it trains there), else none. Never initialises CUDA itself except
    for NCCL, which would."""
    try:
        import torch
    except ImportError:
        return cpu_device()
    cuda = torch.cuda
    if cuda.is_available() and (backend == "nccl" or cuda.is_initialized()):
        return cuda_device(cuda.current_device())
    return cpu_device()


def shared_device(ranks: list[tuple[int, str, RankDevice]]) -> str | None:
    """Why a group of (rank, who, device) cannot form, or None: the first
    two ranks on one physical GPU, named with what to change."""
    seen: dict[tuple[str, ...], tuple[int, str, RankDevice]] = {}
    for rank, who, device in ranks:
        key = device.key
        if key is None:
            continue
        if key not in seen:
            seen[key] = (rank, who, device)
            continue
        first, first_who, first_device = seen[key]
        trainer = first == 0 or rank == 0
        fix = ("run the trainer on a GPU no engine uses (its torch.cuda.current_device() or "
               "CUDA_VISIBLE_DEVICES), or leave that GPU out of engine.devices" if trainer else
               "give each engine GPUs of its own (engine.devices, engine.tensor_parallel_size; under Ray whole "
               "engine.ray.gpus_per_engine, engines_per_actor = 1)")
        gpu = device.uuid or f"PCI {device.pci_bus_id}"
        return (f"rank {first} ({first_who}, {first_device.describe()}) and rank {rank} ({who}, "
                f"{device.describe()}) are both on GPU {gpu}: NCCL cannot hold two ranks of one group on one GPU; "
                f"{fix}")
    return None
