"""Length-aware scheduling state in the core: the length predictor, the
predicted load in flight per engine (placement reads it), and rebalancing:
on every tick, a snapshot of the engines and of the requests on them goes to
the pure rebalancer (scheduling/rebalancer.py); the moves it returns are
applied as migrations.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from rollout_service.core.fleet import Fleet
from rollout_service.core.requests import RequestTable
from rollout_service.lifecycle.types import Request
from rollout_service.scheduling.cost_model import CostModel
from rollout_service.scheduling.length_predictor import LengthPredictor
from rollout_service.scheduling.rebalancer import EngineView, Move, RebalanceConfig, RequestView, is_drained, plan_moves

log = logging.getLogger(__name__)


class Rebalancing:
    def __init__(self, config: RebalanceConfig | None, predictor: LengthPredictor | None, fleet: Fleet,
                 requests: RequestTable, migrate: Callable[[Request, str | None], Awaitable[None]],
                 monotonic: Callable[[], float]) -> None:
        self.config = config  # None: off
        self.predictor = predictor
        self._fleet = fleet
        self._requests = requests
        self._migrate = migrate
        self._monotonic = monotonic

    @property
    def cost_model(self) -> CostModel:
        """The cost model placement and rebalancing price time with (the
        rebalancer's settings, its defaults when it is off)."""
        return (self.config or RebalanceConfig()).cost_model()

    async def loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            if len(self._requests) > 1:
                try:
                    await self.once()
                except Exception:  # a policy bug must not stop the service
                    log.exception("rebalancing failed")

    def predicted_loads(self) -> dict[str, tuple[float, float]]:
        """engine id -> (predicted remaining tokens, longest predicted
        remaining response) of the requests running there ({} without a
        predictor)."""
        loads: dict[str, tuple[float, float]] = {}
        if self.predictor is None:
            return loads
        for r in self._requests.attached():
            left = self.predictor.predict(r).median
            work, longest = loads.get(r.engine_id, (0.0, 0.0))
            loads[r.engine_id] = (work + left, max(longest, left))
        return loads

    def engine_views(self) -> list[EngineView]:
        views = []
        for eid, engine in self._fleet.engines.items():
            load = engine.load()
            views.append(EngineView(eid, self._requests.assigned(eid), load.waiting, load.max_seqs,
                                    ready=load.state == "ready" and not self._fleet.is_restarting(eid),
                                    kv_used=load.kv_used_tokens, kv_capacity=load.kv_capacity_tokens))
        return views

    def request_views(self) -> list[RequestView]:
        repack = self.config.repack  # the only reader of `informed`
        views = []
        for req in self._requests.attached():
            est = self.predictor.predict(req)
            views.append(RequestView(
                request_id=req.request_id, engine_id=req.engine_id, remaining=est.median, remaining_high=est.high,
                context_tokens=len(req.group.spec.prompt_token_ids) + len(req.token_ids),
                migrations=req.num_migrations, previous_engine=req.engines[-2] if len(req.engines) > 1 else None,
                moved_at=req.moved_at, started=len(req.token_ids) > req.segment_start,
                informed=self.predictor.informed(req) if repack else True,
            ))
        return views

    async def once(self) -> list[Move]:
        """Ask the rebalancer for moves on the current snapshot; apply them."""
        cfg = self.config
        now = self._monotonic()
        engines = self.engine_views()
        if not (cfg.isolate_tail or cfg.repack) and not any(is_drained(cfg, e) for e in engines):
            return []  # nothing can take work: skip the predictions
        moves = plan_moves(cfg, engines, self.request_views(), now)
        for move in moves:
            req = self._requests.get(move.request_id)
            if req is not None and req.engine_id == move.source:
                await self._migrate(req, move.target)  # None: to the head of the queue
        return moves
