"""The fleet side of the core: restarting engines that die, and moving work
between engines (length-aware rebalancing with partial-rollout migration).

Mixed into `RolloutCore`; it uses the core's queue, running set and
`preempt`/`migrate`/`_requeue`.
"""
from __future__ import annotations

import asyncio
import logging

from rollout_service.engines.base import Engine
from rollout_service.scheduling.rebalancer import EngineView, Move, RequestView, is_drained, plan_moves

log = logging.getLogger("rollout_service.core.rollout")


class FleetMixin:
    # -- engine health -----------------------------------------------------------

    async def _watch_loop(self) -> None:
        """Restart engines that died. Their requests were already re-queued
        with their partial responses by the runners that saw them fail."""
        while True:
            await asyncio.sleep(self.limits.health_interval_s)
            for engine_id, engine in self.engines.items():
                if engine_id not in self._restarting and engine.load().state == "dead":
                    self._restarting.add(engine_id)
                    asyncio.create_task(self._restart(engine), name=f"restart-{engine_id}")

    async def _restart(self, engine: Engine) -> None:
        log.warning("engine %s died; restarting it", engine.engine_id)
        self.counters["engine_restarts"] += 1
        # Anything still placed there is lost to that process: continue it elsewhere.
        for req, _ in [v for v in self.running.values() if v[0].engine_id == engine.engine_id]:
            await self.preempt(req)
            self._requeue(req)
        try:
            await engine.start()
            async with self._weights_lock:  # not halfway through a push
                if self._last_weights is not None:
                    # A fresh engine serves the model's original weights: bring
                    # it to the current policy before it takes requests.
                    await engine.update_weights(self.policy_version, self._last_weights)
            log.info("engine %s is back", engine.engine_id)
        except Exception:
            log.exception("restart of %s failed; will retry", engine.engine_id)
        finally:
            self._restarting.discard(engine.engine_id)
            self._wake.set()

    # -- length-aware scheduling -----------------------------------------------------

    def predicted_load(self, engine_id: str) -> tuple[float, float]:
        """Predicted remaining tokens of the requests placed on an engine, and
        the longest of them (computed for every engine at once, once per dispatch)."""
        if self.predictor is None:
            return 0.0, 0.0
        cache = self._work_cache
        if cache is None:
            cache = {}
            for r, _ in self.running.values():
                if r.engine_id is not None:
                    left = self.predictor.predict(r).median
                    work, longest = cache.get(r.engine_id, (0.0, 0.0))
                    cache[r.engine_id] = (work + left, max(longest, left))
            if self._dispatching:
                self._work_cache = cache
        return cache.get(engine_id, (0.0, 0.0))

    async def _rebalance_loop(self) -> None:
        while True:
            await asyncio.sleep(self.rebalance.interval_s)
            if len(self.running) > 1:
                try:
                    await self.rebalance_once()
                except Exception:  # a policy bug must not stop the service
                    log.exception("rebalancing failed")

    async def rebalance_once(self) -> list[Move]:
        """Ask the rebalancer for moves on the current snapshot; apply them."""
        now = self.clock.monotonic()
        engines = []
        for eid, engine in self.engines.items():
            load = engine.load()
            engines.append(EngineView(eid, self.assigned[eid], load.waiting, load.max_seqs,
                                      ready=load.state == "ready" and eid not in self._restarting,
                                      kv_used=load.kv_used_tokens, kv_capacity=load.kv_capacity_tokens))
        if not (self.rebalance.isolate_tail or self.rebalance.repack) and not any(is_drained(self.rebalance, e) for e in engines):
            return []  # nothing can take work: skip the predictions
        views = []
        repack = self.rebalance.repack  # the only reader of `informed`
        for req, _ in self.running.values():
            if req.engine_id is None:
                continue
            est = self.predictor.predict(req)
            views.append(RequestView(
                req.request_id, req.engine_id, est.median, est.high,
                len(req.group.spec.prompt_token_ids) + len(req.token_ids), req.num_migrations,
                req.engines[-2] if len(req.engines) > 1 else None, req.moved_at,
                started=len(req.token_ids) > req.segment_start, informed=self.predictor.informed(req) if repack else True,
            ))
        moves = plan_moves(self.rebalance, engines, views, now)
        for move in moves:
            entry = self.running.get(move.request_id)
            if entry is not None and entry[0].engine_id == move.source:
                await self.migrate(entry[0], move.target)  # None: to the head of the queue
        return moves
