"""Length-aware placement: longest predicted first, onto the engine with the
least predicted remaining work (LPT), keeping a group together where prefix
caching pays.

Pure given its inputs: the queue, the load snapshot, the in-flight counts and
`work_of(engine_id)` (predicted remaining tokens on an engine), which the
core binds. Work the service has already started (a carried or migrated
partial) stays ahead of fresh work.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from rollout_service.core.types import Request
from rollout_service.scheduling.length_predictor import LengthPredictor


class LengthAwarePlacement:
    name = "length-aware"

    def __init__(self, predictor: LengthPredictor | None = None, affinity_slack: float = 0.25) -> None:
        self.predictor = predictor or LengthPredictor()
        self.affinity_slack = affinity_slack
        self.work_of: Callable[[str], float] = lambda engine_id: 0.0
        self._group_home: dict[str, str] = {}

    def bind(self, work_of: Callable[[str], float]) -> None:
        self.work_of = work_of

    def place(self, queue: deque[Request], loads, assigned):
        engines = [l for l in loads if l.state in ("ready", "updating")]
        free = {l.engine_id: l.max_seqs - assigned.get(l.engine_id, 0) for l in engines}
        free = {e: n for e, n in free.items() if n > 0}
        if not free or not queue:
            return []
        work = {e: self.work_of(e) for e in free}
        predicted = {id(r): self.predictor.predict_total(r) for r in queue}
        order = sorted(queue, key=lambda r: (not r.token_ids, -predicted[id(r)]))
        out: list[tuple[Request, str]] = []
        placed: set[int] = set()
        for req in order:
            if not free:
                break
            least = min(free, key=lambda e: (work[e], e))
            home = self._group_home.get(req.group.group_id)
            target = least
            if home in free and work[home] <= work[least] * (1 + self.affinity_slack) + predicted[id(req)]:
                target = home  # siblings share the prompt's KV there
            out.append((req, target))
            placed.add(id(req))
            self._group_home[req.group.group_id] = target
            work[target] += predicted[id(req)] - len(req.token_ids)
            free[target] -= 1
            if free[target] == 0:
                del free[target]
        if placed:
            remaining = [r for r in queue if id(r) not in placed]
            queue.clear()
            queue.extend(remaining)
        if len(self._group_home) > 100_000:
            self._group_home.clear()
        return out
