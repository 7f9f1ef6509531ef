"""Receiving a weight push: header -> target, bytes from a file or the
stream, assembly, verification, staging; then applying it on the engines.

`PushWeights` (servicer.py) is a thin RPC over `WeightsReceiver`. What can
go wrong maps to one exception each, which the RPC turns into a status:

1. the request is wrong (header, manifest, bytes, file): `FieldError` /
   `ManifestError` / `WeightsRejected` / `CoreError` -> INVALID_ARGUMENT
   (a file push where none is allowed: FAILED_PRECONDITION; outside the
   allowed directories: PERMISSION_DENIED; both name `weights_file_dirs`);
2. the sender goes quiet: `PushStalled` -> DEADLINE_EXCEEDED;
3. an engine does not apply the weights in time: `ApplyTimedOut` ->
   DEADLINE_EXCEEDED;
4. an engine fails while applying them: `ApplyFailed` -> UNAVAILABLE.

In cases 3 and 4 the serving version is unchanged, and the message names
the engines that did not reach the pushed version.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterable, Awaitable, Callable

from rollout_proto import rollout_pb2 as pb
from rollout_service.api import convert
from rollout_service.api.validation import FieldError
from rollout_service.core.rollout import RolloutCore
from rollout_service.engines.base import EngineError
from rollout_service.engines.weights import (
    CHECKSUM_ALGOS,
    ManifestError,
    PinnedFile,
    StagedWeights,
    StagingWriter,
    TensorSpec,
    check_manifest,
    read_weights_file,
    split_and_verify,
)
from rollout_service.lifecycle.types import CoreError

if TYPE_CHECKING:
    from rollout_service.drafter.runtime import SpecRuntime

TARGETS = ("policy", "draft")
# Chunks handed to the writer thread and not yet written: bounds the memory a
# push holds beyond its staging file (gRPC flow control holds back the rest).
MAX_CHUNKS_IN_FLIGHT = 4
# PushWeights' initial metadata once a streamed push's header is accepted.
PUSH_ACCEPTED = (("rollout-push-accepted", "1"),)
# A push refused in the middle of its data: what the sender still streams is
# read and dropped for at most this long before the refusal is returned.
REFUSAL_DRAIN_S = 30.0
# Threads that read and verify pushed files, apart from the default pool
# (Submit, weight staging and engine restarts): a file whose reads block
# (a hung network mount) holds one of these, never one of theirs.
WEIGHT_FILE_THREADS = 2
_file_pool: ThreadPoolExecutor | None = None


def _file_io(fn, *args) -> asyncio.Future:
    global _file_pool
    if _file_pool is None:
        _file_pool = ThreadPoolExecutor(WEIGHT_FILE_THREADS, thread_name_prefix="weights-file")
    return asyncio.get_running_loop().run_in_executor(_file_pool, fn, *args)


def parse_chunk(raw: bytes) -> "pb.WeightsChunk | memoryview":
    """The request deserializer of PushWeights: a data message (the field
    `data`, tag 2, alone) becomes a memoryview of its bytes inside the
    message gRPC received, without protobuf's copy; anything else (the
    header, odd encodings) is parsed as a WeightsChunk."""
    if len(raw) > 2 and raw[0] == 0x12:
        n, shift, pos = 0, 0, 1
        while pos < len(raw) and pos < 11:
            b = raw[pos]
            n |= (b & 0x7F) << shift
            pos += 1
            if not b & 0x80:
                if pos + n == len(raw):
                    return memoryview(raw)[pos:]
                break
            shift += 7
    return pb.WeightsChunk.FromString(raw)


def _data(msg) -> memoryview:
    """A data message's bytes (from `parse_chunk`, or a parsed WeightsChunk)."""
    if isinstance(msg, memoryview):
        return msg
    if msg.WhichOneof("kind") != "data":
        raise FieldError("header", "only one WeightsHeader may be sent, at the start")
    return memoryview(msg.data)


class PushStalled(Exception):
    """The sender sent nothing for longer than the idle timeout."""


class ApplyTimedOut(Exception):
    """An engine did not apply the weights within its update timeout."""


class ApplyFailed(Exception):
    """An engine failed (died, lost its connection) while applying weights."""


@dataclass(slots=True)
class ReceivedWeights:
    """A verified, staged push, ready to apply. `bytes_received` counts the
    tensor bytes (streamed, or read from the file)."""

    target: str  # "policy" or "draft"
    version: int
    staged: StagedWeights
    bytes_received: int


class WeightsReceiver:
    """Receives and applies weight pushes for one core (and its speculative
    decoding runtime, for `target="draft"`)."""

    def __init__(self, core: RolloutCore, max_weights_bytes: int, push_idle_timeout_s: float = 30.0,
                 spec_runtime: "SpecRuntime | None" = None, file_dirs: "list[str] | tuple[str, ...]" = ()) -> None:
        self.core = core
        # Where file pushes may read (resolved): none, no file pushes.
        self.file_dirs = tuple(os.path.realpath(d) for d in file_dirs)
        self.max_weights_bytes = max_weights_bytes
        self.push_idle_timeout_s = push_idle_timeout_s
        self.spec_runtime = spec_runtime
        self.last_draft: StagedWeights | None = None  # the serving draft push

    async def receive(self, messages: AsyncIterable[pb.WeightsChunk],
                      accepted: "Callable[[], Awaitable[None]] | None" = None) -> ReceivedWeights:
        """Read a push: a `WeightsHeader` first, then either nothing (the
        header names a same-host safetensors `file_path`) or the tensors'
        bytes as data messages. Checks the manifest against the target model
        before any byte is buffered, then every tensor's checksum.
        `accepted` is awaited once the header of a streamed push has passed
        (the RPC sends its initial metadata: a sender may wait for it before
        streaming, so that a refusal reaches it as the refusal's status, not
        as a failed write)."""
        first = await anext(aiter(messages), None)
        if first is None or isinstance(first, memoryview) or first.WhichOneof("kind") != "header":
            raise FieldError("header", "the first message of PushWeights must be a WeightsHeader")
        header = first.header
        target = self._target(header.target)
        if header.checksum_algo not in ("", *CHECKSUM_ALGOS):
            raise FieldError("header.checksum_algo", f"unknown checksum algorithm {header.checksum_algo!r}; "
                             f"allowed: {', '.join(CHECKSUM_ALGOS)} (empty: sha256)")
        check = self.spec_runtime.check_draft_weights if target == "draft" else self.core.check_weights
        if header.file_path:
            path = self.allowed_file(header.file_path)
            specs, buffer, pinned = await self._read_file(header.file_path, path)
            try:
                if header.tensors:
                    specs = _match_file_manifest(convert.tensor_specs(header), specs)
                check_manifest(specs, self.max_weights_bytes)
                check(header.version, {s.name: (s.dtype, s.shape) for s in specs})
                tensors = await _file_io(split_and_verify, specs, buffer)
            except BaseException:
                pinned.close()
                raise
            staged = StagedWeights(tensors, source_path=path, pinned=pinned)
            return ReceivedWeights(target, header.version, staged, len(buffer))
        specs = convert.tensor_specs(header)
        total = check_manifest(specs, self.max_weights_bytes)
        check(header.version, {s.name: (s.dtype, s.shape) for s in specs})
        # A checksum algorithm and no checksum in the manifest: the digests follow the data.
        trailer_algo = header.checksum_algo if header.checksum_algo and not any(s.checks() for s in specs) else ""
        if accepted is not None:
            await accepted()
        stream = _with_idle_timeout(messages, self.push_idle_timeout_s)
        try:
            staged = await _receive_into_file(stream, specs, trailer_algo)
        except (FieldError, ManifestError):
            await _drain(stream, REFUSAL_DRAIN_S)
            raise
        return ReceivedWeights(target, header.version, staged, total)

    async def apply(self, weights: ReceivedWeights) -> int:
        """Serve `weights` on every engine; returns the version applied.
        Raises ApplyTimedOut or ApplyFailed (naming the engines that did not
        reach the version) when an engine times out or fails; the serving
        version is then unchanged."""
        try:
            if weights.target == "draft":
                version = await self.spec_runtime.push_draft_weights(weights.version, weights.staged)
                # The superseded draft push's staging file (the core does the same for the policy's).
                previous, self.last_draft = self.last_draft, weights.staged
                if previous is not None and previous is not weights.staged:
                    previous.cleanup()
                return version
            return await self.core.update_weights(weights.version, weights.staged)
        # TimeoutError first: since Python 3.11 it is asyncio's, and an OSError.
        except TimeoutError as exc:
            weights.staged.cleanup()
            raise ApplyTimedOut(self._failure(weights, "did not apply it within the update timeout", exc)) from exc
        except (EngineError, OSError) as exc:
            weights.staged.cleanup()
            raise ApplyFailed(self._failure(weights, "failed applying it", exc)) from exc
        except BaseException:
            weights.staged.cleanup()  # e.g. the version check: the staging file must not outlive the push
            raise

    def _target(self, target: str) -> str:
        if target not in ("", *TARGETS):
            raise FieldError("header.target", f"must be 'policy' or 'draft', got {target!r}")
        if target == "draft" and self.spec_runtime is None:
            raise FieldError("header.target", "'draft': the engines do not speculate (engine.spec is off)")
        return target or "policy"

    def _failure(self, weights: ReceivedWeights, what: str, exc: BaseException) -> str:
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if weights.target == "draft":  # draft versions are not in the engines' loads; the error names the engine
            return (f"draft weights version {weights.version}: an engine {what} ({detail}); "
                    f"still serving draft version {self.spec_runtime.draft_version}")
        # Engines that are down get the weights when they come back: not named.
        behind = [e.load.engine_id for e in self.core.status().engines
                  if e.load.policy_version != weights.version and e.load.state != "dead"]
        return (f"policy weights version {weights.version}: engine(s) {', '.join(behind) or '?'} {what} "
                f"({detail}); still serving version {self.core.policy_version}")


    def allowed_file(self, path: str) -> str:
        """`path` resolved (symlinks followed), if it lies under a directory
        listed in `weights_file_dirs`; CoreError naming the key otherwise."""
        if not self.file_dirs:
            raise CoreError("failed_precondition", "header.file_path: file pushes are off: list the directories "
                            "they may read in the configuration key weights_file_dirs, or stream the weights")
        real = os.path.realpath(path)
        if not any(os.path.commonpath([real, d]) == d for d in self.file_dirs):
            raise CoreError("permission_denied", f"header.file_path: {path!r} is outside the directories listed "
                            "in weights_file_dirs (symlinks resolved)")
        return real

    async def _read_file(self, given: str, path: str) -> tuple[list[TensorSpec], memoryview, PinnedFile]:
        """The same-host fast path: the file's manifest, tensor bytes and
        pin, read on the weight-file threads within the push idle timeout.
        Only file errors are the request's fault; they name the path given."""
        future = _file_io(read_weights_file, path, self.max_weights_bytes, False, given)
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.push_idle_timeout_s)
        except TimeoutError:
            future.add_done_callback(_close_late)
            raise PushStalled(f"header.file_path: {given!r} not read within {self.push_idle_timeout_s:g} s "
                              "(push_idle_timeout_s): push abandoned, the serving version is unchanged") from None
        except ManifestError:
            raise
        except OSError as exc:  # missing, a directory, not permitted, a name too long, ...
            why = ("it is a symlink swapped in after it was resolved" if exc.errno == errno.ELOOP
                   else exc.strerror or type(exc).__name__)
            raise FieldError("header.file_path", f"cannot read {given[:300]!r}: {why}") from None
        except (ValueError, KeyError, IndexError, TypeError, struct.error, json.JSONDecodeError) as exc:
            raise FieldError("header.file_path", f"{given[:300]!r} is not a safetensors file ({exc})") from None


def _close_late(future: asyncio.Future) -> None:
    """Close what a file read abandoned on time-out opened, once it returns."""
    if not future.cancelled() and future.exception() is None:
        future.result()[2].close()


async def _receive_into_file(messages: AsyncIterable, specs: list[TensorSpec],
                             trailer_algo: str = "") -> StagedWeights:
    """The data messages' bytes, exactly the manifest's total, written as
    they arrive into the staging file and hashed per tensor (StagingWriter),
    on one writer thread while the event loop receives the next chunks; a
    bad checksum in the manifest fails at the tensor it names, before the
    stream ends. With `trailer_algo`, a WeightsTrailer after the data
    carries the digests, checked against the tensors' own."""
    # Made here, not in a thread: a cancellation (the sender gone) between
    # the file's creation and this frame holding it would leak the file.
    writer = StagingWriter(specs, trailer_algo=trailer_algo)  # a few syscalls (create, header, truncate)
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(1, thread_name_prefix="weights-writer")
    pending: collections.deque[asyncio.Future] = collections.deque()
    received = 0
    trailer: "pb.WeightsTrailer | None" = None
    try:
        async for msg in messages:
            if trailer is not None:
                raise FieldError("trailer", "the WeightsTrailer must be the push's last message")
            if not isinstance(msg, memoryview) and msg.WhichOneof("kind") == "trailer":
                if not trailer_algo:
                    raise FieldError("trailer", "a WeightsTrailer is only sent when the header's checksum_algo is "
                                     "set and its tensors carry no checksum")
                if received != writer.total:
                    raise FieldError("trailer", f"the WeightsTrailer came after {received} of the manifest's "
                                     f"{writer.total} bytes; it follows all the data")
                trailer = msg.trailer
                continue
            data = _data(msg)
            received += len(data)
            if received > writer.total:
                raise FieldError("data", f"the stream carries more than the manifest's {writer.total} bytes")
            pending.append(loop.run_in_executor(pool, writer.feed, data))
            while pending and (pending[0].done() or len(pending) > MAX_CHUNKS_IN_FLIGHT):
                await pending.popleft()
        while pending:
            await pending.popleft()
        if received != writer.total:
            raise FieldError("data", f"the stream ended after {received} of the manifest's {writer.total} bytes")
        if trailer_algo:
            if trailer is None:
                raise FieldError("trailer", "the stream ended without the WeightsTrailer (the header's "
                                 "checksum_algo is set and its tensors carry no checksum: the digests follow the data)")
            writer.verify_trailer(list(trailer.digests))
        return writer.finish()
    except BaseException:
        try:
            for fut in pending:  # let the writer thread finish before the file goes
                with contextlib.suppress(Exception):
                    await fut
        finally:
            writer.abort()
        raise
    finally:
        pool.shutdown(wait=False)


async def _drain(stream, limit_s: float) -> None:
    """Read and drop the rest of a refused push (at most `limit_s`): a status
    returned while the sender is still writing races its next write, and the
    sender then gets that write's failure (INTERNAL) instead of the refusal."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(limit_s):
            async for _ in stream:
                pass


async def _with_idle_timeout(iterator, timeout_s: float):
    """The stream's messages; PushStalled when the sender goes quiet for
    longer than `timeout_s` (a stalled trainer must not hold a push forever)."""
    it = aiter(iterator)
    while True:
        try:
            msg = await asyncio.wait_for(anext(it), timeout_s)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise PushStalled(f"no data for {timeout_s:g} s: push abandoned, the serving version is unchanged") from None
        yield msg


def _match_file_manifest(sent: list[TensorSpec], found: list[TensorSpec]) -> list[TensorSpec]:
    """Check a sent manifest against a file's; returns the file's specs (in
    file order) carrying the sent checksums."""
    by_name = {s.name: s for s in found}
    for i, s in enumerate(sent):
        f = by_name.get(s.name)
        if f is None:
            raise ManifestError(f"header.tensors[{i}].name", f"{s.name!r} is not in the file")
        if (f.dtype, f.shape) != (s.dtype, s.shape):
            raise ManifestError(f"header.tensors[{i}].shape", f"{s.name!r} is {f.dtype}{list(f.shape)} in the file")
    if len(sent) != len(found):
        raise ManifestError("header.tensors", f"the file holds {len(found)} tensors, the manifest lists {len(sent)}")
    sums = {s.name: s for s in sent}
    return [TensorSpec(f.name, f.dtype, f.shape, f.byte_length, sums[f.name].sha256, sums[f.name].digest,
                       sums[f.name].algo) for f in found]
