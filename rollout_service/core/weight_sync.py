"""Weight updates: verify, apply on every live engine at a safe point, bump
the policy version, and carry unfinished work over (continue, pause-resume
or restart, under `max_version_lag`; see partial/carry_over.py).

`WeightSync` owns the serving policy version, the weights lock, the weights
last applied (kept staged for engines that restart) and weights restored
from a checkpoint. What it does to requests it asks of the core through
`WorkOps`.
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Awaitable, Callable, Mapping, Protocol

from rollout_service.core.fleet import Fleet
from rollout_service.core.histogram import Histogram
from rollout_service.engines.base import Engine
from rollout_service.engines.weights import StagedWeights
from rollout_service.lifecycle.types import CoreError, Group, Request
from rollout_service.partial.carry_over import CarryOverConfig, CarryPlan, plan_carry_over

log = logging.getLogger(__name__)


class WorkOps(Protocol):
    """What a weight update does to the core's requests."""

    def unfinished(self) -> list[Request]: ...
    def running_ids(self) -> set[str]: ...
    async def preempt(self, req: Request) -> None: ...
    def requeue_front(self, reqs: list[Request]) -> None: ...
    async def give_up(self, group: Group, reason: str) -> None: ...
    def record_progress(self, req: Request) -> None: ...  # journal its state (after a reset)


class WeightStore(Protocol):
    """Where live versions' weights are kept across restarts (core/durable.py)."""

    failure: str  # why the store cannot be written ("" while it can)

    def write_weights(self, version: int, weights: StagedWeights | None) -> str | None: ...
    async def record_weights(self, version: int, file: str | None, restart: list[tuple[str, int]] = ()) -> None: ...


def _release(box: list[StagedWeights]) -> None:
    """Clean up the one StagedWeights in `box`, and drop it here (in this
    thread) with its file mapping."""
    staged = box.pop()
    staged.cleanup()
    del staged


class WeightSync:
    def __init__(self, fleet: Fleet, carry_over: CarryOverConfig, counters: Counter[str],
                 histogram: Histogram, monotonic: Callable[[], float]) -> None:
        self.fleet = fleet
        self.carry_over = carry_over
        self.version = 0  # the serving policy version
        self.lock = asyncio.Lock()
        self.last: StagedWeights | None = None  # applied last; kept staged for restarted engines
        self.restored: StagedWeights | None = None  # from a checkpoint, applied at start
        # Keeps each live version's weights (state_dir); a version is recorded
        # there, with its weights written, before it serves.
        self.store: WeightStore | None = None
        # Awaited with (version, its staged copy or None) once a version serves
        # everywhere, before the next push can release that copy.
        self.taps: list[Callable[[int, StagedWeights | None], Awaitable[None]]] = []
        self._counters = counters
        self._histogram = histogram
        self._monotonic = monotonic

    async def subscribe(self, tap: Callable[[int, StagedWeights | None], Awaitable[None]]) -> None:
        """Add a weight tap, and call it at once with the serving version when
        that is a pushed or restored one (not the model's own weights): a tap
        added after a restart from a checkpoint learns the checkpoint's policy.
        Under the push lock, so no push falls between the two."""
        async with self.lock:
            self.taps.append(tap)
            if self.version > 0:
                try:
                    await tap(self.version, self.last)
                except Exception:
                    log.exception("weight tap failed on the serving version %d", self.version)

    def check_version(self, version: int) -> None:
        """CoreError unless `version` is newer than the serving one."""
        if version <= self.version:
            raise CoreError("invalid", f"version must be greater than the serving version {self.version}, got {version}")

    def check_weights(self, version: int, manifest: Mapping[str, tuple[str, tuple[int, ...]]]) -> None:
        """CoreError unless `version` is newer; each engine raises if the
        manifest (name -> (dtype, shape)) does not fit its model; CoreError
        naming state_dir once the store cannot be written (a version that
        went live unrecorded would be lost by a restart)."""
        if self.store is not None and self.store.failure:
            raise CoreError("failed_precondition", self.store.failure)
        self.check_version(version)
        for engine in self.fleet.engines.values():
            engine.check_weights(manifest)

    async def apply_restored(self) -> None:
        """Serve the checkpoint's weights (at its version) on every engine."""
        if self.restored is None:
            return
        weights, self.restored = self.restored, None
        await asyncio.gather(*(e.update_weights(self.version, weights) for e in self.fleet.engines.values()))
        self.last = weights

    async def bring_up(self, engine: Engine) -> None:
        """A fresh engine serves the model's original weights: bring it to
        the current policy before it takes requests."""
        async with self.lock:  # not halfway through a push
            if self.last is not None:
                await engine.update_weights(self.version, self.last)

    async def _roll_back(self, engines: list[Engine]) -> None:
        """Put engines that applied a push that failed on others back on the
        serving weights (a failed push changes no engine's version). The
        model's own weights (version 0) are not staged: such an engine, or
        one that fails to go back, is closed, and the fleet restarts it on
        the serving weights."""
        if not engines:
            return
        if self.last is not None:
            results = await asyncio.gather(*(e.update_weights(self.version, self.last) for e in engines),
                                           return_exceptions=True)
            stuck = [e for e, r in zip(engines, results) if isinstance(r, BaseException)]
        else:
            stuck = list(engines)
        for engine in stuck:
            log.warning("engine %s applied a push that failed elsewhere; restarting it on version %d",
                        engine.engine_id, self.version)
            await engine.close()

    async def update(self, version: int, weights: StagedWeights, work: WorkOps) -> int:
        """Apply verified weights on every live engine at a safe point, then
        bump the policy version; tokens sampled afterwards carry the new
        version. Engines that are down get them when they come back
        (`bring_up`). Unfinished requests are carried over per `carry_over`.
        If an engine fails, the serving version stays and the error is raised
        (each token's tag still names the weights that produced it)."""
        async with self.lock:
            t0 = self._monotonic()
            unfinished, plan = await self._plan(version, work)
            # An engine that is down (a dead Ray node may stay down for long)
            # does not block training: its restart applies these weights.
            live = self.fleet.live()
            # Written to state_dir while the engines load them.
            keeping = asyncio.ensure_future(self._keep(version, weights)) if self.store is not None else None
            try:
                results = await asyncio.gather(*(e.update_weights(version, weights) for e in live),
                                               return_exceptions=True)
                failed = [r for r in results if isinstance(r, BaseException)]
                if failed:
                    # One version serves everywhere: engines that did apply go back.
                    await self._roll_back([e for e, r in zip(live, results) if not isinstance(r, BaseException)])
                    raise failed[0]
            except BaseException:
                if keeping is not None:
                    await asyncio.gather(keeping, return_exceptions=True)
                weights.cleanup()
                work.requeue_front([r for r in plan.preempt if r.engine_id is None])
                raise
            file = await keeping if keeping is not None else None
            return await self._live(version, weights, t0, plan, unfinished, work, file)

    async def update_received(self, version: int, work: WorkOps, accepted: Callable[[], Awaitable[None]],
                              receive: Callable[[], Awaitable[StagedWeights | None]],
                              finish: Callable[[], Awaitable[None]], abandon: Callable[[], Awaitable[None]]) -> int:
        """`update` for weights that arrive on the engines themselves (a
        collective push, core/collective.py): carry-over planned, then
        `accepted()` (the sender may send), `receive()` on every engine (the
        staged copy it returns, if any, is what restarted engines get), then
        `finish()` makes the version live on all; on any failure `abandon()`
        puts the previous weights back and the serving version stays."""
        async with self.lock:
            t0 = self._monotonic()
            unfinished, plan = await self._plan(version, work)
            staged = None
            try:
                await accepted()
                staged = await receive()
                await finish()
            except BaseException:
                if staged is not None:
                    staged.cleanup()
                # Shielded: a trainer that hangs up must not leave the engines
                # half-loaded (each restore is bounded).
                await asyncio.shield(abandon())
                work.requeue_front([r for r in plan.preempt if r.engine_id is None])
                raise
            # Without a staged copy a restarted engine serves the model's own
            # weights (tagged version 0) until the next push.
            file = await self._keep(version, staged) if self.store is not None else None
            return await self._live(version, staged, t0, plan, unfinished, work, file)

    async def _plan(self, version: int, work: WorkOps) -> tuple[list[Request], CarryPlan]:
        """Under the lock, before any byte is applied: check the version,
        plan the carry-over, pause what the plan pauses."""
        self.check_version(version)
        unfinished = work.unfinished()
        plan = plan_carry_over(self.carry_over, unfinished, work.running_ids(), version)
        for req in plan.preempt:
            await work.preempt(req)
        return unfinished, plan

    async def _keep(self, version: int, weights: StagedWeights | None) -> str | None:
        """Write a version's weights to the store; None when they cannot be
        kept (a restart then serves, and reports, the model's own weights)."""
        try:
            return await asyncio.to_thread(self.store.write_weights, version, weights)
        except Exception:
            log.exception("cannot keep the weights of version %d in state_dir; a restart will serve the "
                          "model's own weights (version 0)", version)
            return None

    async def _live(self, version: int, staged: StagedWeights | None, t0: float, plan: CarryPlan,
                    unfinished: list[Request], work: WorkOps, file: str | None = None) -> int:
        """`version` serves on every engine: record it in the store, keep its
        staged copy for restarted engines, free the previous one, carry the
        work over."""
        if self.store is not None:
            # Durable before the push returns: a crash before this restarts
            # on the previous version, whose weights are still kept. The
            # requests the carry-over restarts are reset with it (a crash
            # after it must not bring their discarded tokens back).
            restart = [(r.group.group_id, r.index) for r in plan.restart if r.group.listener is None]
            await self.store.record_weights(version, file, restart)
        previous, self.last = [self.last], staged
        if previous[0] is not None:
            # Off the event loop: freeing a GB-size file's pages (its
            # unlink, the mapping's munmap) takes ~0.2 s; generation goes on.
            await asyncio.to_thread(_release, previous)
        self.version = version
        self._counters["weight_updates"] += 1
        self._histogram.observe(self._monotonic() - t0)
        await self._apply_carry(plan, unfinished, work)
        for tap in self.taps:
            try:
                await tap(version, staged)
            except Exception:  # an observer's failure does not undo the push
                log.exception("weight tap failed on version %d", version)
        return version

    async def _apply_carry(self, plan: CarryPlan, unfinished: list[Request], work: WorkOps) -> None:
        restart = {r.request_id for r in plan.restart}
        dropped = {g.group_id for g in plan.drop}
        # A trajectory waiting for an observation is in no queue: restarted,
        # it is queued again (its pending answer becomes stale).
        waiting = [r for r in plan.restart if r.awaiting and r.group.group_id not in dropped]
        # A trajectory whose observation arrived during the push may have
        # started its next turn since the plan was made: stop it before it
        # starts over (its runner would otherwise end a turn of the reset request).
        started = [r for r in plan.restart if r.engine_id is not None and r not in plan.preempt]
        for req in started:
            await work.preempt(req)
        waiting += [r for r in started if r.group.group_id not in dropped]
        for req in plan.restart:
            if req.finish_reason is not None:
                continue  # finished during the push (e.g. its environment said done)
            self._counters["tokens_discarded"] += len(req.token_ids)
            req.reset()
            work.record_progress(req)  # supersedes a turn recorded since the weights record
        self._counters["tokens_carried"] += sum(
            len(r.token_ids) for r in unfinished if r.request_id not in restart and r.group.group_id not in dropped
        )
        work.requeue_front([r for r in plan.preempt if r.group.group_id not in dropped] + waiting)
        for group in plan.drop:
            await work.give_up(group, "max_version_lag")
