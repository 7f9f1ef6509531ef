"""The requests the core has placed on engines, and how many per engine.

The one owner of three facts that must agree: a request is in the table
exactly while it holds a slot on one engine; `assigned(engine_id)` counts
those slots; `req.engine_id` names that engine, or is None once the core has
detached the request (a preemption in flight: its runner drops what it sees
from then on, but the engine still holds the slot until `release`).
"""
from __future__ import annotations

import asyncio
from collections import Counter
from types import MappingProxyType
from typing import Iterator, Mapping

from rollout_service.lifecycle.types import Request


class RequestTable:
    def __init__(self) -> None:
        self._running: dict[str, tuple[Request, asyncio.Task]] = {}
        self._slot: dict[str, str] = {}  # request id -> the engine whose slot it holds
        self._assigned: Counter[str] = Counter()

    def start(self, req: Request, engine_id: str, task: asyncio.Task) -> None:
        """`req` now runs on `engine_id` (in `task`)."""
        if req.request_id in self._running:
            raise RuntimeError(f"{req.request_id} is already running on {self._slot[req.request_id]}")
        req.engine_id = engine_id
        self._running[req.request_id] = (req, task)
        self._slot[req.request_id] = engine_id
        self._assigned[engine_id] += 1

    def detach(self, req: Request) -> str | None:
        """Stop attributing the runner's output to `req` (its slot stays
        counted until `release`); returns the engine it was on."""
        engine_id = self._slot.get(req.request_id)
        req.engine_id = None
        return engine_id

    def release(self, req: Request) -> str | None:
        """`req` no longer holds a slot; returns the engine it held (None if
        it held none). Idempotent."""
        req.engine_id = None
        if self._running.pop(req.request_id, None) is None:
            return None
        engine_id = self._slot.pop(req.request_id)
        self._assigned[engine_id] -= 1
        return engine_id

    def get(self, request_id: str) -> Request | None:
        entry = self._running.get(request_id)
        return entry[0] if entry is not None else None

    def running_on(self, engine_id: str) -> list[Request]:
        """The attached requests on `engine_id`, in start order."""
        return [r for r, _ in self._running.values() if r.engine_id == engine_id]

    def attached(self) -> Iterator[Request]:
        """Every request whose runner is live, in start order."""
        return (r for r, _ in self._running.values() if r.engine_id is not None)

    def assigned(self, engine_id: str) -> int:
        return self._assigned[engine_id]

    @property
    def counts(self) -> Mapping[str, int]:
        """Slots held per engine (read-only)."""
        return MappingProxyType(self._assigned)

    @property
    def entries(self) -> Mapping[str, tuple[Request, asyncio.Task]]:
        """request id -> (request, its runner task), in start order (read-only)."""
        return MappingProxyType(self._running)

    def __len__(self) -> int:
        return len(self._running)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._running

    def check(self) -> None:
        """Raise AssertionError if the invariant (module docstring) is broken."""
        counts = Counter(self._slot.values())
        assert set(self._slot) == set(self._running), "slots and running disagree"
        assert all(self._assigned[e] == n for e, n in counts.items()), "assigned disagrees with the slots"
        assert all(n == 0 for e, n in self._assigned.items() if e not in counts), "assigned counts a free slot"
        for rid, (req, _) in self._running.items():
            assert req.engine_id in (None, self._slot[rid]), f"{rid} names an engine it holds no slot on"
