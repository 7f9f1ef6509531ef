"""A write-ahead journal: framed records appended to one file, group commit.

Each record is `length (4 bytes) | crc32 (4 bytes) | payload` (little
endian). The payload is JSON, optionally followed by a newline and binary
data (packed token ids and logprobs; compact JSON holds no newline). The
first record is the header, JSON only in every format version: the format
version and the service's incarnation. Reading stops at the first record
that is not whole (a length past the end, a checksum that does not match):
that torn tail, what a crash mid-write leaves, is cut off.

Group commit: `append` buffers a record and returns at once; a writer
thread writes what is buffered (synchronously: O_DSYNC) at most every
`commit_interval_s`, so one disk sync makes many records durable. `commit()` waits until everything
appended before it is durable; `on_durable` callbacks learn each committed
sequence number (on the event loop); a write or fsync that fails stops the
journal, fails every `commit()` and is handed to `on_error`. `rewrite` replaces the whole file with a snapshot's
records atomically (temporary file, fsync, rename, fsync of the directory).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import struct
import threading
import time
import zlib
from pathlib import Path
from typing import Callable, Iterator

log = logging.getLogger(__name__)

FORMAT_VERSION = 3
JOURNAL_FILE = "journal.log"
_FRAME = struct.Struct("<II")
_encode = json.JSONEncoder(separators=(",", ":"), check_circular=False).encode


class JournalError(ValueError):
    """The journal cannot be used (another format version, not a journal)."""


def frame(record: dict, blob: bytes = b"") -> bytes:
    """A framed record: `record` as JSON, then `blob` (binary) if any."""
    return frame_payload(_encode(record).encode(), blob)


def frame_payload(json: bytes, blob: bytes = b"") -> bytes:
    """A framed record from its JSON (compact, as `frame` writes it) and `blob`."""
    payload = b"\n".join((json, blob)) if blob else json
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def read(path: Path) -> tuple[list[dict], int, int]:
    """The whole records of a journal file, the byte offset where they end,
    and the file's size (larger when the tail is torn). A record's binary
    data, if any, is its "_blob" (a memoryview of the file's bytes)."""
    data = path.read_bytes()
    view = memoryview(data)
    records, pos = [], 0
    while pos + _FRAME.size <= len(data):
        length, crc = _FRAME.unpack_from(data, pos)
        start, end = pos + _FRAME.size, pos + _FRAME.size + length
        if end > len(data) or zlib.crc32(view[start:end]) != crc:
            break
        split = data.find(b"\n", start, end)
        try:
            record = json.loads(data[start:end if split < 0 else split])
        except ValueError:
            break
        if split >= 0:
            record["_blob"] = view[split + 1:end]
        records.append(record)
        pos = end
    return records, pos, len(data)


def check_header(records: list[dict], path: Path) -> dict:
    """The header record; JournalError if there is none or it names another format."""
    header = records[0] if records else {}
    if header.get("t") != "header":
        raise JournalError(f"{path} is not a rollout-service journal (no header record); move it away or "
                           f"point state_dir at an empty directory")
    if header.get("format") != FORMAT_VERSION:
        raise JournalError(
            f"{path} has journal format version {header.get('format')!r}; this service reads version "
            f"{FORMAT_VERSION}. Start the release that wrote it to drain it, or move state_dir's contents "
            f"away to start with empty state (its unfinished groups are then lost)")
    return header


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, chunks: Iterator[bytes] | list[bytes]) -> None:
    """Write a file so that a crash leaves either the old one or the new one:
    a temporary file, fsynced, renamed over `path`, the directory fsynced."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _open_append(path: Path) -> int:
    # O_DSYNC: each write returns once its data (and the file's new size) is
    # on disk, so writing and syncing take the writer one system call.
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_DSYNC, 0o644)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class Journal:
    """The append side of a journal file (opened after it was read and
    rewritten: see `rewrite`). The event loop appends and decides when the
    next commit starts; a thread of its own writes, so the loop never waits
    on the disk. The thread takes the interpreter lock three times a commit
    (woken, written, reported): each time is a switch away from a busy event
    loop, so it is kept to that."""

    def __init__(self, path: Path, commit_interval_s: float) -> None:
        self.path = path
        self.commit_interval_s = commit_interval_s
        self.bytes_written = 0  # since the last rewrite
        self.on_durable: list[Callable[[int], None]] = []
        self.error: BaseException | None = None  # the write that failed (the journal stops)
        self.on_error: list[Callable[[BaseException], None]] = []
        self._fd: int | None = None  # unbuffered: after a failed write nothing is left to flush
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Shared with the writer thread, under _lock:
        self._lock = threading.Lock()
        self._pending = threading.Condition(self._lock)
        self._buffer: list[bytes | Callable[[], bytes]] = []
        self._appended = 0  # sequence number of the last record appended
        self._rewrite: tuple[list[bytes], int] | None = None
        self._closing = False
        self._idle = True  # the writer waits to be started on a commit
        self._started_at = -1e9  # time.monotonic() when the last commit started (set by the writer)
        # The event loop's own:
        self._durable = 0  # sequence number of the last record made durable
        self._waiters: list[tuple[int, asyncio.Future]] = []
        self._kick_at: asyncio.TimerHandle | None = None

    @property
    def appended(self) -> int:
        return self._appended

    def append(self, record: dict | bytes | Callable[[], bytes]) -> int:
        """Buffer a record: a dict (framed now), framed bytes, or a function
        returning them, called in the writer thread (whatever it reads must
        not change once appended). Returns the record's sequence number
        (durable once an `on_durable` callback sees a number at least as
        large)."""
        if isinstance(record, dict):
            record = frame(record)
        with self._lock:
            if self.error is None:  # after a failure nothing is written: nothing is kept
                self._buffer.append(record)
            self._appended += 1
            seq = self._appended
        self._schedule()
        return seq

    def _schedule(self) -> None:
        """Start a commit of what is buffered (or a rewrite) once the writer
        is idle and the last commit started at least `commit_interval_s` ago
        (group commit: what is appended meanwhile rides along)."""
        if self._kick_at is not None or self._loop is None or not self._idle:
            return
        if not self._buffer and self._rewrite is None:
            return
        wait = self._started_at + self.commit_interval_s - time.monotonic()
        if wait > 0:
            self._kick_at = self._loop.call_later(wait, self._kick)
        else:
            self._kick()

    def _kick(self) -> None:
        self._kick_at = None
        with self._lock:
            if self._idle and (self._buffer or self._rewrite is not None):
                self._idle = False
                self._pending.notify()

    async def commit(self) -> None:
        """Wait until every record appended so far is on disk; raises the
        journal's error once a write failed."""
        target = self._appended
        if self._durable >= target:
            return
        if self.error is not None:
            raise self.error
        future = asyncio.get_running_loop().create_future()
        self._waiters.append((target, future))
        await future

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._fd = _open_append(self.path)
        self._thread = threading.Thread(target=self._writer, name="journal", daemon=True)
        self._thread.start()
        self._schedule()

    async def close(self) -> None:
        """Write what is buffered, then close the file."""
        if self._kick_at is not None:
            self._kick_at.cancel()
            self._kick_at = None
        if self._thread is not None:
            with self._lock:
                self._closing = True
                self._pending.notify()
            await asyncio.to_thread(self._thread.join)
            self._thread = None
            await asyncio.sleep(0)  # the writer's last callbacks run
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _writer(self) -> None:
        """The writer thread: one commit each time the loop starts one."""
        while True:
            with self._lock:
                while self._idle and not self._closing:
                    self._pending.wait()
                if not self._buffer and self._rewrite is None:
                    return  # closing, all written
                records, self._buffer = self._buffer, []
                rewrite, self._rewrite = self._rewrite, None
                seq = self._appended
                self._started_at = time.monotonic()
            try:
                if rewrite is not None:
                    os.close(self._fd)
                    self._fd = None
                    write_atomically(self.path, rewrite[0])
                    self._fd = _open_append(self.path)
                    self.bytes_written = 0
                if records:
                    data = b"".join([r if isinstance(r, bytes) else r() for r in records])
                    _write_all(self._fd, data)
                    self.bytes_written += len(data)
            except BaseException as exc:  # a full or failing disk: the journal stops here
                self.error = exc
                self._call(self._failed, exc)
                return
            with self._lock:
                self._idle = True
            self._call(self._done, seq)

    def _call(self, fn: Callable, arg) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _done(self, seq: int) -> None:
        self._durable = seq
        if self._waiters:
            keep = []
            for target, future in self._waiters:
                if target <= seq:
                    if not future.done():
                        future.set_result(None)
                else:
                    keep.append((target, future))
            self._waiters = keep
        for callback in self.on_durable:
            callback(seq)
        self._schedule()  # what was appended during this commit

    def _failed(self, exc: BaseException) -> None:
        log.error("journal %s: write failed: %s; nothing more is recorded until a restart", self.path, exc)
        for _, future in self._waiters:
            if not future.done():
                future.set_exception(exc)
        self._waiters.clear()
        for callback in self.on_error:
            callback(exc)

    def rewrite(self, records: list[bytes]) -> None:
        """Replace the file with `records` (framed), atomically, at the next
        commit. Call it in the same step as the snapshot they come from:
        what is buffered now is covered by them and dropped; what is
        appended later goes to the new file after them."""
        with self._lock:
            self._buffer = []
            self._rewrite = (records, self._appended)
            if self._idle:
                self._idle = False
                self._pending.notify()
