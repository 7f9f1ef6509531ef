"""Rebalancing with partial-rollout migration (a pure decision function).

`plan_moves(cfg, engines, requests, now)` returns the moves for one tick,
the same for the same snapshot:

1. Filling drained engines: when an engine drains (few requests, little KV
   in use, nothing waiting) while another is predicted to run at least
   `imbalance_ratio` times longer, requests move from the loaded engine to
   the drained one (abort with the partial response on the source, continue
   from the same prefix on the target: re-prefill). A move must shorten the
   larger of the two engines' predicted times (scheduling/cost_model.py) by
   `min_gain`, counting the re-prefill of its context on the target; among
   equally good moves, one that has not produced a token on its engine yet
   goes first.
2. Otherwise, with `repack`, regrouping in-flight requests onto engines of
   like predicted lengths (`repack`).
3. Otherwise, with `isolate_tail`, moving the co-runners off the engines
   whose longest response may end the step (`isolate_tail`): to an engine
   with a free slot, else to the head of the service's queue (`target` None).

A request moves only if `movable`: not about to finish, at most
`max_migrations` times, not within `cooldown_s` of its last move, never
straight back to the engine it just left, and (once started) only if its
predicted remaining decode outweighs the re-prefill of its context.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rollout_service.scheduling.cost_model import CostModel
from rollout_service.scheduling.search import least_feasible


@dataclass(slots=True)
class RebalanceConfig:
    enabled: bool = False  # the service runs the rebalancer only when set
    interval_s: float = 0.1  # how often the core asks for decisions
    drained_fraction: float = 0.25  # a target runs fewer than this share of max_seqs, nothing waiting...
    drained_kv_fraction: float = 0.5  # ...and uses less than this share of its KV cache
    imbalance_ratio: float = 2.0  # the source's predicted time left is this many times the target's (0: no checks)
    min_gain: float = 0.05  # a move shortens the larger of the two predicted times by this share
    min_remaining_tokens: int = 32  # never move a request predicted to finish sooner
    prefill_cost: float = 0.02  # re-prefilling one token costs this many lone decode steps
    per_sequence_cost: float = 0.04  # one more sequence in a step costs this share of a lone step
    per_context_token_cost: float = 0.0  # one context token in a step costs this share of a lone step
    max_migrations: int = 2  # per request
    max_moves_per_tick: int = 16
    cooldown_s: float = 1.0  # a moved request stays put at least this long
    isolate_tail: bool = False  # move co-runners off the engines whose longest response may end the step
    repack: bool = False  # regroup in-flight requests onto engines of like predicted lengths

    def cost_model(self) -> CostModel:
        """The cost model these settings configure (scheduling/cost_model.py)."""
        return CostModel(self.per_sequence_cost, self.per_context_token_cost, self.prefill_cost)


@dataclass(slots=True)
class EngineView:
    engine_id: str
    running: int  # requests the service has placed there
    waiting: int  # of those, not yet in the engine's batch
    max_seqs: int
    ready: bool = True
    kv_used: int = 0  # tokens of KV cache in use
    kv_capacity: int = 0  # 0: unknown (no KV terms)


@dataclass(slots=True)
class RequestView:
    request_id: str
    engine_id: str
    remaining: float  # predicted median remaining tokens
    remaining_high: float  # predicted high quantile
    context_tokens: int  # prompt + generated (the re-prefill cost)
    migrations: int = 0
    previous_engine: str | None = None  # the engine it was moved from last
    moved_at: float = float("-inf")
    started: bool = True  # has produced a token on its current engine
    informed: bool = True  # its prediction rests on its own group or prompt (finished siblings, history)


@dataclass(slots=True)
class Move:
    request_id: str
    source: str
    target: str | None  # None: back to the head of the service's queue
    reason: str = ""


@dataclass(slots=True)
class _Load:
    view: EngineView
    requests: list[RequestView] = field(default_factory=list)
    time: float = 0.0
    reprefill: int = 0  # tokens the moves of this tick make it prefill again


def is_drained(cfg: RebalanceConfig, engine: EngineView) -> bool:
    """Can this engine take work: ready, nothing waiting, batch below the
    threshold and (when its cache size is known) KV cache below the threshold."""
    if not engine.ready or engine.waiting or engine.running >= cfg.drained_fraction * engine.max_seqs:
        return False
    return engine.kv_capacity <= 0 or engine.kv_used < cfg.drained_kv_fraction * engine.kv_capacity


def predicted_time(cfg: RebalanceConfig, engine: EngineView, requests: list[RequestView],
                   reprefill: int = 0) -> float:
    """Predicted time until `engine` finishes `requests`, in decode steps of a
    lone sequence, plus the prefill of `reprefill` tokens (`CostModel.time`)."""
    cost = cfg.cost_model()
    if not requests:
        return cost.time(0.0, 0.0, engine.max_seqs, prefill_tokens=reprefill)
    remaining = [max(0.0, r.remaining) for r in requests]
    # KV load left: each step holds every running request's context.
    kv_load = sum(x * r.context_tokens + x * x / 2 for x, r in zip(remaining, requests))
    return cost.time(max(remaining), sum(remaining), engine.max_seqs, kv_load, engine.kv_capacity, reprefill)


def plan_moves(cfg: RebalanceConfig, engines: list[EngineView], requests: list[RequestView], now: float) -> list[Move]:
    """Migration decisions for one tick (pure: same snapshot, same answer)."""
    loads = {e.engine_id: _Load(e) for e in engines}
    for r in requests:
        if r.engine_id in loads:
            loads[r.engine_id].requests.append(r)
    for load in loads.values():
        load.time = predicted_time(cfg, load.view, load.requests)
    ready = [l for l in loads.values() if l.view.ready]
    drained = sorted((l for l in ready if is_drained(cfg, l.view)), key=lambda l: (l.time, l.view.engine_id))
    moves: list[Move] = []
    for target in drained:
        while len(moves) < cfg.max_moves_per_tick:
            source = max((l for l in ready if l is not target and len(l.requests) > 1),
                         key=lambda l: (l.time, l.view.engine_id), default=None)
            if source is None or source.time < cfg.imbalance_ratio * target.time:
                break
            pick = _best_candidate(cfg, source, target, now)
            if pick is None:
                break
            r, source_time, target_time = pick
            moves.append(Move(r.request_id, source.view.engine_id, target.view.engine_id,
                              f"predicted {source.time:.0f} steps left on {source.view.engine_id}, "
                              f"{target.time:.0f} on {target.view.engine_id}"))
            source.requests.remove(r)
            source.time = source_time
            # On the target it has started (its prefix is prefilled there).
            target.requests.append(RequestView(r.request_id, target.view.engine_id, r.remaining, r.remaining_high,
                                               r.context_tokens, r.migrations + 1, source.view.engine_id, now))
            target.time = target_time
            target.reprefill += r.context_tokens
            if len(target.requests) >= cfg.drained_fraction * target.view.max_seqs:
                break
    if cfg.repack and not moves:
        moves = repack(cfg, ready, now)[: cfg.max_moves_per_tick]
    if cfg.isolate_tail and not moves:  # a tick either fills drained engines or isolates a tail
        moves = isolate_tail(cfg, ready, now)[: cfg.max_moves_per_tick]
    return moves


def repack(cfg: RebalanceConfig, ready: list[_Load], now: float) -> list[Move]:
    """Moves that regroup the in-flight requests onto engines of like
    predicted lengths (the packing of `LengthPackedPlacement`): the least predicted makespan T for which the requests,
    longest predicted first, fit first-fit onto the engines (those running
    the longest responses first), if T is `min_gain` below the current
    predicted makespan after the moved requests' re-prefill. Only requests
    whose prediction rests on their own group or prompt move."""
    if len(ready) < 2:
        return []
    current = max(l.time for l in ready)
    engines = sorted(ready, key=lambda l: (-max((r.remaining for r in l.requests), default=0.0), l.view.engine_id))
    pinned = {l.view.engine_id: [r for r in l.requests if not (r.informed and movable(cfg, r, None, now))]
              for l in engines}
    loose = sorted((r for l in engines for r in l.requests if r.informed and movable(cfg, r, None, now)),
                   key=lambda r: (-r.remaining, r.request_id))
    if not loose:
        return []

    def assign(T: float):
        placed = {l.view.engine_id: list(pinned[l.view.engine_id]) for l in engines}
        reprefill = {l.view.engine_id: 0 for l in engines}
        plan = {}
        for r in loose:
            for l in engines:  # first fit
                eid = l.view.engine_id
                if len(placed[eid]) >= l.view.max_seqs or (eid != r.engine_id and r.previous_engine == eid):
                    continue
                extra = 0 if eid == r.engine_id else r.context_tokens
                if predicted_time(cfg, l.view, placed[eid] + [r], reprefill[eid] + extra) <= T:
                    placed[eid].append(r)
                    reprefill[eid] += extra
                    plan[r.request_id] = eid
                    break
            else:
                return None
        return plan

    hi = (1 - cfg.min_gain) * current
    if assign(hi) is None:
        return []  # no regrouping shortens the predicted makespan enough
    hi, plan = least_feasible(assign, 0.0, hi, rounds=20)
    return [Move(r.request_id, r.engine_id, plan[r.request_id],
                 f"regrouping by predicted length: predicted makespan {current:.0f} -> {hi:.0f} steps")
            for r in loose if plan[r.request_id] != r.engine_id]


def _best_candidate(cfg: RebalanceConfig, source: _Load, target: _Load,
                    now: float) -> tuple[RequestView, float, float] | None:
    """The request whose move leaves the smaller maximum of the two engines'
    predicted times (and that time on each), if any move pays for itself."""
    checks = cfg.imbalance_ratio > 0
    best, best_key = None, None
    for r in source.requests:
        if not movable(cfg, r, target.view.engine_id, now):
            continue
        rest = [x for x in source.requests if x is not r]
        moved = RequestView(r.request_id, target.view.engine_id, r.remaining, r.remaining_high, r.context_tokens)
        source_time = predicted_time(cfg, source.view, rest, reprefill=source.reprefill)
        target_time = predicted_time(cfg, target.view, target.requests + [moved],
                                     reprefill=target.reprefill + r.context_tokens)
        after = max(source_time, target_time)
        if checks and after > (1 - cfg.min_gain) * source.time:
            continue  # does not pay for itself
        key = (after, r.started, -r.remaining_high, -r.remaining)
        if best_key is None or key < best_key:
            best, best_key = (r, source_time, target_time), key
    return best


def movable(cfg: RebalanceConfig, r: RequestView, target: str | None, now: float) -> bool:
    """May `r` move now (to `target`; None: to the service's queue)?"""
    if r.remaining < cfg.min_remaining_tokens:
        return False  # about to finish
    if r.migrations >= cfg.max_migrations or now - r.moved_at < cfg.cooldown_s:
        return False
    if target is not None and r.previous_engine == target:
        return False  # no ping-pong
    # A started request loses its KV cache: the re-prefill must cost less than it saves.
    return not (r.started and r.remaining <= cfg.prefill_cost * r.context_tokens)


def isolate_tail(cfg: RebalanceConfig, ready: list[_Load], now: float) -> list[Move]:
    """Moves that take the other requests off the engines whose longest
    response may end the step (module docstring): every engine predicted
    within `min_gain` of the fleet's maximum, longest first. An engine's
    co-runners move when that shortens its predicted time by `min_gain`, each
    to the engine where it ends soonest, and only where it still ends before
    the tail would alone."""
    if not ready:
        return []
    top = max(l.time for l in ready)
    line = (1 - cfg.min_gain) * top
    critical = sorted((l for l in ready if l.time >= line and len(l.requests) > 1),
                      key=lambda l: (-l.time, l.view.engine_id))
    others = [_Load(l.view, list(l.requests), l.time, l.reprefill) for l in ready if l.time < line]
    free = {l.view.engine_id: l.view.max_seqs - l.view.running for l in others}
    moves: list[Move] = []
    for source in critical:
        tail = max(source.requests, key=lambda r: (r.remaining, r.remaining_high, r.request_id))
        floor = predicted_time(cfg, source.view, [tail] + [r for r in source.requests
                                                           if r is not tail and not movable(cfg, r, None, now)])
        keep, plan = [tail], []
        added: dict[int, tuple[list[RequestView], int, float]] = {}  # index in others -> (requests, reprefill, time)
        # Requests that have not started lose nothing; then the largest gains first.
        for r in sorted(source.requests, key=lambda r: (r.started, -r.remaining, r.request_id)):
            if r is tail:
                continue
            best, best_time = None, None
            if movable(cfg, r, None, now):
                for i, load in enumerate(others):
                    if r.previous_engine == load.view.engine_id:
                        continue
                    reqs, reprefill, _ = added.get(i, (load.requests, load.reprefill, load.time))
                    view = RequestView(r.request_id, load.view.engine_id, r.remaining, r.remaining_high,
                                       r.context_tokens)
                    t = predicted_time(cfg, load.view, reqs + [view], reprefill=reprefill + r.context_tokens)
                    if best_time is None or t < best_time:
                        best, best_time = i, t
            if best is None or best_time > floor:
                keep.append(r)  # it would end after the tail does: it stays
                continue
            reqs, reprefill, _ = added.get(best, (others[best].requests, others[best].reprefill, 0.0))
            view = RequestView(r.request_id, others[best].view.engine_id, r.remaining, r.remaining_high,
                               r.context_tokens)
            added[best] = (reqs + [view], reprefill + r.context_tokens, best_time)
            plan.append((r, best))
        after = predicted_time(cfg, source.view, keep)
        if not plan or after > (1 - cfg.min_gain) * source.time:
            continue  # not worth it on this engine
        for i, (reqs, reprefill, t) in added.items():
            others[i].requests, others[i].reprefill, others[i].time = reqs, reprefill, t
        for r, i in plan:
            eid = others[i].view.engine_id
            target = eid if free.get(eid, 0) > 0 else None  # full: wait in the service's queue
            if target is not None:
                free[eid] -= 1
            moves.append(Move(r.request_id, source.view.engine_id, target,
                              f"isolating {tail.request_id} on {source.view.engine_id}: predicted "
                              f"{source.time:.0f} steps left there, {after:.0f} after the moves"))
    return moves
