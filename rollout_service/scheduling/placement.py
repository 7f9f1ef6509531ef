"""Placement: which engine each queued request goes to.

A placement policy is a pure function of the queue and a snapshot of engine
loads: it pops the requests it places from the head of the queue and returns
(request, engine_id) decisions. The core applies them; nothing here awaits.
`assigned[engine_id]` counts the requests the service has placed on an
engine and not yet seen finish.
"""
from __future__ import annotations

from collections import deque
from typing import Mapping, Protocol, Sequence

from rollout_service.core.types import EngineLoad, Request


class Placement(Protocol):
    name: str

    def place(
        self, queue: deque[Request], loads: Sequence[EngineLoad], assigned: Mapping[str, int]
    ) -> list[tuple[Request, str]]:
        """Pop placeable requests from `queue`; return where each one runs."""


def _ready(loads: Sequence[EngineLoad]) -> list[EngineLoad]:
    return [l for l in loads if l.state in ("ready", "updating")]


class LeastAssigned:
    """FIFO onto the ready engine with the fewest requests in flight, up to
    each engine's `max_seqs` (verl's agent loop balances this way)."""

    name = "least-assigned"

    def place(self, queue, loads, assigned):
        engines = _ready(loads)
        counts = {l.engine_id: assigned.get(l.engine_id, 0) for l in engines}
        caps = {l.engine_id: l.max_seqs for l in engines}
        out: list[tuple[Request, str]] = []
        while queue and engines:
            eid = min(counts, key=lambda e: (counts[e] / caps[e], e))
            if counts[eid] >= caps[eid]:
                break
            req = queue.popleft()
            out.append((req, eid))
            counts[eid] += 1
        return out


PLACEMENTS = {LeastAssigned.name: LeastAssigned}


def make_placement(name: str) -> Placement:
    try:
        return PLACEMENTS[name]()
    except KeyError:
        raise ValueError(f"unknown placement policy {name!r}; choose from {sorted(PLACEMENTS)}") from None
