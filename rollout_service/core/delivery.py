"""The delivery log: completed samples in cursor order, per-consumer acks.

Every completed sample gets the next cursor (strictly increasing, starting at
1). A consumer streams everything above max(its acknowledged cursor, the
cursor it asks to resume from); what it has not acknowledged is delivered
again when it reconnects (at-least-once on the wire, exactly-once for a
consumer that acknowledges and resumes from the last cursor it saw).

With a journal (core/durable.py) a sample is appended when it completes but
streamed only once it is durable: `publish(cursor)` makes everything up to
`cursor` visible (without one, `append` publishes at once).

Memory stays bounded: an entry is dropped once every live consumer has
acknowledged it. A consumer is live while one of its streams waits for new
samples (it has everything), or for `consumer_ttl_s` after it was last
seen (a stream opened or closed, a sample sent, an ack); one that is not
stops pinning entries, and a stream of it still open (its reader stuck)
ends with FAILED_PRECONDITION. Its unacknowledged samples go to whoever
connects next under a fresh id only if nobody acknowledged them yet. A
stream holds at most `max_unacked_samples` sent and not acknowledged: it
waits for an ack, and ends with RESOURCE_EXHAUSTED naming the bound when
none comes within `unacked_wait_s`.
"""
from __future__ import annotations

import asyncio
import bisect
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from rollout_service.lifecycle.types import CoreError, Sample

PRUNE_INTERVAL_S = 1.0  # silent consumers are looked for at most this often as samples arrive


@dataclass(slots=True)
class Entry:
    cursor: int
    sample: Sample
    group_complete: bool
    wire: object = None  # the sample's wire message without its group's fields, when made already (by the journal)


@dataclass(slots=True)
class Consumer:
    consumer_id: str
    acked: int = 0
    streams: int = 0  # open streams
    last_seen: float = 0.0
    idle: int = 0  # streams waiting for new samples (this consumer has everything)
    expired: bool = False  # dropped as silent: its open streams end


class DeliveryLog:
    def __init__(self, now: Callable[[], float], consumer_ttl_s: float = 3600.0, max_unacked: int = 65_536,
                 unacked_wait_s: float = 60.0) -> None:
        self._now = now
        self._ttl = consumer_ttl_s
        self._max_unacked = max_unacked
        self._unacked_wait_s = unacked_wait_s
        self._pruned_at = 0.0
        # Entries below _head are pruned; the list is compacted now and then.
        self._entries: list[Entry] = []
        self._head = 0
        self._last = 0
        self._visible = 0  # streams see cursors up to this one
        self._consumers: dict[str, Consumer] = {}
        self._changed = asyncio.Event()
        self._failure: CoreError | None = None  # raised by streams that have sent every visible sample
        # Called with (consumer id, acked cursor) when a consumer is first seen and when an
        # ack moves its cursor (the journal).
        self.on_ack: Callable[[str, int], object] | None = None

    @property
    def last_cursor(self) -> int:
        return self._last

    @property
    def retained(self) -> int:
        return len(self._entries) - self._head

    @property
    def visible_cursor(self) -> int:
        return self._visible

    def append(self, sample: Sample, group_complete: bool, publish: bool = True) -> int:
        """Log a sample under the next cursor; visible to streams now, or
        (publish=False) once `publish` reaches its cursor."""
        return self.append_entry(sample, group_complete, publish).cursor

    def append_entry(self, sample: Sample, group_complete: bool, publish: bool = True) -> Entry:
        """`append`, returning the entry."""
        self._last += 1
        entry = Entry(self._last, sample, group_complete)
        self._entries.append(entry)
        if publish:
            self.publish(self._last)
        self.maybe_prune()
        return entry

    def publish(self, cursor: int) -> None:
        """Make the entries up to `cursor` visible to streams."""
        if cursor > self._visible:
            self._visible = min(cursor, self._last)
            self._wake()

    def fail(self, error: CoreError) -> None:
        """No more samples will become visible: every stream, once it has
        sent the visible ones, ends with `error`."""
        self._failure = error
        self._wake()

    def entries(self) -> list[Entry]:
        """The retained entries, in cursor order."""
        return self._entries[self._head :]

    def consumers(self) -> list[Consumer]:
        return list(self._consumers.values())

    def restore(self, entries: list[tuple[int, Sample, bool]], last_cursor: int, consumers: list[Consumer]) -> None:
        """Load a saved log (cursors kept) into an empty one."""
        self._entries = [Entry(c, s, g) for c, s, g in entries]
        self._head = 0
        self._last = self._visible = last_cursor
        for c in consumers:
            c.last_seen = self._now()
            self._consumers[c.consumer_id] = c
        if consumers:
            self._prune()

    def _wake(self) -> None:
        # A broadcast: every stream waiting on the old event wakes; later waits use a fresh one.
        self._changed.set()
        self._changed = asyncio.Event()

    def consumer(self, consumer_id: str) -> Consumer:
        c = self._consumers.get(consumer_id)
        if c is None:
            # A new consumer starts after what every consumer has acknowledged
            # (those entries are gone) so it sees every retained sample.
            gone = self._entries[self._head].cursor - 1 if self.retained else self._last
            c = self._consumers[consumer_id] = Consumer(consumer_id, acked=gone)
            if self.on_ack is not None:
                # Journaled too, so that after a restart it still pins what it
                # has not acknowledged, even if it never acknowledged anything.
                self.on_ack(consumer_id, gone)
        c.last_seen = self._now()
        return c

    def ack(self, consumer_id: str, cursor: int) -> int:
        """Acknowledge up to `cursor` (clamped to the last visible cursor); returns the acked cursor."""
        c = self.consumer(consumer_id)
        acked = max(c.acked, min(cursor, self._visible))
        if acked > c.acked:
            if self.on_ack is not None:
                self.on_ack(consumer_id, acked)
            c.acked = acked
            self._wake()  # a stream held at max_unacked_samples may go on
        self._prune()
        return c.acked

    def maybe_prune(self) -> None:
        """Prune unless that was done less than PRUNE_INTERVAL_S ago."""
        if self._now() - self._pruned_at >= PRUNE_INTERVAL_S:
            self._prune()

    def _prune(self) -> None:
        now = self._pruned_at = self._now()
        live, dead = [], []
        for c in self._consumers.values():
            (live if c.idle > 0 or now - c.last_seen < self._ttl else dead).append(c)
        for c in dead:
            c.expired = True
            del self._consumers[c.consumer_id]
        if not live:
            return  # kept for whoever connects next
        floor = min(c.acked for c in live)
        while self._head < len(self._entries) and self._entries[self._head].cursor <= floor:
            self._head += 1
        if self._head > 1024 and self._head * 2 > len(self._entries):
            del self._entries[: self._head]
            self._head = 0

    def _after(self, cursor: int) -> list[Entry]:
        """The visible entries above `cursor`, at most max_unacked_samples of them."""
        if cursor >= self._visible:
            return []
        i = bisect.bisect_right(self._entries, cursor, lo=self._head, key=lambda e: e.cursor)
        j = i + self._max_unacked
        if self._visible != self._last:
            j = min(j, bisect.bisect_right(self._entries, self._visible, lo=i, key=lambda e: e.cursor))
        return self._entries[i:j]

    async def stream(self, consumer_id: str, from_cursor: int = 0) -> AsyncIterator[Entry]:
        """Yield entries above max(acked, from_cursor), then new ones as they
        come; CoreError when the consumer falls `max_unacked_samples` behind
        its acks for `unacked_wait_s`, is dropped as silent (see above), or
        has every visible entry after `fail`."""
        c = self.consumer(consumer_id)
        c.streams += 1
        position = max(c.acked, from_cursor)
        try:
            while True:
                self._check(c)
                changed = self._changed
                position = max(position, c.acked)
                batch = self._after(position)
                for entry in batch:
                    if entry.cursor - c.acked > self._max_unacked:
                        break
                    position = entry.cursor
                    yield entry
                    c.last_seen = self._now()
                    self._check(c)
                else:
                    if not batch:
                        if self._failure is not None:
                            raise self._failure
                        c.idle += 1
                        try:
                            await changed.wait()
                        finally:
                            c.idle -= 1
                    continue
                await self._wait_for_ack(c, changed)
        finally:
            c.streams -= 1
            c.last_seen = self._now()

    def _check(self, c: Consumer) -> None:
        if c.expired:
            raise CoreError("failed_precondition", f"consumer_id {c.consumer_id!r}: dropped after consumer_ttl_s="
                            f"{self._ttl:g} s without reading a sample or acknowledging; samples it had not "
                            "acknowledged may have been delivered to other consumers; reconnect to go on")

    async def _wait_for_ack(self, c: Consumer, changed: asyncio.Event) -> None:
        """Wait (at most `unacked_wait_s`) until `c` acknowledges something."""
        acked, deadline = c.acked, asyncio.get_running_loop().time() + self._unacked_wait_s
        while c.acked == acked:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise CoreError("exhausted", f"consumer_id {c.consumer_id!r}: {self._max_unacked} samples streamed "
                                f"and not acknowledged (max_unacked_samples) and no ack for unacked_wait_s="
                                f"{self._unacked_wait_s:g} s; acknowledge (Ack, RolloutClient.ack or "
                                "stream(ack_every=...)) to receive more")
            try:
                await asyncio.wait_for(changed.wait(), left)
            except asyncio.TimeoutError:
                pass
            changed = self._changed
