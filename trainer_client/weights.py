"""Turning a state dict into a rollout.v1 weight push (manifest + chunks)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterator, Mapping

from rollout_proto import rollout_pb2 as pb


@dataclass(slots=True)
class FlatTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    data: memoryview


def flatten(state_dict: Mapping[str, object]) -> list[FlatTensor]:
    """Raw bytes of each tensor (torch tensors or NumPy arrays), in order."""
    out = []
    for name, t in state_dict.items():
        if hasattr(t, "detach"):  # torch.Tensor, without importing torch
            t = t.detach().cpu().contiguous()
            dtype = str(t.dtype).removeprefix("torch.")
            shape = tuple(t.shape)
            data = memoryview(t.reshape(-1).view(__import__("torch").uint8).numpy()).cast("B")
        else:
            import numpy as np

            arr = np.ascontiguousarray(t)
            dtype, shape = str(arr.dtype), tuple(arr.shape)
            data = memoryview(arr.reshape(-1).view(np.uint8)).cast("B")
        out.append(FlatTensor(name, dtype, shape, data))
    return out


def manifest(tensors: list[FlatTensor], with_checksums: bool = True) -> list[pb.TensorSpec]:
    return [
        pb.TensorSpec(
            name=t.name,
            dtype=t.dtype,
            shape=list(t.shape),
            byte_length=len(t.data),
            sha256=hashlib.sha256(t.data).hexdigest() if with_checksums else "",
        )
        for t in tensors
    ]


def chunks(header: pb.WeightsHeader, tensors: list[FlatTensor], chunk_bytes: int) -> Iterator[pb.WeightsChunk]:
    yield pb.WeightsChunk(header=header)
    for t in tensors:
        for offset in range(0, len(t.data), chunk_bytes):
            yield pb.WeightsChunk(data=bytes(t.data[offset : offset + chunk_bytes]))
