"""Weight manifests and their verification, independent of any framework.

A push is a manifest (name, dtype, shape, byte length, sha256 per tensor)
followed by the tensors' bytes in manifest order. Nothing is applied before
every length and checksum has verified; engines turn `WeightTensor`s into
whatever their framework needs.
"""
from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

DTYPE_SIZES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
_SAFETENSORS_DTYPES = {
    "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}


class ManifestError(ValueError):
    """A manifest or its bytes are wrong; `field` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(slots=True, frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    byte_length: int
    sha256: str = ""


@dataclass(slots=True)
class WeightTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    data: memoryview  # raw little-endian bytes, byte_length long


def check_manifest(specs: list[TensorSpec], max_bytes: int) -> int:
    """Validate a manifest; returns its total byte length."""
    if not specs:
        raise ManifestError("header.tensors", "the manifest lists no tensors")
    seen: set[str] = set()
    total = 0
    for i, s in enumerate(specs):
        f = f"header.tensors[{i}]"
        if not s.name:
            raise ManifestError(f"{f}.name", "must not be empty")
        if s.name in seen:
            raise ManifestError(f"{f}.name", f"duplicate tensor name {s.name!r}")
        seen.add(s.name)
        if s.dtype not in DTYPE_SIZES:
            raise ManifestError(f"{f}.dtype", f"unknown dtype {s.dtype!r}; allowed: {sorted(DTYPE_SIZES)}")
        if any(d < 0 for d in s.shape):
            raise ManifestError(f"{f}.shape", f"dimensions must be >= 0, got {list(s.shape)}")
        expected = math.prod(s.shape) * DTYPE_SIZES[s.dtype]
        if s.byte_length != expected:
            raise ManifestError(
                f"{f}.byte_length",
                f"{s.name!r} is {s.dtype}{list(s.shape)} = {expected} bytes, manifest says {s.byte_length}",
            )
        if s.sha256 and (len(s.sha256) != 64 or any(c not in "0123456789abcdef" for c in s.sha256)):
            raise ManifestError(f"{f}.sha256", "must be 64 lowercase hex digits")
        total += expected
    if total > max_bytes:
        raise ManifestError("header.tensors", f"{total} bytes exceed the limit of {max_bytes} bytes")
    return total


def split_and_verify(specs: list[TensorSpec], buffer: memoryview) -> list[WeightTensor]:
    """Cut a buffer into tensors and verify every checksum (CPU-bound: run
    it in a thread). Raises ManifestError naming the first bad tensor."""
    total = sum(s.byte_length for s in specs)
    if len(buffer) != total:
        raise ManifestError("data", f"stream carried {len(buffer)} bytes, the manifest needs {total}")
    out: list[WeightTensor] = []
    offset = 0
    for i, s in enumerate(specs):
        chunk = buffer[offset : offset + s.byte_length]
        offset += s.byte_length
        if s.sha256 and hashlib.sha256(chunk).hexdigest() != s.sha256:
            raise ManifestError(f"header.tensors[{i}].sha256", f"checksum mismatch for {s.name!r}")
        out.append(WeightTensor(s.name, s.dtype, s.shape, chunk))
    return out


def read_safetensors(path: str) -> tuple[list[TensorSpec], memoryview]:
    """Same-host fast path: map a safetensors file; returns its manifest
    (without checksums) and a buffer of the tensors in manifest order."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    (header_len,) = struct.unpack("<Q", mapped[:8])
    header = json.loads(bytes(mapped[8 : 8 + header_len]))
    header.pop("__metadata__", None)
    base = 8 + header_len
    items = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    specs = []
    for name, meta in items:
        dtype = _SAFETENSORS_DTYPES.get(meta["dtype"])
        if dtype is None:
            raise ManifestError("header.file_path", f"tensor {name!r} has unsupported dtype {meta['dtype']}")
        start, end = meta["data_offsets"]
        specs.append(TensorSpec(name, dtype, tuple(meta["shape"]), end - start))
    view = memoryview(mapped)
    start = items[0][1]["data_offsets"][0] if items else 0
    end = items[-1][1]["data_offsets"][1] if items else 0
    return specs, view[base + start : base + end]


_TO_SAFETENSORS = {v: k for k, v in _SAFETENSORS_DTYPES.items()}


def write_safetensors(path: str, tensors: list[WeightTensor]) -> None:
    """Write tensors as a safetensors file (no framework needed)."""
    header: dict[str, object] = {}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": _TO_SAFETENSORS[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(t.data)]}
        offset += len(t.data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors:
            f.write(t.data)


def checkpoint_manifest(model_dir: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{name: (dtype, shape)} of a model directory's safetensors files (headers only)."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        for name, meta in header.items():
            out[name] = (_SAFETENSORS_DTYPES.get(meta["dtype"], meta["dtype"]), tuple(meta["shape"]))
    return out


class StagedWeights:
    """A verified weight push, staged once for every engine of the fleet.

    Engines that load from files call `as_file()`: the tensors are written
    once to a staging file (in shared memory where the host has it) unless
    the push already came as a file (the same-host fast path)."""

    def __init__(self, tensors: list[WeightTensor], source_path: str | None = None,
                 prefix: str = "rollout-weights-") -> None:
        self.tensors = tensors
        self.prefix = prefix  # of the staging file's name
        self._path = source_path
        self._owned = False
        self._lock = None

    @property
    def path(self) -> str | None:
        """The staged (or pushed) safetensors file, None before `as_file()`
        or after `cleanup()`."""
        return self._path

    @property
    def total_bytes(self) -> int:
        return sum(len(t.data) for t in self.tensors)

    async def as_file(self) -> str:
        import asyncio

        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._path is not None and not os.path.exists(self._path):
                self._path = None  # the pushed file was removed: stage our own copy
            if self._path is None:
                import tempfile

                directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
                fd, path = tempfile.mkstemp(prefix=self.prefix, suffix=".safetensors", dir=directory)
                os.close(fd)
                await asyncio.to_thread(write_safetensors, path, self.tensors)
                self._path, self._owned = path, True
            return self._path

    def path_now(self) -> str:
        """The staged file's path if it exists (see as_file), else write one
        synchronously (used at shutdown)."""
        if self._path is None or not os.path.exists(self._path):
            import tempfile

            fd, path = tempfile.mkstemp(prefix=self.prefix, suffix=".safetensors")
            os.close(fd)
            write_safetensors(path, self.tensors)
            self._path, self._owned = path, True
        return self._path

    def cleanup(self) -> None:
        if self._owned and self._path:
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass
            self._path, self._owned = None, False
