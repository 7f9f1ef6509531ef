"""Turning a state dict into a rollout.v1 weight push (manifest + chunks,
and the digests in a trailer).

The chunks are lists of memoryviews over the tensors' own bytes; the
request serializer (`serialize_chunk`) writes each straight into the one
`bytes` gRPC sends, so a byte is copied once on its way to the wire. The
digests are computed on a thread while the chunks stream (`digests`), and
sent after them in a WeightsTrailer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping

from rollout_proto import rollout_pb2 as pb
from rollout_proto.checksums import hexdigest, new_hasher

# checksums= of push_weights -> the wire's checksum_algo ("" with sha256:
# only the TensorSpec.sha256 field, which every service version verifies).
CHECKSUMS = {"xxh3": "xxh3_128", "xxh3_128": "xxh3_128", "xxh3_64": "xxh3_64", "sha256": "sha256"}


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


def checksum_algo(checksums: "bool | str | None") -> str:
    """The wire algorithm for push_weights' `checksums` ("" for none)."""
    if checksums is True:
        return "xxh3_128"
    if not checksums:
        return ""
    try:
        return CHECKSUMS[checksums]
    except KeyError:
        raise ValueError(f"checksums must be one of {sorted(CHECKSUMS)}, True or False; got {checksums!r}") from None


def manifest(tensors: list[FlatTensor], with_checksums: "bool | str" = True) -> list[pb.TensorSpec]:
    """The manifest; `with_checksums` names the algorithm (see checksum_algo).
    sha256 fills TensorSpec.sha256 (old services verify it), the others
    TensorSpec.digest (the header's checksum_algo names them)."""
    algo = checksum_algo(with_checksums)
    specs = []
    for t in tensors:
        spec = pb.TensorSpec(name=t.name, dtype=t.dtype, shape=list(t.shape), byte_length=len(t.data))
        if algo == "sha256":
            spec.sha256 = hexdigest("sha256", t.data)
        elif algo:
            spec.digest = hexdigest(algo, t.data)
        specs.append(spec)
    return specs


# Hashed in pieces of this size: a cancelled push stops hashing soon, and
# python-xxhash (the fallback, which holds the GIL) lets the stream run between.
_HASH_PIECE = 16 * 1024 * 1024


def digests(tensors: list[FlatTensor], algo: str, stop=None) -> list[str]:
    """Each tensor's hex digest under `algo`, for a WeightsTrailer (blocks,
    mostly without the GIL: run it on a thread while the chunks stream).
    Returns early (incomplete) once the `stop` event is set."""
    out = []
    for t in tensors:
        h = new_hasher(algo)
        for offset in range(0, len(t.data), _HASH_PIECE):
            if stop is not None and stop.is_set():
                return out
            h.update(t.data[offset : offset + _HASH_PIECE])
        out.append(h.hexdigest())
    return out


def chunks(header: pb.WeightsHeader, tensors: list[FlatTensor], chunk_bytes: int) -> Iterator[object]:
    """The header, then chunks of `chunk_bytes` (the last one shorter) as
    lists of memoryviews into the tensors: a chunk may span tensors, so
    small tensors do not make small messages. For `serialize_chunk`."""
    yield pb.WeightsChunk(header=header)
    pieces: list[memoryview] = []
    size = 0
    for t in tensors:
        data, offset = t.data, 0
        while offset < len(data):
            take = min(chunk_bytes - size, len(data) - offset)
            pieces.append(data[offset : offset + take])
            size += take
            offset += take
            if size == chunk_bytes:
                yield pieces
                pieces, size = [], 0
    if pieces:
        yield pieces


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def serialize_chunk(chunk: object) -> bytes:
    """A WeightsChunk on the wire: a message as protobuf serializes it, or
    a list of buffers as the field `data` (tag 2) holding their bytes, with
    one copy (the join)."""
    if isinstance(chunk, pb.WeightsChunk):
        return chunk.SerializeToString()
    size = sum(len(p) for p in chunk)
    return b"".join([b"\x12" + _varint(size), *chunk])
