"""A write-ahead journal: framed records appended to one file, group commit.

Each record is `length (4 bytes) | crc32 (4 bytes) | payload` (little
endian). The payload is JSON, optionally followed by a newline and binary
data (packed token ids and logprobs; compact JSON holds no newline). The
first record is the header, JSON only in every format version: the format
version and the service's incarnation. Reading stops at the first record
that is not whole (a length past the end, a checksum that does not match):
that torn tail, what a crash mid-write leaves, is cut off.

Group commit: `append` buffers a record and returns at once; a writer task
encodes (in a worker thread, for records handed over as encoders), writes
what is buffered and fsyncs at most every `commit_interval_s`, so one fsync
makes many records durable. `commit()` waits until everything
appended before it is durable; `on_durable` callbacks learn each committed
sequence number. `rewrite` replaces the whole file with a snapshot's
records atomically (temporary file, fsync, rename, fsync of the directory).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import struct
import zlib
from pathlib import Path
from typing import Callable, Iterator

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
JOURNAL_FILE = "journal.log"
_FRAME = struct.Struct("<II")
_encode = json.JSONEncoder(separators=(",", ":"), check_circular=False).encode


class JournalError(ValueError):
    """The journal cannot be used (another format version, not a journal)."""


def frame(record: dict, blob: bytes = b"") -> bytes:
    """A framed record: `record` as JSON, then `blob` (binary) if any."""
    payload = _encode(record).encode()
    if blob:
        payload = b"\n".join((payload, blob))
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


class Journal:
    """The append side of a journal file (opened after it was read and
    rewritten: see `rewrite`)."""

    def __init__(self, path: Path, commit_interval_s: float) -> None:
        self.path = path
        self.commit_interval_s = commit_interval_s
        self.bytes_written = 0  # since the last rewrite
        self.on_durable: list[Callable[[int], None]] = []
        self._file = None
        self._buffer: list[bytes | Callable[[], bytes]] = []
        self._appended = 0  # sequence number of the last record appended
        self._durable = 0  # ... and of the last one made durable
        self._waiters: list[tuple[int, asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closed = False
        self._rewrite: list[bytes] | None = None
        self._rewrite_seq = 0
        self.error: BaseException | None = None

    @property
    def appended(self) -> int:
        return self._appended

    def append(self, record: dict | Callable[[], bytes]) -> int:
        """Buffer a record: a dict (framed now), or a function returning the
        framed record, called in the writer's worker thread (whatever it
        reads must not change once appended). Returns the record's sequence
        number (durable once an `on_durable` callback sees a number at least
        as large)."""
        self._buffer.append(frame(record) if isinstance(record, dict) else record)
        self._appended += 1
        self._wake.set()
        return self._appended

    async def commit(self) -> None:
        """Wait until every record appended so far is on disk (fsynced)."""
        target = self._appended
        if self._durable >= target:
            return
        if self.error is not None:
            raise self.error
        future = asyncio.get_running_loop().create_future()
        self._waiters.append((target, future))
        await future

    def start(self) -> None:
        self._file = open(self.path, "ab")
        self._task = asyncio.get_running_loop().create_task(self._writer(), name="journal")

    async def close(self) -> None:
        """Write and fsync what is buffered, then close the file."""
        if self._task is not None:
            self._closed = True
            self._wake.set()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._file is not None and self.error is None:
            await self._flush()
        if self._file is not None:
            self._file.close()
            self._file = None

    def _write(self, records: list[bytes | Callable[[], bytes]]) -> int:
        """Encode, write and fsync `records` (in a worker thread); returns the bytes written."""
        data = b"".join([r if isinstance(r, bytes) else r() for r in records])
        self._file.write(data)
        self._file.flush()
        os.fsync(self._file.fileno())
        return len(data)

    def _done(self, seq: int) -> None:
        self._durable = seq
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

    async def _writer(self) -> None:
        loop = asyncio.get_running_loop()
        last = 0.0
        while not self._closed:
            await self._wake.wait()
            self._wake.clear()
            if self._closed:
                break
            # Group commit: at most one fsync per interval (counted from the
            # start of the last one); what arrives meanwhile rides along.
            wait = last + self.commit_interval_s - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            last = loop.time()
            try:
                await self._flush()
            except BaseException as exc:  # a full or failing disk: every waiter hears of it
                self.error = exc
                log.error("journal %s: write failed: %s; durability lost until restart", self.path, exc)
                for _, future in self._waiters:
                    if not future.done():
                        future.set_exception(exc)
                self._waiters.clear()
                raise

    async def _flush(self) -> None:
        """Write (and fsync) a pending rewrite, then what is buffered. Only
        the writer task (or `close`, after it) does file IO."""
        if self._rewrite is not None:
            records, seq, self._rewrite = self._rewrite, self._rewrite_seq, None
            self._file.close()
            await asyncio.to_thread(write_atomically, self.path, records)
            self._file = open(self.path, "ab")
            self.bytes_written = 0
            self._done(max(seq, self._durable))
        if self._buffer:
            seq, records, self._buffer = self._appended, self._buffer, []
            self.bytes_written += await asyncio.to_thread(self._write, records)
            self._done(seq)

    def rewrite(self, records: list[bytes]) -> None:
        """Replace the file with `records` (framed), atomically, at the next
        commit. Call it in the same step as the snapshot they come from:
        what is buffered now is covered by them and dropped; what is
        appended later goes to the new file after them."""
        self._buffer = []
        self._rewrite, self._rewrite_seq = records, self._appended
        self._wake.set()
