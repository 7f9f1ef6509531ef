"""Placement: which engine each queued request goes to.

A placement policy decides from the queue, a snapshot of engine loads, the
in-flight counts (`assigned[engine_id]`: requests the service has placed on
an engine and not yet seen finish) and the predicted load in flight
(`LoadView`, for the length-aware policies): it pops the requests it places
from the queue and returns (request, engine_id) decisions. The core applies
them; nothing here awaits.

The baselines reproduce how the systems the service is measured against
spread a step's samples over their engines (each engine then batches
continuously and queues what does not fit):

| name | system | rule |
|---|---|---|
| `static` | TRL's vLLM server | the step's prompts split evenly, in order, across engines, decided once |
| `least-assigned` | verl's agent loop | each sample to the engine with the fewest requests in flight |
| `sticky-rr` | AReaL | groups round-robin over engines, every sample of a group on the group's engine |
"""
from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Callable, Mapping, Protocol, Sequence

from rollout_service.engines.types import EngineLoad
from rollout_service.lifecycle.types import Request

if TYPE_CHECKING:
    from rollout_service.scheduling.length_predictor import LengthPredictor


class LoadView:
    """The predicted load in flight on each engine: (remaining tokens,
    longest remaining response) of the requests placed there. Made for one
    placement call; `compute` (every engine at once) runs at most once, on
    the first look-up. With no `compute`, every engine is idle."""

    def __init__(self, compute: Callable[[], Mapping[str, tuple[float, float]]] | None = None) -> None:
        self._compute = compute
        self._loads: Mapping[str, tuple[float, float]] | None = None

    @classmethod
    def of(cls, loads: Mapping[str, tuple[float, float]]) -> "LoadView":
        return cls(lambda: loads)

    def __call__(self, engine_id: str) -> tuple[float, float]:
        if self._loads is None:
            self._loads = self._compute() if self._compute is not None else {}
        return self._loads.get(engine_id, (0.0, 0.0))


class Placement(Protocol):
    name: str
    predictor: "LengthPredictor | None"  # the length predictor it places by (the core's too), if any

    def place(
        self, queue: deque[Request], loads: Sequence[EngineLoad], assigned: Mapping[str, int],
        in_flight: LoadView | None = None,
    ) -> list[tuple[Request, str]]:
        """Pop placeable requests from `queue`; return where each one runs."""


def _ready(loads: Sequence[EngineLoad]) -> list[EngineLoad]:
    return [l for l in loads if l.state in ("ready", "updating")]


class LeastAssigned:
    """Each request, in queue order, to the ready engine with the fewest
    requests in flight (ties: the first in fleet order). verl's agent loop
    balances its servers this way and sends every request at once; the
    engine queues what exceeds its batch.

    With `cap_at_max_seqs`, an engine takes no more than its `max_seqs` and
    the rest waits in the service's queue until a slot frees (late binding).
    """

    name = "least-assigned"
    predictor = None

    def __init__(self, cap_at_max_seqs: bool = False) -> None:
        self.cap_at_max_seqs = cap_at_max_seqs

    def place(self, queue, loads, assigned, in_flight=None):
        engines = _ready(loads)
        heap = [(assigned.get(l.engine_id, 0), i) for i, l in enumerate(engines)]
        heapq.heapify(heap)
        out: list[tuple[Request, str]] = []
        while queue and heap:
            count, i = heapq.heappop(heap)
            if self.cap_at_max_seqs and count >= engines[i].max_seqs:
                continue  # full: drop it from this round
            out.append((queue.popleft(), engines[i].engine_id))
            heapq.heappush(heap, (count + 1, i))
        return out


class StaticSplit:
    """TRL's vLLM server: the prompts queued together (one step's batch) are
    cut into as many contiguous chunks as there are ready engines, the first
    `len % engines` chunks one group longer; every sample of a group goes with
    its prompt. Decided once per batch, whatever the engines' loads."""

    name = "static"
    predictor = None

    def __init__(self) -> None:
        self._offset = 0  # where the next batch's first chunk goes

    def place(self, queue, loads, assigned, in_flight=None):
        engines = _ready(loads)
        if not engines or not queue:
            return []
        groups: dict[str, list[Request]] = {}
        while queue:
            req = queue.popleft()
            groups.setdefault(req.group.group_id, []).append(req)
        chunks = split_evenly(list(groups.values()), len(engines))
        out: list[tuple[Request, str]] = []
        for j, chunk in enumerate(chunks):
            engine_id = engines[(self._offset + j) % len(engines)].engine_id
            out.extend((req, engine_id) for group in chunk for req in group)
        # A batch smaller than the fleet (a re-queued request) starts where the last one stopped.
        self._offset = (self._offset + len(groups) % len(engines)) % len(engines)
        return out


def split_evenly(items: list, n: int) -> list[list]:
    """`n` contiguous chunks whose sizes differ by at most one, longer first."""
    size, extra = divmod(len(items), n)
    out, start = [], 0
    for j in range(n):
        end = start + size + (1 if j < extra else 0)
        out.append(items[start:end])
        start = end
    return out


class StickyRoundRobin:
    """AReaL: each new group goes to the next engine in round-robin order and
    all its samples follow it there (they share a request id, so the router
    keeps them together). A group whose engine is no longer ready moves to
    the next engine in turn."""

    name = "sticky-rr"
    predictor = None

    def __init__(self, remembered_groups: int = 100_000) -> None:
        self._next = 0
        self._home: OrderedDict[str, str] = OrderedDict()
        self._limit = remembered_groups

    def place(self, queue, loads, assigned, in_flight=None):
        ids = [l.engine_id for l in _ready(loads)]
        if not ids:
            return []
        ready = set(ids)
        out: list[tuple[Request, str]] = []
        while queue:
            req = queue.popleft()
            gid = req.group.group_id
            engine_id = self._home.get(gid)
            if engine_id not in ready:
                engine_id = ids[self._next % len(ids)]
                self._next += 1
                self._home[gid] = engine_id
                if len(self._home) > self._limit:
                    self._home.popitem(last=False)
            out.append((req, engine_id))
        return out


def _length_aware() -> Placement:
    from rollout_service.scheduling.length_aware import LengthAwarePlacement

    return LengthAwarePlacement()


def _length_packed() -> Placement:
    from rollout_service.scheduling.length_aware import LengthPackedPlacement

    return LengthPackedPlacement()


#: name -> factory of every placement the service offers.
PLACEMENTS: Mapping[str, Callable[[], Placement]] = {
    LeastAssigned.name: LeastAssigned,
    StaticSplit.name: StaticSplit,
    StickyRoundRobin.name: StickyRoundRobin,
    "length-aware": _length_aware,  # longest predicted first, least predicted makespan (LPT)
    "length-packed": _length_packed,  # engines of like predicted lengths
}


def placement_names(extra: Mapping[str, Callable[[], Placement]] | None = None) -> list[str]:
    return sorted({**PLACEMENTS, **(extra or {})})


def make_placement(name: str, extra: Mapping[str, Callable[[], Placement]] | None = None) -> Placement:
    """A new placement by name, from `PLACEMENTS` or `extra` (e.g. the load
    tests' clairvoyant references); ValueError naming the choices."""
    table = {**PLACEMENTS, **(extra or {})}
    try:
        factory = table[name]
    except KeyError:
        raise ValueError(f"unknown placement policy {name!r}; choose from {sorted(table)}") from None
    return factory()
