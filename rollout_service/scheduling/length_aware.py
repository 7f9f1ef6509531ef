"""Length-aware placement: queued requests, longest predicted first, onto
engines by their predicted time left (scheduling/cost_model.py), with late
binding.

Two algorithms over the same inputs:

- `LengthAwarePlacement` (`length-aware`) spreads: each request goes to the
  engine with a free slot where the larger of that engine's new predicted
  time and the fleet's current maximum is least; among the engines it leaves
  below that maximum, to the one with the least predicted work (LPT).
- `LengthPackedPlacement` (`length-packed`) packs: the least predicted
  makespan for which the queue fits first-fit onto the engines, so engines
  hold responses of like predicted lengths (long ones together in small
  batches, short ones in large batches elsewhere).

Both: an engine takes no more than its `max_seqs`; the rest waits in the
service's queue and is placed as slots free (late binding). Work the service
has already started (a carried or migrated partial) goes ahead of fresh
work. Each is a function of the queue, the load snapshot, the in-flight
counts and the predicted load in flight (`LoadView`); it pops what it places
from the queue.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Mapping, Sequence

from rollout_service.engines.types import EngineLoad
from rollout_service.lifecycle.types import Request
from rollout_service.scheduling.cost_model import CostModel
from rollout_service.scheduling.length_predictor import LengthPredictor
from rollout_service.scheduling.placement import LoadView
from rollout_service.scheduling.search import least_feasible

# Placement weighs a new prompt's prefill less than the rebalancer weighs a
# re-prefill: it is batched with other prefills and the decode it joins.
PLACEMENT_COST = CostModel(per_sequence_cost=0.04, prefill_cost=0.005)


@dataclass(slots=True)
class _Fleet:
    """The inputs both algorithms start from, per engine and per request."""

    free: dict[str, int]  # slots left
    cap: dict[str, int]  # max_seqs (at least 1)
    work: dict[str, float]  # predicted remaining tokens in flight
    longest: dict[str, float]  # longest predicted remaining response in flight
    remaining: dict[str, float]  # request id -> predicted remaining tokens
    order: list[Request]  # the queue, started work first, then longest predicted first


def _fleet(queue: deque[Request], loads: Sequence[EngineLoad], assigned: Mapping[str, int],
           in_flight: LoadView, predictor: LengthPredictor) -> _Fleet:
    engines = [l for l in loads if l.state in ("ready", "updating")]
    free = {l.engine_id: l.max_seqs - assigned.get(l.engine_id, 0) for l in engines}
    cap = {l.engine_id: max(1, l.max_seqs) for l in engines}
    work, longest = {}, {}
    for l in engines:
        work[l.engine_id], longest[l.engine_id] = in_flight(l.engine_id)
    remaining = {r.request_id: predictor.predict(r).median for r in queue}
    order = sorted(queue, key=lambda r: (not r.token_ids, -(len(r.token_ids) + remaining[r.request_id])))
    return _Fleet(free, cap, work, longest, remaining, order)


def _context(req: Request) -> int:
    return len(req.group.spec.prompt_token_ids) + len(req.token_ids)


def _take(queue: deque[Request], out: list[tuple[Request, str]]) -> list[tuple[Request, str]]:
    """Remove the placed requests from the queue (the rest keeps its order)."""
    if out:
        placed = {r.request_id for r, _ in out}
        rest = [r for r in queue if r.request_id not in placed]
        queue.clear()
        queue.extend(rest)
    return out


def _has_work(queue: deque[Request], loads: Sequence[EngineLoad], assigned: Mapping[str, int]) -> bool:
    return bool(queue) and any(l.state in ("ready", "updating") and l.max_seqs - assigned.get(l.engine_id, 0) > 0
                               for l in loads)


class LengthAwarePlacement:
    """Longest predicted first, spread onto the engine where it raises the
    predicted makespan least (LPT).

    `hold`: a request is held back when every engine with a free slot would
    end later than the fleet's current predicted makespan while an engine
    without a free slot is predicted to end sooner (it will free a slot
    first). `affinity_slack` (None: off) keeps a group's siblings on one
    engine while its work stays within that share of the best engine's."""

    def __init__(self, predictor: LengthPredictor | None = None, cost: CostModel = PLACEMENT_COST,
                 hold: bool = True, affinity_slack: float | None = None, name: str = "length-aware") -> None:
        self.name = name
        self.predictor = predictor or LengthPredictor()
        self.cost = cost
        self.hold = hold
        self.affinity_slack = affinity_slack
        self._group_home: dict[str, str] = {}

    def place(self, queue: deque[Request], loads: Sequence[EngineLoad], assigned: Mapping[str, int],
              in_flight: LoadView | None = None) -> list[tuple[Request, str]]:
        if not _has_work(queue, loads, assigned):
            return []
        f = _fleet(queue, loads, assigned, in_flight or LoadView(), self.predictor)
        free = {e: n for e, n in f.free.items() if n > 0}
        work, longest, cap = f.work, f.longest, f.cap
        prefill = {e: 0.0 for e in cap}  # prompt tokens this call places there

        def time(e: str, add: float = 0.0, context: int = 0) -> float:
            return self.cost.time(max(longest[e], add), work[e] + add, cap[e], prefill_tokens=prefill[e] + context)

        out: list[tuple[Request, str]] = []
        times = {e: time(e) for e in cap}
        for req in f.order:
            if not free:
                break
            add = f.remaining[req.request_id]
            context = _context(req)
            now_max = max(times.values())
            after = {e: time(e, add, context) for e in free}
            target = min(free, key=lambda e: (max(after[e], now_max), work[e], e))
            if self.affinity_slack is not None:
                home = self._group_home.get(req.group.group_id)
                if home in free and work[home] <= work[target] * (1 + self.affinity_slack) + add:
                    target = home  # siblings share the prompt's KV there
                self._group_home[req.group.group_id] = target
            elif self.hold and after[target] > now_max and any(
                    e not in free and times[e] < now_max for e in cap):
                continue  # a full engine ends sooner and will free a slot: wait for it
            out.append((req, target))
            work[target] += add
            longest[target] = max(longest[target], add)
            prefill[target] += context
            times[target] = time(target)
            free[target] -= 1
            if free[target] == 0:
                del free[target]
        if len(self._group_home) > 100_000:
            self._group_home.clear()
        return _take(queue, out)


class LengthPackedPlacement:
    """Length-sorted packing: the least predicted makespan T for which the
    queue, longest predicted first, fits first-fit onto the engines (those
    already running the longest responses first), each engine's predicted
    time staying at most T."""

    def __init__(self, predictor: LengthPredictor | None = None, cost: CostModel = PLACEMENT_COST,
                 name: str = "length-packed") -> None:
        self.name = name
        self.predictor = predictor or LengthPredictor()
        self.cost = cost

    def place(self, queue: deque[Request], loads: Sequence[EngineLoad], assigned: Mapping[str, int],
              in_flight: LoadView | None = None) -> list[tuple[Request, str]]:
        if not _has_work(queue, loads, assigned):
            return []
        f = _fleet(queue, loads, assigned, in_flight or LoadView(), self.predictor)
        work, longest, cap = f.work, f.longest, f.cap
        engines = sorted(cap, key=lambda e: (-longest[e], e))

        def time(e: str, w: float, lng: float, prefill: float) -> float:
            return self.cost.time(lng, w, cap[e], prefill_tokens=prefill)

        def assign(T: float) -> list[tuple[Request, str]] | None:
            """First fit under T; None if a request fits nowhere while slots are free."""
            w, lng, pre, slots = dict(work), dict(longest), {e: 0.0 for e in cap}, dict(f.free)
            out = []
            for req in f.order:
                open_ = [e for e in engines if slots.get(e, 0) > 0]
                if not open_:
                    break  # the rest waits for slots
                add = f.remaining[req.request_id]
                context = _context(req)
                for e in open_:
                    if time(e, w[e] + add, max(lng[e], add), pre[e] + context) <= T:
                        break
                else:
                    return None
                out.append((req, e))
                w[e] += add
                lng[e] = max(lng[e], add)
                pre[e] += context
                slots[e] -= 1
            return out

        lo = max(time(e, work[e], longest[e], 0.0) for e in cap)
        hi = max(lo, 1.0)
        while assign(hi) is None:
            lo, hi = hi, hi * 2
        _, out = least_feasible(assign, lo, hi)
        return _take(queue, out)
