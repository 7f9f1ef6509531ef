"""Weight manifests and their verification, independent of any framework.

A push is a manifest (name, dtype, shape, byte length, checksums per
tensor: a sha256 and/or a digest under the push's algorithm, see
`CHECKSUM_ALGOS`) followed by the tensors' bytes in manifest order (and, when
the manifest names an algorithm but carries no checksum, the digests after the
bytes). Nothing is applied before every length and checksum has verified;
engines turn `WeightTensor`s into whatever their framework needs.

`StagingWriter` receives a streamed push straight into its staging file (a
safetensors file in /dev/shm): each chunk is hashed as it arrives and written
once, at its final place; no buffer, no split.
"""
from __future__ import annotations

import atexit
import json
import math
import mmap
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

# CHECKSUM_ALGOS: the algorithms of TensorSpec.digest -> length of their hex
# digest; their hashers (xxh3 through xxHash's C library, without the GIL).
# Both ends of a push share them and the dtype sizes (rollout_proto).
from rollout_proto.checksums import ALGOS as CHECKSUM_ALGOS
from rollout_proto.checksums import hexdigest, new_hasher
from rollout_proto.dtypes import DTYPE_SIZES
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
    digest: str = ""  # hex, under `algo`
    algo: str = "sha256"

    def checks(self) -> list[tuple[str, str, str]]:
        """(field, algo, expected hex digest) of each checksum to verify."""
        out = []
        if self.sha256:
            out.append(("sha256", "sha256", self.sha256))
        if self.digest and not (self.algo == "sha256" and self.digest == self.sha256):
            out.append(("digest", self.algo, self.digest))
        return out


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
        if s.sha256 and not _is_hex(s.sha256, 64):
            raise ManifestError(f"{f}.sha256", "must be 64 lowercase hex digits")
        if s.digest:
            if s.algo not in CHECKSUM_ALGOS:
                raise ManifestError("header.checksum_algo", f"unknown checksum algorithm {s.algo!r}; allowed: {sorted(CHECKSUM_ALGOS)}")
            if not _is_hex(s.digest, CHECKSUM_ALGOS[s.algo]):
                raise ManifestError(f"{f}.digest", f"a {s.algo} digest is {CHECKSUM_ALGOS[s.algo]} lowercase hex digits")
        total += expected
    if total > max_bytes:
        raise ManifestError("header.tensors", f"{total} bytes exceed the limit of {max_bytes} bytes")
    return total


def _is_hex(text: str, length: int) -> bool:
    return len(text) == length and all(c in "0123456789abcdef" for c in text)


def _mismatch(i: int, spec: TensorSpec, field: str, algo: str) -> ManifestError:
    return ManifestError(f"header.tensors[{i}].{field}", f"checksum mismatch for {spec.name!r} ({algo})")


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
        for field, algo, expected in s.checks():
            if hexdigest(algo, chunk) != expected:
                raise _mismatch(i, s, field, algo)
        out.append(WeightTensor(s.name, s.dtype, s.shape, chunk))
    return out


MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # bytes of JSON header (safetensors' own limit)
_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


class WeightsChanged(RuntimeError):
    """A pushed weights file changed after it was verified: its bytes are no
    longer the version it was pushed as."""


class PinnedFile:
    """A pushed file as it was verified: held open, with its identity (device,
    inode, size, mtime; and its ctime, which a write or a `utime` changes,
    while it is still linked: unlinking it changes the ctime too)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        st = os.fstat(fd)
        self.key, self.ctime = self._key(st), st.st_ctime_ns

    @staticmethod
    def _key(st: os.stat_result) -> tuple:
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns

    def _unchanged(self) -> bool:
        st = os.fstat(self.fd)
        return self._key(st) == self.key and (st.st_nlink == 0 or st.st_ctime_ns == self.ctime)

    def still_at(self, path: str) -> bool:
        """Whether `path` still holds the verified bytes (False: it was
        removed or replaced, and the verified bytes are only in the pinned
        inode). WeightsChanged when the pinned inode itself was written."""
        if self.fd < 0 or not self._unchanged():
            raise WeightsChanged(f"the pushed file {path!r} changed after it was verified (size, mtime or ctime): "
                                 "its bytes are not the version it was pushed as; push the weights again")
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self.key[:2]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def describe_kind(mode: int) -> str:
    """What a non-regular file is, in words ("a FIFO", ...)."""
    return next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")


def read_weights_file(path: str, max_bytes: int | None = None, follow_symlinks: bool = False,
                      shown: str | None = None) -> tuple[list[TensorSpec], memoryview, PinnedFile]:
    """Open a safetensors file without blocking (a FIFO or a device is
    refused, named, before any read), check its header's sizes against the
    file's (and `max_bytes`), then map it. Returns its manifest (without
    checksums), a buffer of the tensors in manifest order, and the file
    pinned as opened. ManifestError naming `header.file_path` for a file
    that is not a regular safetensors file; OSError for what `open` raises
    (ELOOP for a symlink, unless `follow_symlinks`). Messages name the file
    as `shown` (default: `path`)."""
    shown = shown or path
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ManifestError("header.file_path", f"{shown!r} is {describe_kind(st.st_mode)}, not a regular file")
        specs, start, end = _safetensors_layout(fd, st.st_size, shown)
        total = end - start
        if max_bytes is not None and total > max_bytes:
            raise ManifestError("header.file_path", f"{shown!r} holds {total} bytes of tensors, over the limit of "
                                f"{max_bytes} bytes")
        pinned = PinnedFile(fd)
        mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if st.st_size else None
    except BaseException:
        os.close(fd)
        raise
    view = memoryview(mapped) if mapped is not None else memoryview(b"")
    return specs, view[start:end], pinned


def _safetensors_layout(fd: int, size: int, path: str) -> tuple[list[TensorSpec], int, int]:
    """A safetensors file's manifest (in data order) and the byte range of
    its tensors, read with `pread`; every size is checked against the file's
    `size` before the header is read."""
    def bad(why: str) -> ManifestError:
        return ManifestError("header.file_path", f"{path!r} is not a safetensors file ({why})")

    if size < 8:
        raise bad(f"{size} bytes")
    (header_len,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if header_len > min(size - 8, MAX_SAFETENSORS_HEADER):
        raise bad(f"a header of {header_len} bytes in a file of {size}")
    try:
        header = json.loads(os.pread(fd, header_len, 8))
        header.pop("__metadata__", None)
        items = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
        base, specs, offset = 8 + header_len, [], None
        for name, meta in items:
            dtype = _SAFETENSORS_DTYPES.get(meta["dtype"])
            if dtype is None:
                raise ManifestError("header.file_path", f"tensor {name!r} has unsupported dtype {meta['dtype']}")
            lo, hi = (int(x) for x in meta["data_offsets"])
            if not (0 <= lo <= hi and base + hi <= size) or (offset is not None and lo != offset):
                raise bad(f"tensor {name!r} at bytes [{lo}, {hi}) of a data region of {size - base}")
            offset = hi
            specs.append(TensorSpec(name, dtype, tuple(int(d) for d in meta["shape"]), hi - lo))
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        raise bad(f"{type(exc).__name__}: {exc}") from None
    if not items:
        return specs, base, base
    return specs, base + items[0][1]["data_offsets"][0], base + offset


def read_safetensors(path: str) -> tuple[list[TensorSpec], memoryview]:
    """Map a safetensors file (see `read_weights_file`); returns its
    manifest (without checksums) and a buffer of the tensors in manifest order."""
    specs, view, pinned = read_weights_file(path, follow_symlinks=True)
    pinned.close()  # the mapping keeps the bytes
    return specs, view


_TO_SAFETENSORS = {v: k for k, v in _SAFETENSORS_DTYPES.items()}


def _safetensors_header(entries) -> bytes:
    """The 8-byte length and JSON header of a safetensors file holding
    (name, dtype, shape, byte_length) entries in order."""
    header: dict[str, object] = {}
    offset = 0
    for name, dtype, shape, n in entries:
        header[name] = {"dtype": _TO_SAFETENSORS[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(path: str, tensors: list[WeightTensor]) -> None:
    """Write tensors as a safetensors file (no framework needed)."""
    with open(path, "wb") as f:
        f.write(_safetensors_header((t.name, t.dtype, t.shape, len(t.data)) for t in tensors))
        f.writelines(t.data for t in tensors)


_STAGING_DIR: list[str] = []  # `staging_dir` (set_staging_dir); empty: /dev/shm where there is one


def set_staging_dir(path: str) -> None:
    """Stage pushed weights in `path` ("": /dev/shm, else the temporary
    directory). Raises ValueError if it is not a writable directory."""
    _STAGING_DIR.clear()
    if path:
        if not os.path.isdir(path) or not os.access(path, os.W_OK):
            raise ValueError(f"staging_dir: {path!r} is not a writable directory")
        _STAGING_DIR.append(path)


def _staging_dir() -> str | None:
    if _STAGING_DIR:
        return _STAGING_DIR[0]
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def check_staging_room(nbytes: int) -> None:
    """Raise WeightsRejected, naming `staging_dir`, when its file system has
    less than `nbytes` free: a push that would fill /dev/shm part way through
    fails at its start instead (a staging file is sparse until written)."""
    import shutil
    import tempfile

    where = _staging_dir() or tempfile.gettempdir()
    free = shutil.disk_usage(where).free
    if free < nbytes:
        from rollout_service.engines.base import WeightsRejected

        raise WeightsRejected(
            f"staging_dir: {where} has {free / 2**30:.2f} GiB free, the push needs {nbytes / 2**30:.2f} GiB; set "
            "staging_dir to a directory with room (in a container: ipc: host, or shm_size above the largest push)")


# The staging file of a superseded push, kept (with its memory pages) for the
# next push to receive into: writing into fresh shared-memory pages costs
# about twice as much CPU as rewriting allocated ones (the kernel allocates
# and zeroes each page). At most one; `drop_spare()` releases it.
_spare: list[str] = []


def _recycle(path: str) -> None:
    """Keep `path` as the spare staging file (replacing an older spare)."""
    import tempfile

    drop_spare()
    fd, spare = tempfile.mkstemp(prefix="rollout-weights-spare-", suffix=".safetensors", dir=os.path.dirname(path))
    os.close(fd)
    os.replace(path, spare)
    _spare.append(spare)


def _spare_size() -> int:
    try:
        return os.path.getsize(_spare[0])
    except OSError:
        return 0


def drop_spare() -> None:
    """Remove the spare staging file (at shutdown; or to give back its memory)."""
    while _spare:
        try:
            os.unlink(_spare.pop())
        except FileNotFoundError:
            pass


atexit.register(drop_spare)


class StagingWriter:
    """Receives a push's bytes, in order and in chunks of any size, straight
    into a new staging safetensors file: every chunk is written once at its
    final offset (`os.pwrite`, no user-space copy) and hashed per tensor as
    it arrives; a tensor's checksums are verified as soon as its last byte
    has come, so a corrupt tensor fails the push at once, named.

    With `trailer_algo`, the digests come after the data (a WeightsTrailer):
    every tensor is hashed under that algorithm as it arrives, and
    `verify_trailer` checks the digests once they have come.

    `feed` blocks (hashing, the write; both release the GIL): call it from
    one thread at a time, in stream order. `finish` returns the
    `StagedWeights` (which owns the file); `abort` removes the file."""

    def __init__(self, specs: list[TensorSpec], prefix: str = "rollout-weights-", trailer_algo: str = "") -> None:
        import tempfile

        self.specs = specs
        self.trailer_algo = trailer_algo
        self.computed: list[str] = []  # with trailer_algo: each completed tensor's digest
        self.total = sum(s.byte_length for s in specs)
        self.received = 0
        self.prefix = prefix
        head = _safetensors_header((s.name, s.dtype, s.shape, s.byte_length) for s in specs)
        check_staging_room(len(head) + self.total - (_spare_size() if _spare else 0))
        fd, self.path = tempfile.mkstemp(prefix=prefix, suffix=".safetensors", dir=_staging_dir())
        if _spare:  # reuse a superseded push's pages (see _recycle)
            try:
                os.replace(_spare.pop(), self.path)
                os.close(fd)
                fd = os.open(self.path, os.O_RDWR)
            except OSError:
                pass
        self._fd = fd
        try:
            os.pwrite(fd, head, 0)
            os.ftruncate(fd, len(head) + self.total)
        except BaseException:
            self.abort()
            raise
        self._base = len(head)
        self._i = -1  # the tensor being received
        self._left = 0  # its bytes still to come
        self._hashers: list = []
        self._failed: BaseException | None = None
        self._next_tensor()

    def _next_tensor(self) -> None:
        """Verify the tensor just completed and start the next one (past any empty ones)."""
        while self._left == 0:
            if self._i >= 0:
                spec = self.specs[self._i]
                if self.trailer_algo:
                    self.computed.append(self._hashers[0].hexdigest())
                else:
                    for (field, algo, expected), h in zip(spec.checks(), self._hashers):
                        if h.hexdigest() != expected:
                            raise _mismatch(self._i, spec, field, algo)
            self._i += 1
            if self._i >= len(self.specs):
                self._hashers = []
                return
            spec = self.specs[self._i]
            self._left = spec.byte_length
            if self.trailer_algo:
                self._hashers = [new_hasher(self.trailer_algo)]
            else:
                self._hashers = [new_hasher(algo) for _, algo, _ in spec.checks()]

    def feed(self, data) -> None:
        if self._failed is not None:
            raise self._failed
        try:
            self._feed(memoryview(data))
        except BaseException as exc:
            self._failed = exc
            raise

    def _feed(self, data: memoryview) -> None:
        n = len(data)
        if self.received + n > self.total:
            raise ManifestError("data", f"the stream carries more than the manifest's {self.total} bytes")
        done = 0
        while done < n:  # pwrite may write less than asked
            done += os.pwrite(self._fd, data[done:], self._base + self.received + done)
        pos = 0
        while pos < n:
            take = min(self._left, n - pos)
            if self._hashers:
                part = data[pos : pos + take]
                for h in self._hashers:
                    h.update(part)
            pos += take
            self._left -= take
            if self._left == 0:
                self._next_tensor()
        self.received += n

    def verify_trailer(self, digests: list[str]) -> None:
        """Check the trailer's digests (after every byte has been fed)
        against the tensors' own; ManifestError names the first bad one."""
        algo = self.trailer_algo
        if len(digests) != len(self.specs):
            raise ManifestError("trailer.digests", f"{len(digests)} digests for the manifest's {len(self.specs)} tensors")
        for i, (spec, sent) in enumerate(zip(self.specs, digests)):
            if not _is_hex(sent, CHECKSUM_ALGOS[algo]):
                raise ManifestError(f"trailer.digests[{i}]", f"a {algo} digest is {CHECKSUM_ALGOS[algo]} lowercase hex digits")
        for i, (spec, sent, got) in enumerate(zip(self.specs, digests, self.computed)):
            if sent != got:
                raise ManifestError(f"trailer.digests[{i}]", f"checksum mismatch for {spec.name!r} ({algo})")

    def finish(self) -> "StagedWeights":
        """The staged push (the tensors are views of the mapped file)."""
        if self.received != self.total:
            raise ManifestError("data", f"the stream ended after {self.received} of the manifest's {self.total} bytes")
        mapped = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ) if self._base + self.total else None
        os.close(self._fd)
        self._fd = -1
        view = memoryview(mapped) if mapped is not None else memoryview(b"")
        tensors, offset = [], self._base
        for s in self.specs:
            tensors.append(WeightTensor(s.name, s.dtype, s.shape, view[offset : offset + s.byte_length]))
            offset += s.byte_length
        return StagedWeights(tensors, source_path=self.path, prefix=self.prefix, owned=True, recycle=True)

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


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
    the push already came as a file (the same-host fast path). Such a file
    is `pinned` as verified: every re-read checks it first (see `as_file`)."""

    def __init__(self, tensors: list[WeightTensor], source_path: str | None = None,
                 prefix: str = "rollout-weights-", owned: bool = False, recycle: bool = False,
                 pinned: PinnedFile | None = None) -> None:
        self.tensors = tensors
        self._pinned = pinned
        self.prefix = prefix  # of the staging file's name
        self._path = source_path
        self._owned = owned  # cleanup() removes source_path
        self._recycle = recycle  # ... or keeps it for the next push to receive into (StagingWriter's files)
        self._lock = None

    @property
    def path(self) -> str | None:
        """The staged (or pushed) safetensors file, None before `as_file()`
        or after `cleanup()`."""
        return self._path

    @property
    def total_bytes(self) -> int:
        return sum(len(t.data) for t in self.tensors)

    def _pushed_file_gone(self) -> bool:
        """Whether the pushed file no longer holds the verified bytes at its
        path (removed, or replaced: the pinned inode still holds them, and
        the tensors map it). WeightsChanged when the verified bytes were
        overwritten in place: they cannot be served under their version."""
        if self._pinned is not None:
            return not self._pinned.still_at(self._path)
        return not os.path.exists(self._path)

    async def as_file(self) -> str:
        """A safetensors file of the verified tensors: the pushed file while
        it still holds them, else a staging copy of them."""
        import asyncio

        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._path is not None and self._pushed_file_gone():
                self._path = None  # stage our own copy
            if self._path is None:
                import tempfile

                fd, path = tempfile.mkstemp(prefix=self.prefix, suffix=".safetensors", dir=_staging_dir())
                os.close(fd)
                await asyncio.to_thread(write_safetensors, path, self.tensors)
                self._path, self._owned = path, True
                self._unpin()
            return self._path

    def path_now(self) -> str:
        """The staged file's path if it exists (see as_file), else write one
        synchronously (used at shutdown)."""
        if self._path is None or self._pushed_file_gone():
            import tempfile

            fd, path = tempfile.mkstemp(prefix=self.prefix, suffix=".safetensors")
            os.close(fd)
            write_safetensors(path, self.tensors)
            self._path, self._owned = path, True
            self._unpin()
        return self._path

    def _unpin(self) -> None:
        if self._pinned is not None:
            self._pinned.close()
            self._pinned = None

    def cleanup(self) -> None:
        """Remove the staging file we own (the tensors' views must no longer
        be read: a received push's file may be reused by the next push)."""
        self._unpin()
        if self._owned and self._path:
            try:
                if self._recycle:
                    _recycle(self._path)
                else:
                    os.unlink(self._path)
            except FileNotFoundError:
                pass
            self._path, self._owned = None, False
