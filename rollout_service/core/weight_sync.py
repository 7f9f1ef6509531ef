"""Weight updates in the core: verify, apply on every engine at a safe
point, bump the policy version, and carry unfinished work over (continue,
pause-resume or restart, under `max_version_lag`; see partial/carry_over.py).

Mixed into `RolloutCore`.
"""
from __future__ import annotations

import asyncio
from collections import deque
from typing import Mapping

from rollout_service.engines.types import FinishReason
from rollout_service.lifecycle.types import CoreError, Group, Request, Sample, SampleEvent
from rollout_service.engines.weights import StagedWeights
from rollout_service.partial.carry_over import CarryPlan, plan_carry_over


class WeightSyncMixin:
    # -- weights -----------------------------------------------------------------

    def check_weights(self, version: int, manifest: Mapping[str, tuple[str, tuple[int, ...]]]) -> None:
        if version <= self.policy_version:
            raise CoreError("invalid", f"version must be greater than the serving version {self.policy_version}, got {version}")
        for engine in self.engines.values():
            engine.check_weights(manifest)

    async def update_weights(self, version: int, weights: StagedWeights) -> int:
        """Apply verified weights on every engine at a safe point, then bump
        the policy version; tokens sampled afterwards carry the new version.
        Engines that are down get them when they come back (see `_restart`).
        Unfinished requests are carried over per `carry_over` (continue,
        pause-resume or restart, under `max_version_lag`). If an engine fails,
        the serving version stays and the error is raised (each token's tag
        still names the weights that produced it)."""
        async with self._weights_lock:
            self.check_weights(version, {})
            t0 = self.clock.monotonic()
            unfinished = [r for g in self.groups.values() if not g.aborted for r in g.requests if r.finish_reason is None]
            plan = plan_carry_over(self.carry_over, unfinished, set(self.running), version)
            for req in plan.preempt:
                await self.preempt(req)
            # An engine that is down (a dead Ray node may stay down for long)
            # does not block training: its restart applies these weights.
            live = [e for eid, e in self.engines.items() if eid not in self._restarting and e.load().state != "dead"]
            try:
                await asyncio.gather(*(e.update_weights(version, weights) for e in live))
            except BaseException:
                weights.cleanup()
                self._requeue_front([r for r in plan.preempt if r.engine_id is None])
                raise
            # Kept staged so that an engine restarted later gets the same weights.
            previous, self._last_weights = self._last_weights, weights
            if previous is not None:
                previous.cleanup()
            self.policy_version = version
            self.counters["weight_updates"] += 1
            self.histograms["weight_update_seconds"].observe(self.clock.monotonic() - t0)
            self._apply_carry(plan, unfinished)
            return version

    def _apply_carry(self, plan: CarryPlan, unfinished: list[Request]) -> None:
        restart = {r.request_id for r in plan.restart}
        dropped = {g.group_id for g in plan.drop}
        for req in plan.restart:
            self.counters["tokens_discarded"] += len(req.token_ids)
            req.reset()
        self.counters["tokens_carried"] += sum(
            len(r.token_ids) for r in unfinished if r.request_id not in restart and r.group.group_id not in dropped
        )
        self._requeue_front([r for r in plan.preempt if r.group.group_id not in dropped])
        for group in plan.drop:
            self._drop(group, "max_version_lag")

    def _requeue_front(self, reqs: list[Request]) -> None:
        """Queue carried requests ahead of new work, keeping their order."""
        self.queue.extendleft(reversed([r for r in reqs if r.engine_id is None and not r.group.aborted]))
        self._wake.set()

    def _drop(self, group: Group, reason: str) -> None:
        """Give up a group: its unfinished samples are delivered as aborted,
        with the reason, so nothing submitted goes unaccounted for."""
        group.aborted = True
        ids = {r.request_id for r in group.requests}
        self.queue = deque(r for r in self.queue if r.request_id not in ids)
        pending = [r for r in group.requests if r.finish_reason is None]
        for req in pending:
            if req.engine_id is not None:
                # Still on an engine: stop it (its runner drops what follows).
                engine_id, req.engine_id = req.engine_id, None
                self.running.pop(req.request_id, None)
                self.assigned[engine_id] -= 1
                asyncio.create_task(self.engines[engine_id].abort(req.request_id))
            req.finish_reason = FinishReason.ABORTED
            req.finished_at = self.clock.now()
            group.finished += 1
            sample = Sample.from_request(req, FinishReason.ABORTED)
            sample.drop_reason = reason
            if group.listener is not None:
                group.listener.put_nowait(SampleEvent(sample))
            else:
                self.delivery.append(sample, group.finished == group.spec.num_samples)
        self.counters["groups_dropped"] += 1
        self.counters["samples_dropped"] += len(pending)
        self._forget(group)
