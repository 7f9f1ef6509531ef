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

With `pack` (the `length-packed` placement) it packs instead of spreading:
engines of like predicted lengths, long responses together in small
batches, short ones in large batches elsewhere (`_place_packed`). With the
true lengths that is the better schedule when many responses are long (the
PolyTrace code replay); with the service's predictions at placement it is
worse than spreading, since it commits to lengths it does not know yet.

Pure given its inputs: the queue, the load snapshot, the in-flight counts and
`load_of(engine_id)` -> (predicted remaining tokens, longest predicted
remaining response) of the requests in flight on an engine, which the core
binds. Work the service has already started (a carried or migrated partial)
stays ahead of fresh work.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from rollout_service.lifecycle.types import Request
from rollout_service.scheduling.length_predictor import LengthPredictor
from rollout_service.scheduling.rebalancer import least_feasible


class LengthAwarePlacement:
    name = "length-aware"

    def __init__(self, predictor: LengthPredictor | None = None, affinity_slack: float | None = None,
                 per_sequence_cost: float = 0.04, prefill_cost: float = 0.005, hold: bool = True,
                 pack: bool = False) -> None:
        self.predictor = predictor or LengthPredictor()
        self.pack = pack
        self.affinity_slack = affinity_slack
        self.per_sequence_cost = per_sequence_cost
        self.prefill_cost = prefill_cost
        self.hold = hold
        self.load_of: Callable[[str], tuple[float, float]] = lambda engine_id: (0.0, 0.0)
        self._group_home: dict[str, str] = {}

    def bind(self, load_of: Callable[[str], tuple[float, float]]) -> None:
        self.load_of = load_of

    def place(self, queue: deque[Request], loads, assigned):
        if self.pack:
            return self._place_packed(queue, loads, assigned)
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

    # -- packing: engines of like lengths ------------------------------------------

    def _place_packed(self, queue: deque[Request], loads, assigned):
        """Length-sorted packing: the least predicted makespan T for which the
        queue, longest predicted first, fits first-fit onto the engines (the
        engines already running the longest responses first), each engine's
        predicted time staying at most T. Long responses then share engines
        with long ones in small batches and short ones fill large batches
        elsewhere: with a step cost of `1 + per_sequence_cost * running`, an
        engine ends after its longest response plus `per_sequence_cost` per
        token it carries, so engines whose longest response is short can
        carry many more tokens in the same time than a longest-first spread
        (LPT), which puts a long response on every engine, allows."""
        engines = [l for l in loads if l.state in ("ready", "updating")]
        free = {l.engine_id: l.max_seqs - assigned.get(l.engine_id, 0) for l in engines}
        if not queue or not any(n > 0 for n in free.values()):
            return []
        cap = {l.engine_id: max(1, l.max_seqs) for l in engines}
        work, longest = {}, {}
        for l in engines:
            work[l.engine_id], longest[l.engine_id] = self.load_of(l.engine_id)
        order_e = sorted(cap, key=lambda e: (-longest[e], e))
        remaining = {id(r): self.predictor.predict(r).median for r in queue}
        order = sorted(queue, key=lambda r: (not r.token_ids, -(len(r.token_ids) + remaining[id(r)])))

        def time(e, w, lng, prefill):
            return max(lng, w / cap[e]) + self.per_sequence_cost * w + self.prefill_cost * prefill

        def assign(T: float):
            """First fit under T; None if a request fits nowhere while slots are free."""
            w, lng, pre, slots = dict(work), dict(longest), {e: 0.0 for e in cap}, dict(free)
            out = []
            for req in order:
                open_ = [e for e in order_e if slots.get(e, 0) > 0]
                if not open_:
                    break  # the rest waits for slots
                add = remaining[id(req)]
                context = len(req.group.spec.prompt_token_ids) + len(req.token_ids)
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
        placed = {id(r) for r, _ in out}
        if placed:
            rest = [r for r in queue if id(r) not in placed]
            queue.clear()
            queue.extend(rest)
        return out
