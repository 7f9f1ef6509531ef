"""The rollout core: one sample's life from Submit to the delivery log.

    submit -> queue -> placement picks an engine -> engine.add streams deltas
           -> tokens tagged with their policy version -> finish -> delivery log

An engine failure or a migration aborts the request with its partial
response and re-queues it at the head: the partial is continued (re-prefill)
wherever it lands next, so nothing generated is lost. The core never knows
which engine kind it drives.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

from rollout_service.core.clock import Clock
from rollout_service.core.delivery import DeliveryLog
from rollout_service.core.fleet import FleetMixin
from rollout_service.core.weight_sync import WeightSyncMixin
from rollout_service.core.histogram import Histogram
from rollout_service.core.status import CoreStatus, EngineStatus
from rollout_service.engines.weights import StagedWeights
from rollout_service.partial.carry_over import CarryOverConfig
from rollout_service.scheduling.length_predictor import LengthPredictor
from rollout_service.scheduling.rebalancer import RebalanceConfig
from rollout_service.engines.types import FinishReason
from rollout_service.lifecycle.types import CoreError, DeltaEvent, Group, GroupSpec, Request, Sample, SampleEvent
from rollout_service.engines.base import Engine
from rollout_service.scheduling.placement import Placement

log = logging.getLogger(__name__)


class Detokenizer(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(slots=True)
class CoreLimits:
    max_queued_samples: int = 1_000_000  # samples waiting or running
    remembered_group_ids: int = 1_000_000  # for Submit idempotency after completion
    consumer_ttl_s: float = 3600.0
    health_interval_s: float = 1.0  # how often engines are checked for death


class RolloutCore(FleetMixin, WeightSyncMixin):
    def __init__(
        self,
        engines: Iterable[Engine],
        placement: Placement,
        clock: Clock | None = None,
        limits: CoreLimits | None = None,
        detokenizer: Detokenizer | None = None,
        carry_over: CarryOverConfig | None = None,
        rebalance: RebalanceConfig | None = None,
        predictor: LengthPredictor | None = None,
    ) -> None:
        self.engines: dict[str, Engine] = {e.engine_id: e for e in engines}
        self.placement = placement
        self.clock = clock or Clock()
        self.limits = limits or CoreLimits()
        self.detokenizer = detokenizer
        self.carry_over = carry_over or CarryOverConfig()
        self.rebalance = rebalance
        # One predictor serves placement and rebalancing; it learns from every finish.
        self.predictor = predictor or getattr(placement, "predictor", None) or (LengthPredictor() if rebalance else None)
        if hasattr(placement, "bind"):
            placement.bind(self.predicted_load)
        self.delivery = DeliveryLog(self.clock.now, self.limits.consumer_ttl_s)
        self.groups: dict[str, Group] = {}
        self._done_groups: OrderedDict[str, None] = OrderedDict()
        self.queue: deque[Request] = deque()
        self.running: dict[str, tuple[Request, asyncio.Task]] = {}
        self.assigned: Counter[str] = Counter()
        self.policy_version = 0
        self.counters: Counter[str] = Counter()
        self.histograms = {"sample_latency_seconds": Histogram(), "weight_update_seconds": Histogram()}
        self._wake = asyncio.Event()
        self._dispatcher: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._rebalancer: asyncio.Task | None = None
        self._work_cache: dict[str, tuple[float, float]] | None = None
        self._dispatching = False
        self._restarting: set[str] = set()
        self._last_weights: StagedWeights | None = None
        self._restored_weights: StagedWeights | None = None
        self._weights_lock = asyncio.Lock()
        self.started_at = 0.0
        # Called with every finished sample (e.g. the online drafter trainer);
        # must be cheap and must not raise.
        self.sample_taps: list[Callable[[Sample], None]] = []

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        self.started_at = self.clock.now()
        await asyncio.gather(*(e.start() for e in self.engines.values()))
        if self._restored_weights is not None:
            # Restored from a checkpoint: serve its policy version before any work.
            weights, self._restored_weights = self._restored_weights, None
            await asyncio.gather(*(e.update_weights(self.policy_version, weights) for e in self.engines.values()))
            self._last_weights = weights
        self._dispatcher = asyncio.create_task(self._dispatch_loop(), name="dispatch")
        self._wake.set()  # restored work may be waiting
        self._watcher = asyncio.create_task(self._watch_loop(), name="engine-watch")
        if self.rebalance is not None:
            self._rebalancer = asyncio.create_task(self._rebalance_loop(), name="rebalance")

    async def checkpoint(self, state_dir: str) -> None:
        """Stop dispatching, abort what runs (keeping partial responses) and
        save the state for a restarted service (see core/checkpoint.py)."""
        from rollout_service.core import checkpoint

        if self._dispatcher:
            self._dispatcher.cancel()
        for req, _ in list(self.running.values()):
            await self.preempt(req)
        path = await asyncio.to_thread(checkpoint.save, self, state_dir)
        log.info("saved %d open groups and %d undelivered samples to %s",
                 len(self.groups), self.delivery.retained, path)

    def restore(self, state_dir: str) -> bool:
        """Load a checkpoint before start(); returns whether there was one."""
        from rollout_service.core import checkpoint

        return checkpoint.load(self, state_dir)

    async def stop(self) -> None:
        for task in (self._dispatcher, self._watcher, self._rebalancer):
            if task:
                task.cancel()
        for _, task in list(self.running.values()):
            task.cancel()
        await asyncio.gather(*(e.close() for e in self.engines.values()), return_exceptions=True)

    # -- submit ----------------------------------------------------------------

    def submit(self, specs: list[GroupSpec]) -> list[tuple[str, bool]]:
        """Enqueue groups; returns (group_id, created) per spec. A known
        group id is not created again (idempotent retries)."""
        new = sum(s.num_samples for s in specs if not self.knows(s.group_id))
        pending = len(self.queue) + len(self.running)
        if pending + new > self.limits.max_queued_samples:
            raise CoreError(
                "exhausted",
                f"queue full: {pending} samples pending, {new} more would exceed "
                f"max_queued_samples={self.limits.max_queued_samples}; retry later",
            )
        now = self.clock.now()
        out: list[tuple[str, bool]] = []
        for spec in specs:
            if not spec.group_id:
                spec.group_id = uuid.uuid4().hex
            if self.knows(spec.group_id):
                out.append((spec.group_id, False))
                continue
            group = Group(spec, submitted_at=now)
            for i in range(spec.num_samples):
                req = Request(f"{spec.group_id}/{i}", group, i, queued_at=now)
                group.requests.append(req)
                self.queue.append(req)
            self.groups[spec.group_id] = group
            self.counters["groups_submitted"] += 1
            self.counters["samples_submitted"] += spec.num_samples
            out.append((spec.group_id, True))
        self._wake.set()
        return out

    def submit_private(self, spec: GroupSpec) -> Group:
        """Enqueue a group whose tokens and samples go to `group.listener`
        (not to the delivery log), for request/response front ends."""
        spec.group_id = spec.group_id or f"private-{uuid.uuid4().hex}"
        self.submit([spec])
        group = self.groups[spec.group_id]
        group.listener = asyncio.Queue()
        return group

    def knows(self, group_id: str) -> bool:
        return bool(group_id) and (group_id in self.groups or group_id in self._done_groups)

    # -- dispatch --------------------------------------------------------------

    async def _dispatch_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                self.dispatch()
            except Exception:  # a policy bug must not stop the service
                log.exception("placement failed")

    def dispatch(self) -> None:
        if not self.queue:
            return
        loads = [e.load() for eid, e in self.engines.items() if eid not in self._restarting]
        # Predicted load per engine: computed once for this placement.
        self._work_cache, self._dispatching = None, True
        try:
            decisions = self.placement.place(self.queue, loads, self.assigned)
        finally:
            self._work_cache, self._dispatching = None, False
        for req, engine_id in decisions:
            self._start(req, self.engines[engine_id])

    def _start(self, req: Request, engine: Engine) -> None:
        req.engine_id = engine.engine_id
        req.segment_start = len(req.token_ids)
        req.segment_version = self.policy_version
        req.attempt += 1
        if req.engines:
            # Continuing a partial response: the prefix is prefilled again.
            req.reprefilled_tokens += len(req.group.spec.prompt_token_ids) + len(req.token_ids)
            self.counters["tokens_reprefilled"] += len(req.group.spec.prompt_token_ids) + len(req.token_ids)
        req.engines.append(engine.engine_id)
        self.assigned[engine.engine_id] += 1
        task = asyncio.create_task(self._run(req, engine, req.attempt), name=req.request_id)
        self.running[req.request_id] = (req, task)

    async def _run(self, req: Request, engine: Engine, attempt: int) -> None:
        def superseded() -> bool:
            # The core preempted this attempt and took the partial from abort().
            return req.attempt != attempt or req.engine_id != engine.engine_id

        finish: FinishReason | None = None
        try:
            async for delta in engine.add(req.engine_request()):
                if superseded():
                    return
                if delta.token_ids:
                    if not req.first_token_at:
                        req.first_token_at = self.clock.now()
                    req.append_delta(delta)
                    if req.group.listener is not None:
                        req.group.listener.put_nowait(DeltaEvent(req.index, delta))
                    self.counters["tokens_generated"] += len(delta.token_ids)
                if delta.finish_reason is not None:
                    finish = delta.finish_reason
                    break
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # engine died or refused: keep the partial, re-queue
            if superseded():
                return
            log.warning("request %s failed on %s: %s; re-queued", req.request_id, engine.engine_id, exc)
            self.counters["requests_requeued"] += 1
            self._release(req, engine.engine_id)
            self._requeue(req)
            return
        if superseded():
            return
        self._release(req, engine.engine_id)
        if finish is None or finish == FinishReason.ABORTED:
            # The engine stopped it without the core asking (e.g. shut down).
            self._requeue(req)
            return
        self._finish(req, finish)

    def _release(self, req: Request, engine_id: str) -> None:
        self.running.pop(req.request_id, None)
        self.assigned[engine_id] -= 1
        req.engine_id = None
        self._wake.set()

    def _requeue(self, req: Request) -> None:
        if req.group.aborted:
            return
        self.queue.appendleft(req)
        self._wake.set()

    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.finished_at = self.clock.now()
        req.finish_reason = reason
        group = req.group
        group.finished += 1
        sample = Sample.from_request(req, reason)
        if group.spec.prompt_text and self.detokenizer is not None:
            sample.response_text = self.detokenizer.decode(sample.response_token_ids)
        self.counters["samples_completed"] += 1
        self.histograms["sample_latency_seconds"].observe(req.finished_at - req.queued_at)
        if self.predictor is not None:
            self.predictor.observe(req, len(req.token_ids), group.complete)
        self.counters[f"samples_lag_{self.policy_version - sample.versions.min_version}"] += 1
        for tap in self.sample_taps:
            tap(sample)
        if group.listener is not None:
            group.listener.put_nowait(SampleEvent(sample))
        else:
            self.delivery.append(sample, group.complete)
        if group.complete:
            self.counters["groups_completed"] += 1
            self._forget(group)

    def _forget(self, group: Group) -> None:
        self.groups.pop(group.group_id, None)
        if group.listener is not None:
            return  # private groups are not retried by id
        self._done_groups[group.group_id] = None
        while len(self._done_groups) > self.limits.remembered_group_ids:
            self._done_groups.popitem(last=False)

    # -- abort and migration -----------------------------------------------------

    async def preempt(self, req: Request) -> None:
        """Abort a running request on its engine, keeping its partial response
        (tokens, logprobs, versions) on the request. It is not re-queued."""
        entry = self.running.get(req.request_id)
        if entry is None or req.engine_id is None:
            return
        engine_id = req.engine_id
        engine = self.engines[engine_id]
        segment_start = req.segment_start
        req.engine_id = None  # the runner drops anything it sees from now on
        try:
            partial = await engine.abort(req.request_id)
        except Exception as exc:
            log.warning("abort of %s on %s failed: %s", req.request_id, engine_id, exc)
            partial = None
        if partial is not None:
            # The engine's account of this segment is authoritative: it may hold
            # tokens the runner had not consumed yet.
            # Tokens the runner had not seen yet were generated too.
            self.counters["tokens_generated"] += max(0, len(partial.token_ids) - (len(req.token_ids) - segment_start))
            del req.token_ids[segment_start:], req.logprobs[segment_start:]
            req.versions = req.versions.truncated(segment_start)
            req.append(partial.token_ids, partial.logprobs, partial.versions)
        self.running.pop(req.request_id, None)
        self.assigned[engine_id] -= 1
        self._wake.set()

    async def migrate(self, req: Request, target: str | None) -> None:
        """Move a running request to another engine: abort with its partial on
        the source, continue from the same prefix on `target` (re-prefill);
        with no target, at the head of the queue, wherever placement sends it."""
        await self.preempt(req)
        if req.group.aborted:
            return
        req.num_migrations += 1
        req.moved_at = self.clock.monotonic()
        self.counters["migrations"] += 1
        if target is None:
            self._requeue(req)
        else:
            self._start(req, self.engines[target])

    async def abort(
        self, group_ids: list[str] = (), batch_id: str = "", all_groups: bool = False, keep_partial: bool = False
    ) -> tuple[int, list[Sample]]:
        """Stop groups; returns how many and, with keep_partial, the
        unfinished samples with the tokens generated so far."""
        if all_groups:
            targets = list(self.groups.values())
        elif batch_id:
            targets = [g for g in self.groups.values() if g.spec.batch_id == batch_id]
        else:
            missing = [g for g in group_ids if g not in self.groups]
            if missing:
                raise CoreError("not_found", f"group_ids: unknown or finished group {missing[0]!r}")
            targets = [self.groups[g] for g in group_ids]
        partials: list[Sample] = []
        for group in targets:
            group.aborted = True
            ids = {r.request_id for r in group.requests}
            self.queue = deque(r for r in self.queue if r.request_id not in ids)
            for req in group.requests:
                if req.finish_reason is not None:
                    continue
                await self.preempt(req)
                req.finish_reason = FinishReason.ABORTED
                req.finished_at = self.clock.now()
                if keep_partial:
                    partials.append(Sample.from_request(req, FinishReason.ABORTED))
            self.counters["groups_aborted"] += 1
            self._forget(group)
        return len(targets), partials

    # -- status --------------------------------------------------------------------

    def status(self) -> CoreStatus:
        return CoreStatus(
            policy_version=self.policy_version,
            engines=[EngineStatus(e.load(), self.assigned[eid]) for eid, e in self.engines.items()],
            queued_requests=len(self.queue),
            running_requests=len(self.running),
            open_groups=len(self.groups),
            last_cursor=self.delivery.last_cursor,
            retained_samples=self.delivery.retained,
            scheduler=self.placement.name,
            uptime_s=self.clock.now() - self.started_at,
            counters=dict(self.counters),
        )
