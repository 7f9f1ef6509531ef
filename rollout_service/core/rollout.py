"""The rollout core: one sample's life from Submit to the delivery log.

    submit -> queue -> placement picks an engine -> engine.add streams deltas
           -> tokens tagged with their policy version -> finish -> delivery log

An engine failure or a migration aborts the request with its partial
response and re-queues it at the head: the partial is continued (re-prefill)
wherever it lands next, so nothing generated is lost. The core never knows
which engine kind it drives.

A multi-turn group's samples are trajectories (see core/trajectories.py):
a finished turn waits for an observation (from the trainer or an
environment), which is appended and the next turn queued at the head, on
the engine that holds its prefix when it has room.

With a `state_dir` (core/durable.py) every Submit, completed sample, ack,
abort, trajectory turn and live weight version is journaled before it is
visible, so a restart after a crash resumes where the journal ends.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable, Iterable, Mapping, Protocol, Sequence

from rollout_service.core.clock import Clock
from rollout_service.core.delivery import DeliveryLog
from rollout_service.core.fleet import Fleet
from rollout_service.core.histogram import Histogram
from rollout_service.core.pause import FleetPause
from rollout_service.core.rebalancing import Rebalancing
from rollout_service.core.requests import RequestTable
from rollout_service.core.snapshot import CoreSnapshot
from rollout_service.core.status import CoreStatus, EngineStatus
from rollout_service.core.tasks import TaskSet
from rollout_service.core.trajectories import Trajectories
from rollout_service.core.collective import CollectiveTransfer
from rollout_service.core.weight_sync import WeightSync
from rollout_service.engines.base import Engine
from rollout_service.engines.stream import DeltaStream
from rollout_service.engines.types import EngineLoad, FinishReason, PartialResponse, TokenDelta
from rollout_service.engines.weights import StagedWeights
from rollout_service.lifecycle.types import (
    CoreError,
    DeltaEvent,
    EnvReply,
    EnvRequest,
    Group,
    GroupSpec,
    Request,
    Sample,
    SampleEvent,
)
from rollout_service.partial.carry_over import CarryOverConfig
from rollout_service.scheduling.length_predictor import LengthPredictor
from rollout_service.scheduling.affinity import Sessions, SlotWait, place_affine, slot_waits
from rollout_service.scheduling.cost_model import CostModel
from rollout_service.scheduling.placement import LoadView, Placement
from rollout_service.scheduling.rebalancer import Move, RebalanceConfig

if TYPE_CHECKING:
    from rollout_service.core.durable import DurableState, SampleCodec

log = logging.getLogger(__name__)

PLACEMENT_RETRY_S = (0.1, 5.0)  # back-off after a placement error: first, doubling up to
MAX_FAILURES_WITHOUT_PROGRESS = 5  # a request failing this often in a row without a token is given up


def _unseen(partial: PartialResponse, seen: int) -> list[TokenDelta]:
    """The tokens of an aborted segment past the first `seen`, one delta per
    run of one version."""
    out: list[TokenDelta] = []
    for i in range(seen, len(partial.token_ids)):
        v = partial.versions[i]
        if not out or out[-1].version != v:
            out.append(TokenDelta([], [], v))
        out[-1].token_ids.append(partial.token_ids[i])
        out[-1].logprobs.append(partial.logprobs[i])
    return out


class Detokenizer(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


Environment = Callable[[EnvRequest], Awaitable[EnvReply]]


@dataclass(slots=True)
class CoreLimits:
    max_queued_samples: int = 1_000_000  # samples waiting or running
    remembered_group_ids: int = 1_000_000  # for Submit idempotency after completion
    consumer_ttl_s: float = 3600.0
    health_interval_s: float = 1.0  # how often engines are checked for death
    max_unacked_samples: int = 65_536  # per consumer: streamed and not acknowledged
    unacked_wait_s: float = 60.0  # a stream held at that bound waits this long for an ack
    observation_timeout_s: float = 3600.0  # a trajectory waiting this long for an observation ends


@dataclass(slots=True)
class _Attempt:
    """What the core's token relay needs of one attempt's stream: whose it is."""

    req: Request
    attempt: int
    engine_id: str
    over: asyncio.Future


class RolloutCore:
    """One service's requests, from Submit to delivery, over a fleet.

    Composed of objects that own their state: `requests` (what runs where),
    `fleet` (engines, health, restarts), `weight_sync` (policy version and
    weights), `rebalancing` (migrations), `delivery` (the delivery log)."""

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
        environments: Mapping[str, Environment] | None = None,
        affinity: bool = True,
    ) -> None:
        self.placement = placement
        self.affinity = affinity  # a trajectory's next turn goes to the engine holding its prefix
        self.sessions = Sessions()  # ... and so does a harness's next call with the same session key
        self.clock = clock or Clock()
        self.limits = limits or CoreLimits()
        self.detokenizer = detokenizer
        self.counters: Counter[str] = Counter()
        self.histograms = {"sample_latency_seconds": Histogram(), "weight_update_seconds": Histogram()}
        self.delivery = DeliveryLog(self.clock.now, self.limits.consumer_ttl_s, self.limits.max_unacked_samples,
                                    self.limits.unacked_wait_s)
        self.groups: dict[str, Group] = {}
        self._done_groups: OrderedDict[str, None] = OrderedDict()
        self.queue: deque[Request] = deque()
        self.requests = RequestTable()
        self._wake = asyncio.Event()
        self._tasks = TaskSet()  # every task the core starts, awaited on stop()
        self._runners = TaskSet()  # one per request attempt
        self._token_relay = self._relay_tokens  # one object: streams that share it are relayed in one call
        self.fleet = Fleet(engines, self.counters, self._tasks, evacuate=self._evacuate,
                           bring_up=self._bring_up, on_change=self._wake.set)
        self.weight_sync = WeightSync(self.fleet, carry_over or CarryOverConfig(), self.counters,
                                      self.histograms["weight_update_seconds"], self.clock.monotonic)
        self.collective = CollectiveTransfer(self.fleet, self.weight_sync)  # collective pushes
        self.pausing = FleetPause(self, self._wake.set, lambda: self.weight_sync.version)  # /pause, /resume
        # One predictor serves placement and rebalancing; it learns from every finish.
        self.rebalancing = Rebalancing(rebalance, predictor or placement.predictor or (LengthPredictor() if rebalance else None),
                                       self.fleet, self.requests, self.migrate, self.clock.monotonic)
        self.placement_error = ""  # the last placement error, while placement keeps failing
        self.started_at = 0.0
        # Called with every finished sample (e.g. the online drafter trainer);
        # must be cheap. One that raises is counted (`finish_errors`) and logged.
        self.sample_taps: list[Callable[[Sample], None]] = []
        # Awaited with (version, staged weights or None) once a pushed version
        # serves everywhere (e.g. the drafter trainer distilling from the policy).
        self.weight_taps = self.weight_sync.taps
        self.trajectories = Trajectories(self, dict(environments or {}), self.limits.observation_timeout_s)
        # The journal under state_dir (`open_state`); None: nothing survives a restart.
        self.durable: "DurableState | None" = None
        # Constant while state_dir survives; new at every start without one.
        self.incarnation = uuid.uuid4().hex[:16]
        self._unpublished: deque[tuple[int, int]] = deque()  # (journal sequence, cursor) not yet durable
        self._dispatch_at = 0  # journal sequence of the last Submit record: dispatch once it is durable

    # -- the parts, as attributes callers know -------------------------------------

    @property
    def engines(self) -> dict[str, Engine]:
        return self.fleet.engines

    @property
    def running(self):
        """request id -> (request, runner task) of every request on an engine (read-only)."""
        return self.requests.entries

    @property
    def assigned(self):
        """Requests placed per engine and not yet seen finish (read-only)."""
        return self.requests.counts

    @property
    def policy_version(self) -> int:
        return self.weight_sync.version

    async def add_weight_tap(self, tap: Callable[[int, StagedWeights | None], Awaitable[None]]) -> None:
        """Add `tap` to `weight_taps` and call it now with the serving
        version if a pushed or restored one serves (see WeightSync.subscribe)."""
        await self.weight_sync.subscribe(tap)

    @property
    def carry_over(self) -> CarryOverConfig:
        return self.weight_sync.carry_over

    @carry_over.setter
    def carry_over(self, config: CarryOverConfig) -> None:
        self.weight_sync.carry_over = config

    @property
    def rebalance(self) -> RebalanceConfig | None:
        return self.rebalancing.config

    @rebalance.setter
    def rebalance(self, config: RebalanceConfig | None) -> None:
        self.rebalancing.config = config

    @property
    def predictor(self) -> LengthPredictor | None:
        return self.rebalancing.predictor

    @predictor.setter
    def predictor(self, predictor: LengthPredictor | None) -> None:
        self.rebalancing.predictor = predictor

    def is_restarting(self, engine_id: str) -> bool:
        """Is the core restarting this engine (it takes no requests meanwhile)?"""
        return self.fleet.is_restarting(engine_id)

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        self.started_at = self.clock.now()
        if self.durable is not None:
            self.durable.journal.start()
        await self.fleet.start()
        # Restored from a checkpoint: serve its policy version before any work.
        await self.weight_sync.apply_restored()
        self._tasks.spawn(self._dispatch_loop(), name="dispatch")
        self.trajectories.resume_restored()
        self._tasks.spawn(self.trajectories.expire_loop(), name="observation-deadline")
        self._wake.set()  # restored work may be waiting
        self._tasks.spawn(self.fleet.watch(self.limits.health_interval_s), name="engine-watch")
        if self.rebalance is not None:
            self._tasks.spawn(self.rebalancing.loop(), name="rebalance")

    async def checkpoint(self) -> None:
        """Graceful shutdown with a state_dir: stop dispatching, abort what
        runs (keeping partial responses) and compact the journal with them,
        so a restart continues every partial response."""
        if self.durable is None:
            return
        if self.durable.failure:
            log.error("nothing saved at shutdown: %s", self.durable.failure)
            return
        await self._tasks.cancel_all()
        for req, _ in list(self.running.values()):
            await self.preempt(req)
        snapshot = self.snapshot()
        self.durable.compact(snapshot)
        await self.durable.journal.commit()
        log.info("saved %d open groups and %d unacknowledged samples to %s",
                 len(snapshot.groups), len(snapshot.entries), self.durable.dir)

    def open_state(self, state_dir: str, commit_interval_s: float, codec: "SampleCodec") -> bool:
        """Before start(): open the journal in `state_dir` and restore what
        it holds (JournalError for one this release cannot read); returns
        whether it held state. The journal is rewritten as the restored
        state, the incarnation kept."""
        from rollout_service.core.durable import DurableState

        durable = DurableState(state_dir, commit_interval_s, codec)
        snapshot = durable.open()
        if snapshot is not None:
            self.restore_snapshot(snapshot)
        self.incarnation = durable.incarnation
        durable.rewrite_now(self.snapshot())
        durable.journal.on_durable.append(self._durable_upto)
        durable.journal.on_error.append(self._journal_failed)
        self.delivery.on_ack = durable.record_ack
        self.weight_sync.store = durable
        self.pausing.on_change = durable.record_pause
        self.durable = durable
        return snapshot is not None

    async def commit(self) -> None:
        """Wait until everything recorded so far is durable (no-op without a
        state_dir); CoreError naming state_dir once the journal cannot be written."""
        if self.durable is not None:
            await self.durable.commit()

    def _journal_failed(self, exc: BaseException) -> None:
        """A journal write failed: streams end, once they have sent
        every sample made durable before, with the failure (see `commit`)."""
        self.delivery.fail(CoreError("failed_precondition", self.durable.failure))

    def _durable_upto(self, seq: int) -> None:
        """The journal made records up to `seq` durable: publish their samples,
        and compact the journal when it has grown enough."""
        cursor = 0
        while self._unpublished and self._unpublished[0][0] <= seq:
            cursor = self._unpublished.popleft()[1]
        if cursor:
            self.delivery.publish(cursor)
        if self._dispatch_at and seq >= self._dispatch_at:
            self._dispatch_at = 0
            self._wake.set()
        if self.durable.due():
            self.durable.compact(self.snapshot())

    def record_progress(self, req: Request) -> None:
        """Journal a trajectory's state at a turn boundary (TrajectoryOps)."""
        if self.durable is not None and req.group.listener is None:
            self.durable.record_request(req)

    def snapshot(self) -> CoreSnapshot:
        """The core's state (take it with nothing running: see `checkpoint`).
        Aborted and private groups are not part of it."""
        return CoreSnapshot(
            policy_version=self.policy_version,
            groups=[g for g in self.groups.values() if not g.aborted and g.listener is None],
            done_group_ids=list(self._done_groups),
            entries=self.delivery.entries(),  # a new list; entries are never changed once logged
            last_cursor=self.delivery.last_cursor,
            consumers=self.delivery.consumers(),
            counters=dict(self.counters),
            weights=self.weight_sync.last,
            pause_mode=self.pausing.mode,
        )

    def restore_snapshot(self, snapshot: CoreSnapshot) -> None:
        """Put a snapshot back into a core that has not started: its open
        groups' unfinished requests are queued (resumed by re-prefill), its
        weights applied at start."""
        self.weight_sync.version = snapshot.policy_version
        for gid in snapshot.done_group_ids:
            self._done_groups[gid] = None
        for group in snapshot.groups:
            self.queue.extend(r for r in group.requests if r.finish_reason is None and not r.awaiting)
            self.groups[group.group_id] = group
        self.delivery.restore([(e.cursor, e.sample, e.group_complete) for e in snapshot.entries],
                              snapshot.last_cursor, snapshot.consumers)
        self.counters.update(snapshot.counters)
        self.weight_sync.restored = snapshot.weights
        self.pausing.mode = snapshot.pause_mode  # still paused: the trainer that paused it resumes it

    async def stop(self) -> None:
        """Stop every task the core started (awaited), then close the engines
        (and the journal, everything recorded written)."""
        await self._tasks.cancel_all()
        await self._runners.cancel_all()
        await self.trajectories.stop()
        await self.collective.close()
        await self.fleet.close()
        if self.durable is not None:
            await self.durable.journal.close()

    # -- submit ----------------------------------------------------------------

    def submit(self, specs: list[GroupSpec], private: bool = False) -> list[tuple[str, bool]]:
        """Enqueue groups; returns (group_id, created) per spec. A known
        group id is not created again (idempotent retries). Journaled
        unless `private` (durable once `commit()` returns)."""
        if self.durable is not None and self.durable.failure and not private:
            raise CoreError("failed_precondition", self.durable.failure)
        new = sum(s.num_samples for s in specs if not self.knows(s.group_id))
        self.delivery.maybe_prune()
        running = len(self.queue) + len(self.requests)
        waiting, retained = self.trajectories.waiting, self.delivery.retained
        pending = running + waiting + retained
        if pending + new > self.limits.max_queued_samples:
            raise CoreError(
                "exhausted",
                f"queue full: {pending} samples pending ({running} queued or running, {waiting} trajectories "
                f"waiting for an observation, {retained} delivered and not acknowledged by every consumer), "
                f"{new} more would exceed max_queued_samples={self.limits.max_queued_samples}; retry later",
            )
        for i, spec in enumerate(specs):
            if spec.multi_turn is not None:
                self.trajectories.check_spec(f"groups[{i}].multi_turn", spec.multi_turn)
        now = self.clock.now()
        out: list[tuple[str, bool]] = []
        for spec in specs:
            if not spec.group_id:
                spec.group_id = uuid.uuid4().hex
            if self.knows(spec.group_id):
                out.append((spec.group_id, False))
                continue
            group = Group(spec, submitted_at=now)
            session_engine = self.sessions.engine_for(spec.metadata) if self.affinity else None
            for i in range(spec.num_samples):
                req = Request(f"{spec.group_id}/{i}", group, i, queued_at=now, affinity=session_engine)
                group.requests.append(req)
                self.queue.append(req)
            self.groups[spec.group_id] = group
            if self.durable is not None and not private:
                self._dispatch_at = self.durable.record_submit(group)
            self.counters["groups_submitted"] += 1
            self.counters["samples_submitted"] += spec.num_samples
            out.append((spec.group_id, True))
        if self.durable is None or private:
            self._wake.set()
        # else woken once the Submit is durable (`_durable_upto`): its reply,
        # not the dispatch of its groups, comes first.
        return out

    def submit_private(self, spec: GroupSpec) -> Group:
        """Enqueue a group whose tokens and samples go to `group.listener`
        (not to the delivery log), for request/response front ends."""
        spec.group_id = spec.group_id or f"private-{uuid.uuid4().hex}"
        self.submit([spec], private=True)
        group = self.groups[spec.group_id]
        group.listener = asyncio.Queue()
        return group

    def knows(self, group_id: str) -> bool:
        return bool(group_id) and (group_id in self.groups or group_id in self._done_groups)

    # -- dispatch --------------------------------------------------------------

    async def _dispatch_loop(self) -> None:
        first, most = PLACEMENT_RETRY_S
        backoff = first
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                self.dispatch()
            except Exception as exc:  # a policy bug must not stop the service, nor strand the queue
                self.counters["placement_errors"] += 1
                self.placement_error = f"{type(exc).__name__}: {exc}"
                log.exception("placement failed (%d so far); retrying in %.1f s",
                              self.counters["placement_errors"], backoff)
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, most)
                if self.queue:
                    self._wake.set()
            else:
                backoff, self.placement_error = first, ""

    def dispatch(self) -> None:
        """Place what the queue holds (raises what placement raises);
        nothing while the fleet is paused."""
        if not self.queue or self.pausing.paused:
            return
        loads = self.fleet.placeable_loads()
        if self.affinity:  # trajectories' next turns first, where their prefix is cached
            cost = self.rebalancing.cost_model
            for req, engine_id in place_affine(self.queue, loads, self.assigned, self._slot_wait(loads, cost), cost):
                self._start(req, self.engines[engine_id])
        # Predicted load per engine: computed at most once, for this placement.
        decisions = self.placement.place(self.queue, loads, self.assigned, LoadView(self.rebalancing.predicted_loads))
        for req, engine_id in decisions:
            self._start(req, self.engines[engine_id])

    def _slot_wait(self, loads: Sequence[EngineLoad], cost: CostModel) -> SlotWait:
        """When each engine frees its next slots, from what runs there: a
        trajectory's turn by the mean turn, anything else by the length
        predictor (a request it cannot price frees no slot)."""
        def remaining() -> dict[str, list[float]]:
            out: dict[str, list[float]] = {}
            for r in self.requests.attached():
                left = self.trajectories.turn_remaining(r)
                if left is None and self.predictor is not None:
                    left = self.predictor.predict(r).median
                if left is not None:
                    out.setdefault(r.engine_id, []).append(left)
            return out

        return slot_waits(remaining, {l.engine_id: l.max_seqs for l in loads}, cost)

    def _start(self, req: Request, engine: Engine) -> None:
        req.segment_start = len(req.token_ids)
        req.segment_version = self.policy_version
        req.attempt += 1
        warm = self.trajectories.starting(req, engine.engine_id)
        if req.group.spec.multi_turn is None:
            if req.affinity is not None and req.affinity != engine.engine_id:
                self.counters["session_moves"] += 1
            req.affinity = None
            self.sessions.started(req.group.spec.metadata, engine.engine_id)
        if not (warm and self.carry_over.mode == "continue"):
            # Its context is computed now, by the serving weights: their
            # prefix-cache partition. Under `continue`, a trajectory's next
            # turn on the engine holding its context keeps the partition of
            # the weights that computed that KV.
            req.salt_version = self.policy_version
        if req.engines and not warm:
            # Continuing a partial response: the prefix is prefilled again.
            req.reprefilled_tokens += len(req.group.spec.prompt_token_ids) + len(req.token_ids)
            self.counters["tokens_reprefilled"] += len(req.group.spec.prompt_token_ids) + len(req.token_ids)
        req.engines.append(engine.engine_id)
        task = self._runners.spawn(self._run(req, engine, req.attempt), name=req.request_id)
        self.requests.start(req, engine.engine_id, task)

    async def _run(self, req: Request, engine: Engine, attempt: int) -> None:
        def superseded() -> bool:
            # The core preempted this attempt and took the partial from abort().
            return req.attempt != attempt or req.engine_id != engine.engine_id

        finish: FinishReason | None = None
        try:
            deltas = engine.add(self.trajectories.clamp(req.engine_request()))
            if isinstance(deltas, DeltaStream):
                finish = await self._follow(req, deltas, superseded, attempt, engine.engine_id)
            else:
                async for delta in deltas:
                    if superseded():
                        return
                    self._take(req, delta)
                    if delta.finish_reason is not None:
                        finish = delta.finish_reason
                        break
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # engine died or refused: keep the partial, re-queue
            if superseded():
                return
            self._release(req)
            # Failing again and again without a token: the engines refuse
            # it (e.g. a sampling setting they do not support), not a death.
            req.failures = req.failures + 1 if len(req.token_ids) == req.segment_start else 1
            if req.failures >= MAX_FAILURES_WITHOUT_PROGRESS:
                log.warning("request %s failed %d times without a token, last on %s: %s; given up",
                            req.request_id, req.failures, engine.engine_id, exc)
                self.trajectories.close_turn(req, FinishReason.ABORTED)
                self.finish(req, FinishReason.ABORTED, drop_reason=f"engine_error: {type(exc).__name__}: {exc}")
                return
            log.warning("request %s failed on %s: %s; re-queued", req.request_id, engine.engine_id, exc)
            self.counters["requests_requeued"] += 1
            self.requeue(req)
            return
        if superseded():
            return
        self._release(req)
        if finish is None or finish == FinishReason.ABORTED:
            # The engine stopped it without the core asking (e.g. shut down).
            self.requeue(req)
            return
        if req.group.spec.multi_turn is not None:
            self.trajectories.turn_ended(req, finish, engine.engine_id)
            return
        self.finish(req, finish)

    def _take(self, req: Request, delta: TokenDelta) -> None:
        """Record a delta of a request's current attempt."""
        if delta.token_ids:
            if not req.first_token_at:
                req.first_token_at = self.clock.now()
            req.append_delta(delta)
            if req.group.listener is not None:
                req.group.listener.put_nowait(DeltaEvent(req.index, delta))
            self.counters["tokens_generated"] += len(delta.token_ids)

    def _follow(self, req: Request, deltas: DeltaStream, superseded: Callable[[], bool], attempt: int,
                engine_id: str) -> asyncio.Future:
        """Take an attempt's deltas in its engine's step (a sink, no task
        switch per delta); the future resolves with the finish reason, None
        once the attempt is superseded, or the engine's error."""
        over = asyncio.get_running_loop().create_future()

        def sink(delta: TokenDelta) -> None:
            if over.done():
                return
            if superseded():
                over.set_result(None)
                return
            self._take(req, delta)
            if delta.finish_reason is not None:
                over.set_result(delta.finish_reason)

        def failed(exc: BaseException) -> None:
            if not over.done():
                over.set_exception(exc)

        # A private group's listener gets every delta: no token relay.
        if req.group.listener is None:
            deltas.attach(sink, failed, relay=self._token_relay, target=_Attempt(req, attempt, engine_id, over))
        else:
            deltas.attach(sink, failed)
        return over

    def _relay_tokens(self, streams: Sequence[DeltaStream], token_ids: Sequence[list[int]],
                      logprobs: Sequence[list[float]], version: int) -> None:
        """One engine step's deltas of tokens only, one per stream (the
        streams' `target`s are `_Attempt`s): appended to their requests in
        one pass, without a delta object. The hot path of a fleet whose
        engines step every sequence every step; a delta the fast path cannot
        take (a first token, a superseded attempt) goes to its attempt's sink
        through its stream, which fails that stream alone if the sink raises."""
        n = 0
        for stream, ids, lps in zip(streams, token_ids, logprobs):
            a: _Attempt = stream.target
            req = a.req
            if req.attempt != a.attempt or req.engine_id != a.engine_id or a.over.done() or not req.first_token_at:
                stream.push(TokenDelta(ids, lps, version))
                continue
            req.token_ids += ids
            req.logprobs += lps
            req.versions.append(version, len(ids))
            n += len(ids)
        self.counters["tokens_generated"] += n

    def _release(self, req: Request) -> None:
        self.requests.release(req)
        self._wake.set()

    # TrajectoryOps, for Trajectories (and the core's own runners):
    def requeue(self, req: Request) -> None:
        """Queue a stopped request at the head (what it generated is
        continued wherever it lands), unless its group was aborted: the one
        way back into the queue."""
        if req.group.aborted:
            return
        self.queue.appendleft(req)
        self._wake.set()

    def finish(self, req: Request, reason: FinishReason, drop_reason: str = "") -> None:
        """Deliver a finished sample (`drop_reason`: the service gave it up).
        What the optional steps raise (the detokenizer, the predictor, a
        sample tap) is counted as `finish_errors` and logged; the sample is
        delivered regardless."""
        req.finished_at = self.clock.now()
        req.finish_reason = reason
        self.trajectories.stop_waiting(req)
        group = req.group
        group.finished += 1
        sample = Sample.from_request(req, reason)
        sample.drop_reason = drop_reason
        if drop_reason:
            self.counters["samples_dropped"] += 1
        if group.spec.prompt_text and self.detokenizer is not None:
            text = self.guarded("detokenizer", req, self.detokenizer.decode, sample.response_token_ids)
            sample.response_text = text or ""
        self.counters["samples_completed"] += 1
        self.histograms["sample_latency_seconds"].observe(req.finished_at - req.queued_at)
        if self.predictor is not None and not drop_reason:
            self.guarded("length predictor", req, self.predictor.observe, req, len(req.token_ids), group.complete)
        self.counters[f"samples_lag_{self.policy_version - sample.versions.min_version}"] += 1
        for tap in self.sample_taps if not drop_reason else ():
            self.guarded("sample tap", req, tap, sample)
        self.deliver(group, sample)
        if group.complete:
            self.counters["groups_completed"] += 1
            self._forget(group)

    def guarded(self, what: str, req: Request, fn, *args):
        """`fn(*args)`, or None when it raises (counted as `finish_errors`, logged)."""
        try:
            return fn(*args)
        except Exception:
            self.counters["finish_errors"] += 1
            log.exception("%s failed while finishing %s; the sample is delivered anyway", what, req.request_id)
            return None

    def deliver(self, group: Group, sample: Sample) -> None:
        """Hand a sample to its group's listener, or append it to the
        delivery log (marking the group complete with its last sample)."""
        if group.listener is not None:
            group.listener.put_nowait(SampleEvent(sample))
        elif self.durable is None:
            self.delivery.append(sample, group.finished == group.spec.num_samples)
        else:  # streamed once durable (`_durable_upto`)
            complete = group.finished == group.spec.num_samples
            entry = self.delivery.append_entry(sample, complete, publish=False)
            seq, entry.wire = self.durable.record_sample(entry.cursor, sample, complete)
            self._unpublished.append((seq, entry.cursor))

    def _forget(self, group: Group) -> None:
        self.groups.pop(group.group_id, None)
        if group.listener is not None:
            return  # private groups are not retried by id
        self._done_groups[group.group_id] = None
        while len(self._done_groups) > self.limits.remembered_group_ids:
            self._done_groups.popitem(last=False)

    # -- multi-turn trajectories (see core/trajectories.py) -----------------------

    def continue_trajectory(self, sample_id: str, turn: int, observation_token_ids: list[int],
                            done: bool = False) -> bool:
        """Answer turn `turn` of a trainer-driven trajectory: append the
        observation and queue its next turn, or end it (`done`). False for a
        repeat of an answer already applied; CoreError naming what is wrong
        otherwise (unknown or finished trajectory, not waiting for that turn,
        an observation that does not fit, state_dir that cannot be written)."""
        if self.durable is not None and self.durable.failure:
            raise CoreError("failed_precondition", self.durable.failure)
        return self.trajectories.answer(sample_id, turn, observation_token_ids, done)

    # -- abort and migration -----------------------------------------------------

    async def preempt(self, req: Request) -> None:
        """Abort a running request on its engine, keeping its partial response
        (tokens, logprobs, versions) on the request. It is not re-queued."""
        if req.request_id not in self.requests or req.engine_id is None:
            return
        segment_start = req.segment_start
        engine_id = self.requests.detach(req)  # the runner drops anything it sees from now on
        try:
            partial = await self.engines[engine_id].abort(req.request_id)
        except Exception as exc:
            log.warning("abort of %s on %s failed: %s", req.request_id, engine_id, exc)
            partial = None
        if partial is not None:
            # The engine's account of this segment is authoritative: it may hold
            # tokens the runner had not consumed yet (generated all the same).
            self.counters["tokens_generated"] += max(0, len(partial.token_ids) - (len(req.token_ids) - segment_start))
            seen = len(req.token_ids) - segment_start
            del req.token_ids[segment_start:], req.logprobs[segment_start:]
            req.versions = req.versions.truncated(segment_start)
            req.append(partial.token_ids, partial.logprobs, partial.versions)
            if req.group.listener is not None:  # a streaming caller gets the tokens its runner had not seen
                for delta in _unseen(partial, seen):
                    req.group.listener.put_nowait(DeltaEvent(req.index, delta))
        self._release(req)

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
        if target is None or self.pausing.holds:
            self.requeue(req)
        else:
            self._start(req, self.engines[target])

    async def abort(
        self, group_ids: list[str] = (), batch_id: str = "", all_groups: bool = False, keep_partial: bool = False
    ) -> tuple[int, list[Sample]]:
        """Stop groups; returns how many and, with keep_partial, the
        unfinished samples with the tokens generated so far. `all_groups`
        includes the private groups of request/response front ends: their
        listeners get each unfinished sample, finish reason ABORTED (the
        request answers at once), and their samples are not returned."""
        targets = self.abort_targets(group_ids, batch_id, all_groups)
        partials: list[Sample] = []
        if self.durable is not None:
            journaled = [g.group_id for g in targets if g.listener is None]
            if journaled:
                self.durable.record_abort(journaled)
        self._unqueue(targets)  # once for all of them: a queue pass per group is quadratic
        for group in targets:
            samples = await self._give_up(group)
            if keep_partial and group.listener is None:
                partials.extend(samples)
        self.counters["groups_aborted"] += len(targets)
        return len(targets), partials

    def abort_targets(self, group_ids: Sequence[str] = (), batch_id: str = "",
                      all_groups: bool = False) -> list[Group]:
        """The open groups an `abort` with these arguments stops (NOT_FOUND
        CoreError for an unknown group id); nothing changes."""
        if all_groups:
            return list(self.groups.values())
        if batch_id:
            return [g for g in self.groups.values() if g.spec.batch_id == batch_id]
        missing = [g for g in group_ids if g not in self.groups]
        if missing:
            raise CoreError("not_found", f"group_ids: unknown or finished group {missing[0]!r}")
        return [self.groups[g] for g in group_ids]

    async def _give_up(self, group: Group, drop_reason: str = "") -> list[Sample]:
        """The one way a group ends unfinished: its unfinished requests are
        stopped (each keeping its partial response) and marked aborted, and the
        group is forgotten. With a `drop_reason` (the service gave up on it)
        their samples are delivered, aborted with that reason, so nothing
        submitted goes unaccounted for; without one (the client aborted) they
        are returned instead (and handed to a private group's listener,
        whose request would otherwise wait for them)."""
        if not group.aborted:
            self._unqueue([group])
        pending = [r for r in group.requests if r.finish_reason is None]
        samples = []
        for req in pending:
            await self.preempt(req)
            self.trajectories.close_turn(req, FinishReason.ABORTED)
            self.trajectories.stop_waiting(req)
            req.finish_reason = FinishReason.ABORTED
            req.finished_at = self.clock.now()
            sample = Sample.from_request(req, FinishReason.ABORTED)
            if drop_reason:
                sample.drop_reason = drop_reason
                group.finished += 1
                self.deliver(group, sample)
            elif group.listener is not None:
                group.listener.put_nowait(SampleEvent(sample))
            samples.append(sample)
        if drop_reason:
            self.counters["groups_dropped"] += 1
            self.counters["samples_dropped"] += len(pending)
        if self.predictor is not None:
            self.predictor.forget_group(group.group_id)
        self._forget(group)
        return samples

    def _unqueue(self, groups: list[Group]) -> None:
        """Mark groups aborted and take their requests out of the queue."""
        for group in groups:
            group.aborted = True
        if any(r.group.aborted for r in self.queue):
            self.queue = deque(r for r in self.queue if not r.group.aborted)

    async def _evacuate(self, engine_id: str) -> None:
        """Continue elsewhere what runs on `engine_id` (it died)."""
        for req in self.requests.running_on(engine_id):
            await self.preempt(req)
            self.requeue(req)

    # -- weights (see core/weight_sync.py) ------------------------------------------

    def check_weights(self, version: int, manifest) -> None:
        """CoreError unless `version` is newer than the serving one and the
        manifest (name -> (dtype, shape)) fits every engine's model."""
        self.weight_sync.check_weights(version, manifest)

    async def update_weights(self, version: int, weights: StagedWeights) -> int:
        """Apply verified weights on every live engine at a safe point and
        carry unfinished work over; returns the serving version (see
        `WeightSync.update`)."""
        return await self.weight_sync.update(version, weights, self)

    async def push_collective(self, version: int, manifest, accepted, received) -> int:
        """A collective push (core/collective.py): received by the engines
        from the trainer's group, live on all at once; returns the version."""
        return await self.collective.push(version, manifest, self, accepted, received)

    async def _bring_up(self, engine: Engine) -> None:
        await self.weight_sync.bring_up(engine)

    # WorkOps, for WeightSync:
    def unfinished(self) -> list[Request]:
        return [r for g in self.groups.values() if not g.aborted for r in g.requests if r.finish_reason is None]

    def running_ids(self) -> set[str]:
        return set(self.running)

    # PauseOps, for FleetPause:
    def open_groups(self) -> list[Group]:
        return list(self.groups.values())

    def running_count(self) -> int:
        return len(self.requests)

    def requeue_front(self, reqs: list[Request]) -> None:
        """Queue carried requests ahead of new work, keeping their order (a
        trajectory waiting for an observation stays waiting). A request
        whose engine stopped while the push was pausing the others was
        re-queued by its runner, and may have run elsewhere since: one
        queued stays where it is, one that finished is not queued again
        (either would run and be delivered twice). An aborted group's are
        dropped by `requeue`."""
        queued = {r.request_id for r in self.queue}
        carried = []
        for r in reqs:
            if r.engine_id is None and r.finish_reason is None and not r.awaiting and r.request_id not in queued:
                queued.add(r.request_id)
                carried.append(r)
        for r in reversed(carried):
            self.requeue(r)

    async def give_up(self, group: Group, reason: str) -> None:
        await self._give_up(group, drop_reason=reason)

    # -- length-aware scheduling -----------------------------------------------------

    def predicted_load(self, engine_id: str) -> tuple[float, float]:
        """Predicted remaining tokens of the requests placed on an engine, and
        the longest of them."""
        return self.rebalancing.predicted_loads().get(engine_id, (0.0, 0.0))

    async def rebalance_once(self) -> list[Move]:
        """Ask the rebalancer for moves on the current snapshot; apply them."""
        return await self.rebalancing.once()

    # -- status --------------------------------------------------------------------

    def status(self) -> CoreStatus:
        return CoreStatus(
            policy_version=self.policy_version,
            engines=[EngineStatus(e.load(), self.requests.assigned(eid)) for eid, e in self.engines.items()],
            queued_requests=len(self.queue),
            running_requests=len(self.requests),
            open_groups=len(self.groups),
            last_cursor=self.delivery.last_cursor,
            retained_samples=self.delivery.retained,
            scheduler=self.placement.name,
            uptime_s=self.clock.now() - self.started_at,
            counters=dict(self.counters),
            placement_error=self.placement_error,
            placement_errors=self.counters["placement_errors"],
            journal_error=self.durable.failure if self.durable is not None else "",
            paused=self.pausing.mode or "",
        )
