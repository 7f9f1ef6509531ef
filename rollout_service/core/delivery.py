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
acknowledged it; consumers silent for longer than `consumer_ttl_s` stop
pinning entries (their unacknowledged samples go to whoever connects next
under a fresh id only if nobody acknowledged them yet).
"""
from __future__ import annotations

import asyncio
import bisect
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from rollout_service.lifecycle.types import Sample


@dataclass(slots=True)
class Entry:
    cursor: int
    sample: Sample
    group_complete: bool


@dataclass(slots=True)
class Consumer:
    consumer_id: str
    acked: int = 0
    streams: int = 0  # open streams
    last_seen: float = 0.0


class DeliveryLog:
    def __init__(self, now: Callable[[], float], consumer_ttl_s: float = 3600.0) -> None:
        self._now = now
        self._ttl = consumer_ttl_s
        # Entries below _head are pruned; the list is compacted now and then.
        self._entries: list[Entry] = []
        self._head = 0
        self._last = 0
        self._visible = 0  # streams see cursors up to this one
        self._consumers: dict[str, Consumer] = {}
        self._changed = asyncio.Event()
        # Called with (consumer id, acked cursor) when an ack moves a cursor (the journal).
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
        self._last += 1
        self._entries.append(Entry(self._last, sample, group_complete))
        if publish:
            self.publish(self._last)
        return self._last

    def publish(self, cursor: int) -> None:
        """Make the entries up to `cursor` visible to streams."""
        if cursor > self._visible:
            self._visible = min(cursor, self._last)
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
            c = self._consumers[consumer_id] = Consumer(consumer_id)
        c.last_seen = self._now()
        return c

    def ack(self, consumer_id: str, cursor: int) -> int:
        """Acknowledge up to `cursor` (clamped to the last visible cursor); returns the acked cursor."""
        c = self.consumer(consumer_id)
        acked = max(c.acked, min(cursor, self._visible))
        if acked > c.acked and self.on_ack is not None:
            self.on_ack(consumer_id, acked)
        c.acked = acked
        self._prune()
        return c.acked

    def _prune(self) -> None:
        now = self._now()
        live = [c for c in self._consumers.values() if c.streams > 0 or now - c.last_seen < self._ttl]
        if not live:
            return
        floor = min(c.acked for c in live)
        while self._head < len(self._entries) and self._entries[self._head].cursor <= floor:
            self._head += 1
        if self._head > 1024 and self._head * 2 > len(self._entries):
            del self._entries[: self._head]
            self._head = 0
        for cid in [c.consumer_id for c in self._consumers.values() if c not in live]:
            del self._consumers[cid]

    def _after(self, cursor: int) -> list[Entry]:
        if cursor >= self._visible:
            return []
        i = bisect.bisect_right(self._entries, cursor, lo=self._head, key=lambda e: e.cursor)
        if self._visible == self._last:
            return self._entries[i:]
        j = bisect.bisect_right(self._entries, self._visible, lo=i, key=lambda e: e.cursor)
        return self._entries[i:j]

    async def stream(self, consumer_id: str, from_cursor: int = 0) -> AsyncIterator[Entry]:
        """Yield entries above max(acked, from_cursor), then new ones as they come."""
        c = self.consumer(consumer_id)
        c.streams += 1
        position = max(c.acked, from_cursor)
        try:
            while True:
                changed = self._changed
                batch = self._after(max(position, c.acked))
                for entry in batch:
                    position = entry.cursor
                    yield entry
                if not batch:
                    await changed.wait()
        finally:
            c.streams -= 1
            c.last_seen = self._now()
