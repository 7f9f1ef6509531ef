"""Session affinity: a trajectory's next turn goes where its prefix is cached.

A multi-turn trajectory that has finished a turn and got its observation is
queued again with `Request.affinity`, the engine that ran its last turn and
holds its context in the prefix cache. `place_affine` sends it back there
when that engine is placeable and either has a free slot (fewer requests in
flight than its batch) or no engine has one (then it waits in that engine's
queue like everything else), so only the observation and the new turn are
prefilled. When its engine is full while another has a free slot, the
trajectory moves only if the predicted wait for a slot on its engine
(`slot_wait`: when the soonest of the turns running there ends, for the
k-th trajectory waiting the k-th soonest) costs more than re-prefilling its
whole context elsewhere, both priced by the rebalancer's cost model
(scheduling/cost_model.py). A move, or a trajectory whose engine is down,
stays in the queue for the configured placement, which may put it on any
engine (counted as `trajectory_moves`).

A harness that drives its own turns (one completion per call, e.g. through
the OpenAI-compatible side server) names its session with a key
(`GroupSpec.metadata["session_id"]`): `Sessions` remembers the engine each
key's last request started on, and the next request with that key gets it
as its `affinity`.
"""
from __future__ import annotations

import math
from collections import OrderedDict, deque
from typing import Callable, Mapping, Sequence

from rollout_service.engines.types import EngineLoad
from rollout_service.lifecycle.types import Request
from rollout_service.scheduling.cost_model import CostModel

PLACEABLE = ("ready", "updating")

#: (engine id, k) -> predicted lone decode steps until the engine frees its
#: k-th next slot (k = 0: the first one); math.inf when nothing there will.
SlotWait = Callable[[str, int], float]


def slot_waits(remaining: Callable[[], Mapping[str, Sequence[float]]], max_seqs: Mapping[str, int],
               cost: CostModel) -> SlotWait:
    """A `SlotWait` from the predicted remaining tokens of the turns (or
    responses) running on each engine (`remaining()`, called at most once,
    on the first look-up): the k-th slot frees when the k-th shortest of
    them ends, each step of a full batch priced by `cost`."""
    ordered: dict[str, list[float]] | None = None

    def wait(engine_id: str, k: int) -> float:
        nonlocal ordered
        if ordered is None:
            ordered = {e: sorted(max(0.0, x) for x in xs) for e, xs in remaining().items()}
        left = ordered.get(engine_id, [])
        if k >= len(left):
            return math.inf
        n = max(1, max_seqs.get(engine_id, 1))
        return cost.time(left[k], left[k] * n, n)

    return wait


def place_affine(queue: deque[Request], loads: Sequence[EngineLoad], assigned: Mapping[str, int],
                 slot_wait: SlotWait | None = None, cost: CostModel | None = None) -> list[tuple[Request, str]]:
    """Pop from `queue` each request whose affinity engine should take it
    now; returns (request, engine_id) decisions. The others keep their
    order. Without `slot_wait`, a trajectory whose engine is full moves
    whenever another engine has a free slot."""
    if not any(r.affinity is not None for r in queue):
        return []
    cost = cost or CostModel()
    room = {l.engine_id: l.max_seqs - assigned.get(l.engine_id, 0) for l in loads if l.state in PLACEABLE}
    free = sum(max(0, n) for n in room.values())
    out: list[tuple[Request, str]] = []
    rest: list[Request] = []

    def worth_waiting(req: Request, engine_id: str) -> bool:
        if slot_wait is None:
            return False
        reprefill = cost.prefill_cost * (len(req.group.spec.prompt_token_ids) + len(req.token_ids))
        return slot_wait(engine_id, -room[engine_id]) <= reprefill

    for req in queue:
        engine_id = req.affinity
        if engine_id in room and (room[engine_id] > 0 or free == 0 or worth_waiting(req, engine_id)):
            if room[engine_id] > 0:
                free -= 1
            room[engine_id] -= 1
            out.append((req, engine_id))
        else:
            rest.append(req)
    if out:
        queue.clear()
        queue.extend(rest)
    return out


#: The group metadata key a harness's session travels under (the side
#: server's `X-Session-Id` header or `user` field).
SESSION_KEY = "session_id"


class Sessions:
    """The engine each session key's last request started on; the least
    recently used keys are forgotten beyond `capacity`."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._engine: OrderedDict[str, str] = OrderedDict()

    def engine_for(self, metadata: Mapping[str, str]) -> str | None:
        """The engine holding this session's prefix (None: no key, or unknown)."""
        key = metadata.get(SESSION_KEY)
        return self._engine.get(key) if key else None

    def started(self, metadata: Mapping[str, str], engine_id: str) -> None:
        key = metadata.get(SESSION_KEY)
        if not key:
            return
        self._engine[key] = engine_id
        self._engine.move_to_end(key)
        while len(self._engine) > self.capacity:
            self._engine.popitem(last=False)
