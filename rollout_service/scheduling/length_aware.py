"""Length-aware placement: longest predicted first, onto the engine where it
raises the predicted makespan least (LPT), with late binding.

An engine's predicted time left is counted in decode steps of a lone
sequence: its longest predicted remaining response (and no less than its
remaining tokens over `max_seqs`), plus `per_sequence_cost` per remaining
token (every sequence in a step makes the step longer for all) and
`prefill_cost` per prompt token placed on it (a prefill stalls its batch).
Each queued request, longest predicted first, goes to the engine with free
slots where the larger of that engine's new time and the fleet's current
maximum is least; among the engines it leaves below that maximum, to the one
with the least predicted work (short requests are spread, not stacked under
a long one whose prediction may be wrong).

Late binding: an engine takes no more than its `max_seqs`; the rest waits in
the service's queue and is placed as slots free (by then the predictor may
have heard from the request's siblings). A request is also held back when
every engine with a free slot would end later than the fleet's current
predicted makespan while an engine without a free slot is predicted to end
sooner (it will free a slot first): the engine running a long response
then keeps a small batch instead of taking the fleet's overflow.

Siblings of a GRPO group are spread like any other requests. Keeping a group
on one engine (`affinity_slack`, off by default) lets siblings share the
prompt's KV cache, but their lengths are correlated (a group that answers
long answers long on every sample): on the PolyTrace code replay it put the
long groups' samples together and made the step slower than spreading them.

Pure given its inputs: the queue, the load snapshot, the in-flight counts and
`load_of(engine_id)` -> (predicted remaining tokens, longest predicted
remaining response) of the requests in flight on an engine, which the core
binds. Work the service has already started (a carried or migrated partial)
stays ahead of fresh work.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from rollout_service.core.types import Request
from rollout_service.scheduling.length_predictor import LengthPredictor


class LengthAwarePlacement:
    name = "length-aware"

    def __init__(self, predictor: LengthPredictor | None = None, affinity_slack: float | None = None,
                 per_sequence_cost: float = 0.04, prefill_cost: float = 0.005, hold: bool = True) -> None:
        self.predictor = predictor or LengthPredictor()
        self.affinity_slack = affinity_slack
        self.per_sequence_cost = per_sequence_cost
        self.prefill_cost = prefill_cost
        self.hold = hold
        self.load_of: Callable[[str], tuple[float, float]] = lambda engine_id: (0.0, 0.0)
        self._group_home: dict[str, str] = {}

    def bind(self, load_of: Callable[[str], tuple[float, float]]) -> None:
        self.load_of = load_of

    def place(self, queue: deque[Request], loads, assigned):
        engines = [l for l in loads if l.state in ("ready", "updating")]
        free = {l.engine_id: l.max_seqs - assigned.get(l.engine_id, 0) for l in engines}
        free = {e: n for e, n in free.items() if n > 0}
        if not free or not queue:
            return []
        cap = {l.engine_id: max(1, l.max_seqs) for l in engines}
        work, longest = {}, {}
        for l in engines:
            work[l.engine_id], longest[l.engine_id] = self.load_of(l.engine_id)
        prefill = {e: 0.0 for e in cap}  # prompt tokens this call places there

        def time(e: str, add: float = 0.0, context: int = 0) -> float:
            w = work[e] + add
            return (max(longest[e], add, w / cap[e]) + self.per_sequence_cost * w
                    + self.prefill_cost * (prefill[e] + context))

        remaining = {id(r): self.predictor.predict(r).median for r in queue}
        order = sorted(queue, key=lambda r: (not r.token_ids, -(len(r.token_ids) + remaining[id(r)])))
        out: list[tuple[Request, str]] = []
        placed: set[int] = set()
        times = {e: time(e) for e in cap}
        for req in order:
            if not free:
                break
            add = remaining[id(req)]
            context = len(req.group.spec.prompt_token_ids) + len(req.token_ids)
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
            placed.add(id(req))
            work[target] += add
            longest[target] = max(longest[target], add)
            prefill[target] += context
            times[target] = time(target)
            free[target] -= 1
            if free[target] == 0:
                del free[target]
        if placed:
            rest = [r for r in queue if id(r) not in placed]
            queue.clear()
            queue.extend(rest)
        if len(self._group_home) > 100_000:
            self._group_home.clear()
        return out
