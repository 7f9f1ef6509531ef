"""Rebalancing with partial-rollout migration (a pure decision function).

When an engine drains (its batch falls below a threshold with nothing
waiting) while another still holds much more predicted work, move the
longest in-flight requests from the loaded engine to the drained one: abort
with the partial response on the source, continue from the same prefix on
the target (re-prefill). Moves must pay for themselves: a request is moved
only if its predicted remaining decode outweighs the re-prefill of its
context, never when it is about to finish, never more than
`max_migrations` times, and never straight back to an engine it just left.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RebalanceConfig:
    enabled: bool = False  # the service runs the rebalancer only when set
    interval_s: float = 0.1  # how often the core asks for decisions
    drained_fraction: float = 0.25  # an engine below this share of max_seqs, nothing waiting, takes work
    imbalance_ratio: float = 2.0  # the source must hold this many times the target's predicted work
    min_remaining_tokens: int = 32  # never move a request predicted to finish sooner
    prefill_cost: float = 0.02  # re-prefilling one token costs this many decode tokens of time
    max_migrations: int = 2  # per request
    max_moves_per_tick: int = 16
    cooldown_s: float = 1.0  # a moved request stays put at least this long


@dataclass(slots=True)
class EngineView:
    engine_id: str
    running: int  # requests the service has placed there
    waiting: int  # of those, not yet in the engine's batch
    max_seqs: int
    ready: bool = True


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


@dataclass(slots=True)
class Move:
    request_id: str
    source: str
    target: str
    reason: str = ""


@dataclass(slots=True)
class _Load:
    view: EngineView
    work: float = 0.0
    requests: list[RequestView] = field(default_factory=list)


def is_drained(cfg: RebalanceConfig, engine: EngineView) -> bool:
    """Can this engine take work: ready, nothing waiting, batch below the threshold."""
    return engine.ready and engine.waiting == 0 and engine.running < cfg.drained_fraction * engine.max_seqs


def plan_moves(cfg: RebalanceConfig, engines: list[EngineView], requests: list[RequestView], now: float) -> list[Move]:
    """Migration decisions for one tick (pure: same snapshot, same answer)."""
    loads = {e.engine_id: _Load(e) for e in engines}
    for r in requests:
        if r.engine_id in loads:
            loads[r.engine_id].work += r.remaining
            loads[r.engine_id].requests.append(r)
    ready = [l for l in loads.values() if l.view.ready]
    drained = sorted(
        (l for l in ready if is_drained(cfg, l.view) and len(l.requests) < cfg.drained_fraction * l.view.max_seqs),
        key=lambda l: l.work,
    )
    moves: list[Move] = []
    for target in drained:
        while len(moves) < cfg.max_moves_per_tick:
            source = max((l for l in ready if l is not target and len(l.requests) > 1), key=lambda l: l.work, default=None)
            if source is None or source.work <= cfg.imbalance_ratio * max(target.work, 1.0):
                break
            pick = _best_candidate(cfg, source, target, now)
            if pick is None:
                break
            moves.append(Move(pick.request_id, source.view.engine_id, target.view.engine_id,
                              f"{source.view.engine_id} holds {source.work:.0f} predicted tokens, "
                              f"{target.view.engine_id} {target.work:.0f}"))
            source.requests.remove(pick)
            source.work -= pick.remaining
            target.requests.append(pick)
            target.work += pick.remaining
            if len(target.requests) >= cfg.drained_fraction * target.view.max_seqs:
                break
    return moves


def _best_candidate(cfg: RebalanceConfig, source: _Load, target: _Load, now: float) -> RequestView | None:
    best = None
    for r in source.requests:
        if r.remaining < cfg.min_remaining_tokens:
            continue  # about to finish
        if r.migrations >= cfg.max_migrations or now - r.moved_at < cfg.cooldown_s:
            continue
        if r.previous_engine == target.view.engine_id:
            continue  # no ping-pong
        if r.remaining <= cfg.prefill_cost * r.context_tokens:
            continue  # the re-prefill would cost more than it saves
        if best is None or (r.remaining_high, r.remaining) > (best.remaining_high, best.remaining):
            best = r
    return best
