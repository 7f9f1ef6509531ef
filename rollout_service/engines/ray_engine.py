"""Engines as Ray actors: the fleet on a Ray cluster (`engine.placement_backend = "ray"`).

    server process                               Ray actor process (one per bundle)
    ------------------------------------         ------------------------------------
    RolloutCore -> RayEngine (one per engine)    EngineHost: 1+ real engines
                   RayHost (one per actor)  <--  events(): one stream of batches
                   RayFleet (placement group)       (load snapshots + token deltas)

A `RayEngine` implements the engine protocol in the server as a proxy for an
engine (a `VllmEngine` or a `SimEngine`, unchanged) that lives in an
`EngineHost` actor. The actors are placed by one placement group, one bundle
per actor (CPU here; `GPU` = the engine's tensor-parallel size on a GPU
cluster), spread over the cluster's nodes. The core, the scheduling policies,
migration, partial rollout and speculative decoding do not know the
difference.

Hops. `add` is one actor call (not awaited); every token delta and load
snapshot of every engine of an actor comes back on that actor's single
streaming generator (`events`), whose batches coalesce under load (the
generator is back-pressured to one batch in flight, so while the server is
busy the actor keeps appending to the next batch). `load()` reads the
snapshot the last batch carried: cheap and non-blocking. `abort` and weight
updates are one awaited call each.

Weights. A push is put once into Ray's object store (`ray.put`, in the
server); every actor receives the same ObjectRef, so the trainer's bytes
cross the network once per node, not once per engine. Each actor stages the
tensors as one safetensors file in its node's /dev/shm and applies it with
its engine's own `update_weights`.

Failure. An actor (or its node) that dies ends its event stream with a Ray
error: its engines report `dead`, their open streams fail with `EngineError`,
and the core's health watch does the rest as for a local engine (requests
re-queued with their partial responses, `start()` called again). `start()`
recreates the actor in the same placement-group bundle; Ray reschedules a
bundle whose node died as soon as another node has the resources, so the
actor comes back "when resources allow". The core then re-applies the
current weights.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import time
import weakref
from collections import Counter
from typing import Any, AsyncIterator, Callable, Mapping

from rollout_service.engines.types import EngineLoad, EngineRequest, FinishReason, PartialResponse, TokenDelta
from rollout_service.engines.weights import StagedWeights, WeightTensor
from rollout_service.engines.base import Engine, EngineError

log = logging.getLogger(__name__)

_DELTA, _END, _ERROR = 0, 1, 2  # event kinds on an actor's stream


# -- the actor side ------------------------------------------------------------------------


class EngineHost:
    """Runs inside a Ray actor process: hosts one or more engines and
    multiplexes what they produce onto one event stream.

    `factories` maps engine ids to zero-argument callables that build the
    engines (pickled by reference: `functools.partial(SimEngine, ...)`)."""

    def __init__(self, factories: Mapping[str, Callable[[], Engine]], heartbeat_s: float = 0.25) -> None:
        self.engines: dict[str, Engine] = {eid: make() for eid, make in factories.items()}
        self.incarnation: Counter[str] = Counter()  # bumped at every start of an engine
        self.heartbeat_s = heartbeat_s
        self._streams: dict[tuple[str, str], int] = {}  # (engine id, request id) -> stream id
        self._events: list[tuple] = []
        self._wake: asyncio.Event | None = None
        self._staged: dict[str, tuple[int, StagedWeights]] = {}  # target -> (version, staged file)
        self._stage_lock: asyncio.Lock | None = None
        _remove_orphan_staging()

    def _event(self) -> asyncio.Event:
        if self._wake is None:
            self._wake = asyncio.Event()
        return self._wake

    def _push(self, event: tuple) -> None:
        self._events.append(event)
        self._event().set()

    async def info(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {"pid": os.getpid(), "node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address()}

    async def start_engine(self, engine_id: str) -> tuple[int, EngineLoad]:
        engine = self.engines[engine_id]
        if self.incarnation[engine_id] == 0 or engine.load().state == "dead":
            await engine.start()
        self.incarnation[engine_id] += 1
        return self.incarnation[engine_id], engine.load()

    async def add(self, engine_id: str, stream_id: int, request: EngineRequest) -> None:
        key = (engine_id, request.request_id)
        try:
            deltas = self.engines[engine_id].add(request)
        except Exception as exc:
            self._push((stream_id, _ERROR, f"{type(exc).__name__}: {exc}"))
            return
        self._streams[key] = stream_id
        asyncio.get_running_loop().create_task(self._forward(key, stream_id, deltas))

    async def _forward(self, key: tuple[str, str], stream_id: int, deltas: AsyncIterator[TokenDelta]) -> None:
        # Consume to the end even after an abort (the engine ends the stream);
        # what follows an abort is dropped: the server took the partial.
        try:
            async for d in deltas:
                if self._streams.get(key) == stream_id:
                    self._push((stream_id, _DELTA, d.token_ids, d.logprobs, d.version,
                                None if d.finish_reason is None else int(d.finish_reason),
                                d.draft_tokens, d.accepted_tokens))
        except Exception as exc:
            if self._streams.get(key) == stream_id:
                self._push((stream_id, _ERROR, f"{type(exc).__name__}: {exc}"))
        else:
            if self._streams.get(key) == stream_id:
                self._push((stream_id, _END))
        finally:
            if self._streams.get(key) == stream_id:
                del self._streams[key]

    async def abort(self, engine_id: str, request_id: str) -> tuple[list[int], list[float], list[int]]:
        self._streams.pop((engine_id, request_id), None)
        p = await self.engines[engine_id].abort(request_id)
        return p.token_ids, p.logprobs, p.versions

    async def events(self):
        """The actor's one stream: (loads, events, spec) batches, a batch as
        soon as there is news, else every `heartbeat_s` (load snapshots)."""
        wake = self._event()
        while True:
            try:
                await asyncio.wait_for(wake.wait(), self.heartbeat_s)
            except asyncio.TimeoutError:
                pass
            wake.clear()
            events, self._events = self._events, []
            loads = {eid: (self.incarnation[eid], e.load()) for eid, e in self.engines.items()}
            spec = {}
            for eid, e in self.engines.items():
                monitor = getattr(e, "spec_monitor", None)
                if monitor is not None and monitor.cfg.enabled:
                    spec[eid] = _spec_snapshot(monitor)
            yield loads, events, spec

    async def _stage(self, target: str, version: int, payload: list) -> tuple[StagedWeights, float]:
        """One staged file per actor and version, shared by its engines."""
        if self._stage_lock is None:
            self._stage_lock = asyncio.Lock()
        async with self._stage_lock:
            known = self._staged.get(target)
            if known is not None and known[0] == version:
                return known[1], 0.0
            t0 = time.perf_counter()
            staged = StagedWeights([WeightTensor(n, dt, tuple(shape), memoryview(a)) for n, dt, shape, a in payload],
                                   prefix=f"{_STAGING_PREFIX}{os.getpid()}-")
            await staged.as_file()
            staged.tensors = []  # the file has them: let the object store copy go
            if known is not None:
                known[1].cleanup()
            self._staged[target] = (version, staged)
            return staged, time.perf_counter() - t0

    async def update_weights(self, engine_id: str, version: int, payload: list, target: str = "policy") -> dict:
        """`payload` is the pushed tensors, resolved from the object store by
        Ray before the call runs: [(name, dtype, shape, uint8 array)]."""
        staged, stage_s = await self._stage(target, version, payload)
        del payload
        t0 = time.perf_counter()
        engine = self.engines[engine_id]
        if target == "policy":
            await engine.update_weights(version, staged)
        else:
            await engine.update_draft_weights(version, staged)
        return {"stage_s": stage_s, "apply_s": time.perf_counter() - t0,
                "load": (self.incarnation[engine_id], engine.load())}

    async def set_spec_schedule(self, engine_id: str, schedule) -> None:
        await self.engines[engine_id].set_spec_schedule(schedule)

    async def spec_engine_info(self, engine_id: str) -> dict:
        return await self.engines[engine_id].spec_engine_info()

    async def close_engine(self, engine_id: str) -> None:
        await self.engines[engine_id].close()
        if all(e.load().state == "dead" for e in self.engines.values()):
            for _, staged in self._staged.values():
                staged.cleanup()
            self._staged.clear()


_STAGING_PREFIX = "rollout-weights-ray-"


def _remove_orphan_staging() -> None:
    """Staging files of actors on this node that died without closing (a
    killed actor cannot clean up after itself)."""
    import glob

    for path in glob.glob(f"/dev/shm/{_STAGING_PREFIX}*"):
        try:
            pid = int(os.path.basename(path)[len(_STAGING_PREFIX):].split("-", 1)[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            try:
                os.unlink(path)
            except OSError:
                pass
        except (ValueError, PermissionError):
            pass


def _spec_snapshot(monitor) -> dict[str, Any]:
    return {
        "observations": monitor.drain(), "steps": monitor.steps, "spec_steps": monitor.spec_steps,
        "draft_tokens": monitor.draft_tokens, "accepted_tokens": monitor.accepted_tokens,
        "accepted_per_pos": list(monitor.accepted_per_pos), "drafted_per_pos": list(monitor.drafted_per_pos),
        "draft_version": monitor.draft_version,
    }


# -- the server side -----------------------------------------------------------------------


def _ray_errors() -> tuple[type[BaseException], ...]:
    import ray.exceptions as rex

    return (rex.RayActorError, rex.ObjectLostError, rex.OwnerDiedError, rex.WorkerCrashedError,
            rex.NodeDiedError, rex.LocalRayletDiedError)


@functools.cache
def _remote_host_class():
    import ray

    return ray.remote(max_restarts=0, max_task_retries=0)(EngineHost)


_WEIGHT_REFS: "weakref.WeakKeyDictionary[StagedWeights, asyncio.Future]" = weakref.WeakKeyDictionary()


async def weights_ref(weights: StagedWeights):
    """The pushed weights in Ray's object store: put once per push, shared
    by every actor of the fleet (and dropped when the push is)."""
    fut = _WEIGHT_REFS.get(weights)
    if fut is None:
        import numpy as np
        import ray

        fut = _WEIGHT_REFS[weights] = asyncio.get_running_loop().create_future()
        payload = [(t.name, t.dtype, tuple(t.shape), np.frombuffer(t.data, dtype=np.uint8)) for t in weights.tensors]
        try:
            fut.set_result(await asyncio.to_thread(ray.put, payload))
        except BaseException as exc:
            del _WEIGHT_REFS[weights]
            fut.set_exception(exc)
            fut.exception()  # retrieved here; raised below
            raise
    return await asyncio.shield(fut)


class RayFleet:
    """The fleet's placement group and actors, and Ray's hop counters."""

    def __init__(self, bundles: list[dict[str, float]], strategy: str, started_ray: bool) -> None:
        from ray.util.placement_group import placement_group

        self.pg = placement_group(bundles, strategy=strategy)
        self.bundles = bundles
        self.strategy = strategy
        self._ready: asyncio.Future | None = None
        self.started_ray = started_ray
        self.hosts: list[RayHost] = []
        self.stats: Counter[str] = Counter()  # ray_calls, ray_stream_items, ray_events
        self._open = 0

    async def ready(self) -> None:
        """Wait until every bundle is reserved (once; a respawned actor just
        waits for its bundle)."""
        if self._ready is None:
            self._ready = asyncio.ensure_future(self._wait_ready())
        await asyncio.shield(self._ready)

    async def _wait_ready(self) -> None:
        ready = asyncio.ensure_future(self.pg.ready())
        done, _ = await asyncio.wait([ready], timeout=10)
        if not done:
            log.warning("waiting for the Ray cluster to reserve %d bundles %s (strategy %s)",
                        len(self.bundles), self.bundles[0], self.strategy)
        await ready

    async def release(self) -> None:
        self._open -= 1
        if self._open > 0:
            return
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.pg)
        except Exception as exc:  # Ray already gone
            log.debug("placement group removal: %s", exc)
        if self.started_ray:
            ray.shutdown()


class RayHost:
    """The server's side of one `EngineHost` actor: spawns it in its bundle,
    reads its event stream, routes deltas to the engines' open streams."""

    def __init__(self, fleet: RayFleet, bundle_index: int, factories: dict[str, Callable[[], Engine]],
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
        fleet.hosts.append(self)
        fleet._open += 1

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
            except Exception:
                pass
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
                loads, events, spec = await ref
                stats["ray_stream_items"] += 1
                stats["ray_events"] += len(events)
                for eid, (incarnation, load) in loads.items():
                    self.engines[eid]._snapshot(incarnation, load, spec.get(eid))
                streams = self._streams
                for ev in events:
                    queue = streams.get(ev[0])
                    if queue is None:
                        continue  # aborted: the server already took the partial
                    kind = ev[1]
                    if kind == _DELTA:
                        finish = None if ev[5] is None else FinishReason(ev[5])
                        queue.put_nowait(TokenDelta(ev[2], ev[3], ev[4], finish, ev[6], ev[7]))
                    elif kind == _END:
                        queue.put_nowait(None)
                    else:
                        queue.put_nowait(EngineError(ev[2]))
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
    `check_weights` locally and its `spec_monitor` mirrors the actor's."""

    def __init__(self, engine_id: str, host: RayHost, template: Engine) -> None:
        self.engine_id = engine_id
        self.kind = template.kind
        self.placement = "ray"
        self.host = host
        self.template = template
        self.restarts = 0
        self._started = False
        self._state = "starting"  # the server's view: starting, ready or dead (closed)
        self._incarnation = 0
        self._load = dataclasses.replace(template.load(), state="starting")
        self._rids: dict[str, int] = {}  # request id -> open stream id
        self._last_draft: tuple[int, StagedWeights] | None = None
        monitor = getattr(template, "spec_monitor", None)
        if monitor is not None:
            self.spec_monitor = monitor  # fed from the actor's snapshots
        host.engines[engine_id] = self

    # attributes the edges read from the engine they wrap
    @property
    def model(self) -> str | None:
        return getattr(self.template, "model", None)

    @property
    def vllm_args(self) -> dict:
        return getattr(self.template, "vllm_args", {})

    @property
    def params(self):
        return getattr(self.template, "params", None)

    @property
    def actor_pid(self) -> int | None:
        return self.host.info.get("pid") if self.host.alive else None

    @property
    def node_id(self) -> str | None:
        return self.host.info.get("node_id")

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            self.restarts += 1
        self._started = True
        self._state = "starting"
        try:
            await self.host.ensure()
            incarnation, load = await self.host.call("start_engine", self.engine_id)
        except BaseException as exc:
            self._state = "dead"  # the core's health watch tries again
            if isinstance(exc, Exception) and not isinstance(exc, EngineError):
                raise EngineError(f"engine {self.engine_id}: {type(exc).__name__}: {str(exc).splitlines()[0]}") from exc
            raise
        self._incarnation, self._load = incarnation, load
        self._state = "ready"
        if self._last_draft is not None:
            await self.update_draft_weights(*self._last_draft)

    async def close(self) -> None:
        if self._state == "dead":
            return
        self._state = "dead"
        await self.host.close_engine(self.engine_id)

    def _snapshot(self, incarnation: int, load: EngineLoad, spec: dict | None) -> None:
        if incarnation < self._incarnation:
            return  # from before the latest (re)start
        self._incarnation, self._load = incarnation, load
        if spec is not None and hasattr(self, "spec_monitor"):
            m = self.spec_monitor
            m.observations.extend(spec["observations"])
            for key in ("steps", "spec_steps", "draft_tokens", "accepted_tokens", "accepted_per_pos",
                        "drafted_per_pos", "draft_version"):
                setattr(m, key, spec[key])

    def load(self) -> EngineLoad:
        """The snapshot of the actor's last batch; `dead` once the actor is."""
        load = self._load
        if self._state == "ready":
            if self.host.alive:
                return load  # the engine's own state (a vLLM engine core may have died)
            state = "dead"
        else:
            state = self._state
        return load if load.state == state else dataclasses.replace(load, state=state)

    # -- generation ------------------------------------------------------------------

    def add(self, request: EngineRequest) -> AsyncIterator[TokenDelta]:
        if self._state != "ready" or not self.host.alive:
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
        ref = await weights_ref(weights)
        out = await self.host.call("update_weights", self.engine_id, version, ref, "policy")
        self._snapshot(*out["load"], None)
        self.last_update = out

    async def update_draft_weights(self, version: int, weights: StagedWeights) -> None:
        ref = await weights_ref(weights)
        await self.host.call("update_weights", self.engine_id, version, ref, "draft")
        self._last_draft = (version, weights)
        if hasattr(self, "spec_monitor"):
            self.spec_monitor.draft_version = version

    # -- speculative decoding ---------------------------------------------------------

    def spec_status(self) -> dict:
        return self.spec_monitor.status() if hasattr(self, "spec_monitor") else {"method": "off"}

    async def set_spec_schedule(self, schedule) -> None:
        await self.host.call("set_spec_schedule", self.engine_id, [list(e) for e in schedule])
        self.spec_monitor.set_schedule(schedule)

    async def spec_engine_info(self) -> dict:
        return await self.host.call("spec_engine_info", self.engine_id)


# -- building the fleet ------------------------------------------------------------------


def bind_counters(engines, counters: Counter) -> None:
    """Count Ray hops and actor deaths in `counters` (the core's, so they
    show in Status and /metrics)."""
    for engine in engines:
        host = getattr(engine, "host", None)
        if isinstance(host, RayHost) and host.fleet.stats is not counters:
            counters.update(host.fleet.stats)
            host.fleet.stats.clear()
            host.fleet.stats = counters


def connect(address: str, object_store_gb: float = 0.0) -> bool:
    """Join a Ray cluster ("auto": the one this node belongs to; "" starts a
    local one). Returns whether this call started Ray (and must stop it)."""
    import ray

    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"include_dashboard": False, "namespace": "rollout-service", "log_to_driver": True}
    if not address or address == "local":
        if object_store_gb:
            kwargs["object_store_memory"] = int(object_store_gb * 1024**3)
    else:
        kwargs["address"] = address
    ray.init(**kwargs)
    return True


def make_ray_engines(factories: list[tuple[str, Callable[[], Engine]]], *, address: str = "auto",
                     strategy: str = "SPREAD", cpus_per_engine: float = 1.0, gpus_per_engine: float = 0.0,
                     engines_per_actor: int = 1, object_store_gb: float = 0.0,
                     heartbeat_s: float = 0.25) -> list[RayEngine]:
    """One actor per `engines_per_actor` engines, each in its own bundle of
    a placement group (CPU: `cpus_per_engine` per engine; GPU: `gpus_per_engine`,
    e.g. the tensor-parallel size)."""
    if engines_per_actor < 1:
        raise ValueError(f"engine.ray_engines_per_actor must be >= 1, got {engines_per_actor}")
    if strategy not in ("SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK"):
        raise ValueError(f"engine.ray_strategy must be SPREAD, PACK, STRICT_SPREAD or STRICT_PACK, got {strategy!r}")
    started = connect(address, object_store_gb)
    chunks = [factories[i:i + engines_per_actor] for i in range(0, len(factories), engines_per_actor)]
    bundles = []
    for chunk in chunks:
        bundle = {"CPU": cpus_per_engine * len(chunk)}
        if gpus_per_engine:
            bundle["GPU"] = gpus_per_engine * len(chunk)
        bundles.append(bundle)
    fleet = RayFleet(bundles, strategy, started)
    engines = []
    for index, chunk in enumerate(chunks):
        options = {"num_cpus": bundles[index]["CPU"], "num_gpus": bundles[index].get("GPU", 0),
                   "max_concurrency": 10_000}
        host = RayHost(fleet, index, dict(chunk), options, heartbeat_s)
        engines += [RayEngine(eid, host, make()) for eid, make in chunk]
    return engines
