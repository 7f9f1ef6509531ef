"""The server side of the Ray fleet: `RayHost` (one per actor) spawns its
`EngineHost` actor in a placement-group bundle and reads its event stream;
`RayEngine` (one per engine) implements the engine protocol as a proxy for
the engine living in that actor.

`add` is one actor call (not awaited); every token delta and load snapshot
of every engine of an actor comes back on that actor's single streaming
generator (`EngineHost.events`), whose batches coalesce under load (the
generator is back-pressured to one batch in flight). `load()` reads the
snapshot the last batch carried: cheap and non-blocking. `abort` and weight
updates are one awaited call each.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Mapping

from rollout_proto.devices import RankDevice
from rollout_service.engines.base import Engine, EngineError
from rollout_service.engines.ray_host import EngineHost, EventBatch, EventKind, WeightsApplied
from rollout_service.engines.spec_monitor import SpecMonitor, SpecSnapshot
from rollout_service.engines.speculation import MonitoredSpeculation
from rollout_service.engines.types import (
    EngineDescription,
    EngineLoad,
    EngineRequest,
    EngineState,
    PartialResponse,
    TokenDelta,
)
from rollout_service.engines.weights import StagedWeights

if TYPE_CHECKING:
    from rollout_service.engines.ray_fleet import RayFleet

log = logging.getLogger(__name__)


def _ray_errors() -> tuple[type[BaseException], ...]:
    import ray.exceptions as rex

    return (rex.RayActorError, rex.ObjectLostError, rex.OwnerDiedError, rex.WorkerCrashedError,
            rex.NodeDiedError, rex.LocalRayletDiedError)


@functools.cache
def _remote_host_class():
    import ray

    return ray.remote(max_restarts=0, max_task_retries=0)(EngineHost)


class RayHost:
    """The server's side of one `EngineHost` actor: spawns it in its bundle,
    reads its event stream, routes deltas to the engines' open streams."""

    def __init__(self, fleet: "RayFleet", bundle_index: int, factories: dict[str, Callable[[], Engine]],
                 actor_options: dict[str, Any], heartbeat_s: float) -> None:
        self.fleet = fleet
        self.bundle_index = bundle_index
        self.factories = factories
        self.actor_options = actor_options
        self.heartbeat_s = heartbeat_s
        self.engines: dict[str, RayEngine] = {}
        self.actor = None
        self.alive = False
        self.generation = 0
        self.info: dict[str, Any] = {}
        self._streams: dict[int, asyncio.Queue] = {}
        self._next_stream = 0
        self._lock: asyncio.Lock | None = None
        self._pump: asyncio.Task | None = None
        self._closed = 0
        fleet.add_host(self)

    async def ensure(self) -> None:
        """Make sure the actor runs (a new one in the same bundle if it died)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.alive:
                return
            await self._spawn()

    def _kill_actor(self) -> None:
        """Kill the current actor, if any (it may already be dead)."""
        import ray

        if self.actor is not None:
            try:
                ray.kill(self.actor, no_restart=True)
            except Exception as exc:  # already dead, or Ray gone: nothing left to kill
                log.debug("kill of the Ray actor of bundle %d: %s: %s", self.bundle_index, type(exc).__name__, exc)
            self.actor = None

    async def _spawn(self) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._kill_actor()
        await self.fleet.ready()  # a bundle whose node died waits for resources here
        strategy = PlacementGroupSchedulingStrategy(self.fleet.pg, placement_group_bundle_index=self.bundle_index)
        actor = _remote_host_class().options(scheduling_strategy=strategy, **self.actor_options).remote(
            self.factories, self.heartbeat_s)
        self.info = await actor.info.remote()
        self.fleet.stats["ray_calls"] += 1
        self.actor = actor
        self.generation += 1
        self.alive = True
        self._pump = asyncio.create_task(self._read_events(actor, self.generation),
                                         name=f"ray-events-{self.bundle_index}")
        log.info("Ray actor for %s up: pid %s on node %s (%s)", ",".join(self.factories),
                 self.info.get("pid"), str(self.info.get("node_id"))[:12], self.info.get("ip"))

    async def _read_events(self, actor, generation: int) -> None:
        stats = self.fleet.stats
        try:
            stream = actor.events.options(num_returns="streaming", _generator_backpressure_num_objects=1).remote()
            stats["ray_calls"] += 1
            async for ref in stream:
                batch: EventBatch = await ref
                stats["ray_stream_items"] += 1
                stats["ray_events"] += len(batch.events)
                for eid, (incarnation, load) in batch.loads.items():
                    self.engines[eid]._snapshot(incarnation, load, batch.spec.get(eid))
                streams = self._streams
                for ev in batch.events:
                    queue = streams.get(ev.stream_id)
                    if queue is None:
                        continue  # aborted: the server already took the partial
                    if ev.kind == EventKind.DELTA:
                        queue.put_nowait(ev.delta)
                    elif ev.kind == EventKind.END:
                        queue.put_nowait(None)
                    else:
                        queue.put_nowait(EngineError(ev.error))
            raise EngineError("the actor's event stream ended")
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            if generation == self.generation and self.alive:
                self._died(exc)

    def _died(self, exc: BaseException) -> None:
        log.warning("Ray actor for %s (pid %s) died: %s: %s", ",".join(self.factories), self.info.get("pid"),
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        self.alive = False
        self.fleet.stats["ray_actor_deaths"] += 1
        error = EngineError(f"Ray actor {self.info.get('pid')} died: {type(exc).__name__}")
        for queue in self._streams.values():
            queue.put_nowait(error)
        self._streams.clear()

    def open_stream(self) -> tuple[int, asyncio.Queue]:
        self._next_stream += 1
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[self._next_stream] = queue
        return self._next_stream, queue

    def end_stream(self, stream_id: int) -> None:
        queue = self._streams.pop(stream_id, None)
        if queue is not None:
            queue.put_nowait(None)

    async def call(self, method: str, *args) -> Any:
        """One awaited actor call; a dead actor is an EngineError."""
        if not self.alive or self.actor is None:
            raise EngineError(f"Ray actor of bundle {self.bundle_index} is not running")
        self.fleet.stats["ray_calls"] += 1
        try:
            return await getattr(self.actor, method).remote(*args)
        except _ray_errors() as exc:
            raise EngineError(f"Ray actor of bundle {self.bundle_index}: {type(exc).__name__}") from exc
        except EngineError:
            raise
        except Exception as exc:  # the engine's own error, re-raised by Ray
            raise EngineError(str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__) from exc

    async def close_engine(self, engine_id: str) -> None:
        self._closed += 1
        if self.alive and self.actor is not None:
            try:
                await asyncio.wait_for(self.actor.close_engine.remote(engine_id), 30)
            except Exception as exc:
                log.debug("close of %s: %s", engine_id, exc)
        if self._closed < len(self.engines):
            return
        if self._pump is not None:
            self._pump.cancel()
        self.alive = False
        self._kill_actor()
        await self.fleet.release()


class RayEngine:
    """An engine protocol proxy for an engine living in a Ray actor.

    `template` is a never-started instance of the engine, built in the
    server from the same factory as the actor's: it answers
    `check_weights` and `describe` locally, and its speculation monitor
    mirrors the actor's (`SpecMonitor.apply_snapshot`)."""

    def __init__(self, engine_id: str, host: RayHost, template: Engine) -> None:
        self.engine_id = engine_id
        self.kind = template.kind
        self.placement = "ray"
        self.host = host
        self.template = template
        self.restarts = 0
        self._started = False
        self._state = EngineState.STARTING  # the server's view: starting, ready or dead (closed)
        self._incarnation = 0
        self._load = dataclasses.replace(template.load(), state=EngineState.STARTING)
        self._rids: dict[str, int] = {}  # request id -> open stream id
        self._ranks = 0  # receiving ranks of a collective transfer (the actor's engine says, at start)
        spec = template.speculation
        self.speculation: RaySpeculation | None = RaySpeculation(self, spec.monitor) if spec is not None else None
        host.engines[engine_id] = self

    @property
    def actor_pid(self) -> int | None:
        return self.host.info.get("pid") if self.host.alive else None

    @property
    def node_id(self) -> str | None:
        return self.host.info.get("node_id")

    def describe(self) -> EngineDescription:
        """The template's description, with the KV capacity the actor's
        engine reports once started."""
        described = self.template.describe()
        return dataclasses.replace(described, placement="ray", kv_capacity_tokens=self._load.kv_capacity_tokens,
                                   workers=self._ranks or described.workers)

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            self.restarts += 1
        self._started = True
        self._state = EngineState.STARTING
        try:
            await self.host.ensure()
            incarnation, load = await self.host.call("start_engine", self.engine_id)
        except BaseException as exc:
            self._state = EngineState.DEAD  # the core's health watch tries again
            if isinstance(exc, Exception) and not isinstance(exc, EngineError):
                raise EngineError(f"engine {self.engine_id}: {type(exc).__name__}: {str(exc).splitlines()[0]}") from exc
            raise
        self._incarnation, self._load = incarnation, load
        try:
            self._ranks = int(await self.host.call("transfer_ranks", self.engine_id))
        except EngineError as exc:
            log.warning("engine %s cannot say its transfer ranks (%s): it stays out of collective pushes",
                        self.engine_id, exc)
            self._ranks = 0
        self._state = EngineState.READY
        if self.speculation is not None:
            await self.speculation.restore()

    async def close(self) -> None:
        if self._state == EngineState.DEAD:
            return
        self._state = EngineState.DEAD
        await self.host.close_engine(self.engine_id)

    def _snapshot(self, incarnation: int, load: EngineLoad, spec: SpecSnapshot | None) -> None:
        if incarnation < self._incarnation:
            return  # from before the latest (re)start
        self._incarnation, self._load = incarnation, load
        if spec is not None and self.speculation is not None:
            self.speculation.monitor.apply_snapshot(spec)

    def load(self) -> EngineLoad:
        """The snapshot of the actor's last batch; `dead` once the actor is."""
        load = self._load
        if self._state == EngineState.READY:
            if self.host.alive:
                return load  # the engine's own state (a vLLM engine core may have died)
            state = EngineState.DEAD
        else:
            state = self._state
        return load if load.state == state else dataclasses.replace(load, state=state)

    # -- generation ------------------------------------------------------------------

    def add(self, request: EngineRequest) -> AsyncIterator[TokenDelta]:
        if self._state != EngineState.READY or not self.host.alive:
            raise EngineError(f"engine {self.engine_id} is not running")
        if request.request_id in self._rids:
            raise EngineError(f"request {request.request_id} already running on {self.engine_id}")
        stream_id, queue = self.host.open_stream()
        self._rids[request.request_id] = stream_id
        self.host.fleet.stats["ray_calls"] += 1
        self.host.actor.add.remote(self.engine_id, stream_id, request)  # its deltas come on the event stream
        return self._deltas(request.request_id, stream_id, queue)

    async def _deltas(self, request_id: str, stream_id: int, queue: asyncio.Queue) -> AsyncIterator[TokenDelta]:
        try:
            while True:
                item = await queue.get()
                if item is None:
                    return  # aborted, or the engine ended it without a finish
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            self.host._streams.pop(stream_id, None)
            if self._rids.get(request_id) == stream_id:
                del self._rids[request_id]

    async def abort(self, request_id: str) -> PartialResponse:
        stream_id = self._rids.pop(request_id, None)
        if stream_id is None:
            return PartialResponse([], [], [])
        self.host.end_stream(stream_id)
        # A dead actor raises: the core keeps the tokens it already received.
        tokens, logprobs, versions = await self.host.call("abort", self.engine_id, request_id)
        return PartialResponse(list(tokens), list(logprobs), list(versions))

    # -- weights ---------------------------------------------------------------------

    def check_weights(self, manifest: Mapping[str, tuple[str, tuple[int, ...]]]) -> None:
        self.template.check_weights(manifest)

    async def update_weights(self, version: int, weights: StagedWeights) -> None:
        ref = await self.host.fleet.weights_ref(weights)
        out: WeightsApplied = await self.host.call("update_weights", self.engine_id, version, ref, "policy")
        self._snapshot(out.incarnation, out.load, None)
        self.last_update = out

    # -- collective weight transfer -------------------------------------------------
    # The engine in the actor joins the trainer's group itself: the tensors go
    # from the trainer's ranks to its workers, never through Ray or this
    # process; these calls are the control plane only.

    def transfer_ranks(self) -> int:
        return self._ranks if self._state == EngineState.READY and self.host.alive else 0

    async def transfer_devices(self) -> list[RankDevice]:
        return [RankDevice.from_dict(d) for d in await self.host.call("transfer_devices", self.engine_id)]

    async def init_weight_transfer(self, init) -> None:
        await self.host.call("init_weight_transfer", self.engine_id, init)

    async def receive_weights(self, version: int, specs: list) -> None:
        await self.host.call("receive_weights", self.engine_id, version, specs)

    async def finish_received_weights(self, version: int) -> None:
        out: WeightsApplied = await self.host.call("finish_received_weights", self.engine_id, version)
        self._snapshot(out.incarnation, out.load, None)
        self.last_update = out

    async def abandon_received_weights(self, fallback: StagedWeights | None, version: int) -> None:
        ref = await self.host.fleet.weights_ref(fallback) if fallback is not None else None
        await self.host.call("abandon_received_weights", self.engine_id, version, ref)

    async def close_weight_transfer(self) -> None:
        if not self.host.alive:
            return
        try:
            await self.host.call("close_weight_transfer", self.engine_id)
        except EngineError as exc:
            log.debug("leaving the transfer group on %s: %s", self.engine_id, exc)


class RaySpeculation(MonitoredSpeculation):
    """Speculation of an engine in a Ray actor: calls go to the actor; the
    monitor mirrors the actor engine's from the event stream's snapshots."""

    def __init__(self, engine: RayEngine, monitor: SpecMonitor) -> None:
        super().__init__(monitor)
        self._engine = engine
        self._last_draft: tuple[int, StagedWeights] | None = None

    async def set_schedule(self, schedule) -> None:
        engine = self._engine
        await engine.host.call("set_spec_schedule", engine.engine_id, [list(e) for e in schedule])
        self.monitor.set_schedule(schedule)

    async def update_draft_weights(self, version: int, weights: StagedWeights) -> None:
        engine = self._engine
        if not self.has_draft_model:
            raise EngineError(f"engine {engine.engine_id} has no draft model (spec method {self.config.method!r})")
        ref = await engine.host.fleet.weights_ref(weights)
        await engine.host.call("update_weights", engine.engine_id, version, ref, "draft")
        self._last_draft = (version, weights)
        self.monitor.draft_version = version

    async def restore(self) -> None:
        """After a (re)start in a new actor: re-apply the latest drafter."""
        if self._last_draft is not None:
            await self.update_draft_weights(*self._last_draft)
