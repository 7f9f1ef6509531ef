"""The server's side of engines that live in another process: an engine host
(`ray_host.EngineHost`, in a Ray actor or in a local host process) runs the
real engines and sends their news on one stream of `EventBatch`es.

`HostLink` is what both kinds of host share on the server: the open request
streams and the routing of each batch to them. `HostedEngine` implements the
engine protocol for an engine living in a host; the core cannot tell it from
a local one. Its `add` returns a `DeltaStream`: the host's reader pushes every
delta of a batch straight into the core's sink, with no task switch per
delta, and deltas of tokens only arrive gathered per stream (`DeltaRun`).

A concrete link (`ray_proxy.RayHost`, `proc_fleet.ProcessHost`) provides
`_spawn`, `call`, `send_add`, `weights_payload` and `_end`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter
from typing import Any, Callable, Mapping

from rollout_proto.devices import RankDevice
from rollout_service.engines.base import Engine, EngineError
from rollout_service.engines.ray_host import DeltaRun, EventBatch, EventKind, WeightsApplied
from rollout_service.engines.spec_monitor import SpecMonitor, SpecSnapshot
from rollout_service.engines.speculation import MonitoredSpeculation
from rollout_service.engines.stream import DeltaStream, push_tokens_many
from rollout_service.engines.types import (
    EngineDescription,
    EngineLoad,
    EngineRequest,
    EngineState,
    FinishReason,
    PartialResponse,
    TokenDelta,
)
from rollout_service.engines.weights import StagedWeights

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 30.0  # one engine's close in its host


def _ended() -> TokenDelta:
    """What a stream ended without a finish (aborted) hands its reader."""
    return TokenDelta([], [], 0, FinishReason.ABORTED)


class HostLink:
    """The server's end of one engine host: its engines, their open request
    streams, and the routing of the host's event batches to them."""

    # counters (in the core's, so they show in Status and /metrics)
    BATCHES, EVENTS, CALLS, DEATHS = "host_batches", "host_events", "host_calls", "host_deaths"

    def __init__(self, fleet, factories: dict[str, Callable[[], Engine]], heartbeat_s: float) -> None:
        self.fleet = fleet  # its `stats` counters are the hosts' (bound to the core's)
        self.factories = factories  # engine id -> what builds it in the host
        self.heartbeat_s = heartbeat_s
        self.generation = 0  # hosts started so far (a restart is the next)
        self._pump: asyncio.Task | None = None  # reads the host's event batches
        self.engines: dict[str, HostedEngine] = {}
        self.alive = False
        self.info: dict[str, Any] = {}
        # stream id -> (its stream, engine, request id)
        self._streams: dict[int, tuple[DeltaStream, HostedEngine, str]] = {}
        self._next_stream = 0
        self._lock: asyncio.Lock | None = None
        self._closed = 0

    @property
    def stats(self) -> Counter:
        return self.fleet.stats

    async def ensure(self) -> None:
        """Make sure the host runs (a new one if it died)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.alive:
                return
            await self._spawn()

    # -- what a concrete link provides ----------------------------------------------

    async def _spawn(self) -> None:
        """Start the host (a new one: the previous, if any, is dead)."""
        raise NotImplementedError

    async def call(self, method: str, *args) -> Any:
        """One awaited call of the host's `EngineHost` method; EngineError if the host is dead."""
        raise NotImplementedError

    def send_add(self, engine_id: str, stream_id: int, request: EngineRequest) -> None:
        """Start a request on the host's engine (not awaited: its deltas come as events)."""
        raise NotImplementedError

    async def weights_payload(self, weights: StagedWeights) -> Any:
        """What `EngineHost.update_weights` receives for a push."""
        raise NotImplementedError

    async def _end(self) -> None:
        """End the host, its engines all closed."""
        raise NotImplementedError

    async def close_engine(self, engine_id: str) -> None:
        """Close one engine; the host ends once all of its engines are closed,
        counted as their closes complete (the host answers each first):
        counted at the call, the last engine's close would end the host
        under a close still in flight."""
        if self.alive:
            try:
                await asyncio.wait_for(self.call("close_engine", engine_id), CLOSE_TIMEOUT_S)
            except Exception as exc:
                log.debug("close of %s: %s: %s", engine_id, type(exc).__name__, exc)
        self._closed += 1
        if self._closed >= len(self.engines):
            await self._end()

    # -- streams --------------------------------------------------------------------

    def open_stream(self, engine: "HostedEngine", request_id: str) -> tuple[int, DeltaStream]:
        self._next_stream += 1
        stream = DeltaStream()
        self._streams[self._next_stream] = (stream, engine, request_id)
        return self._next_stream, stream

    def _close(self, stream_id: int) -> tuple[DeltaStream, "HostedEngine", str] | None:
        entry = self._streams.pop(stream_id, None)
        if entry is not None:
            _, engine, request_id = entry
            if engine._rids.get(request_id) == stream_id:
                del engine._rids[request_id]
        return entry

    def end_stream(self, stream_id: int) -> None:
        """The server ended it (an abort): its reader sees an aborted finish."""
        entry = self._close(stream_id)
        if entry is not None:
            entry[0].push(_ended())

    def dispatch(self, batch: EventBatch) -> None:
        """Route one event batch: load snapshots to the engines, each delta
        to its request's stream (those the server already ended are dropped:
        it took their partials)."""
        stats = self.stats
        stats[self.BATCHES] += 1
        for eid, (incarnation, taken, load) in batch.loads.items():
            self.engines[eid]._snapshot((incarnation, taken), load, batch.spec.get(eid))
        streams = self._streams
        for ev in batch.events:
            if type(ev) is DeltaRun:
                token_ids, logprobs, at = ev.token_ids, ev.logprobs, 0
                stats[self.EVENTS] += len(ev.stream_ids)
                to, ids, lps = [], [], []
                for sid, n in zip(ev.stream_ids, ev.counts):
                    entry = streams.get(sid)
                    if entry is not None:
                        to.append(entry[0])
                        if n == 1:  # most often: the server keeps up, a token per stream
                            ids.append([token_ids[at]])
                            lps.append([logprobs[at]])
                        else:
                            ids.append(token_ids[at:at + n].tolist())
                            lps.append(logprobs[at:at + n].tolist())
                    at += n
                if to:
                    push_tokens_many(to, ids, lps, ev.version)
                continue
            stats[self.EVENTS] += 1
            entry = streams.get(ev.stream_id)
            if entry is None:
                continue
            if ev.kind == EventKind.DELTA:
                if ev.delta.finish_reason is not None:
                    self._close(ev.stream_id)
                entry[0].push(ev.delta)
            elif ev.kind == EventKind.END:
                self._close(ev.stream_id)
                entry[0].push(_ended())
            else:
                self._close(ev.stream_id)
                entry[0].fail(EngineError(ev.error))

    def died(self, what: str, exc: BaseException) -> None:
        """The host died: its engines report dead, every open stream fails."""
        log.warning("%s for %s (pid %s) died: %s: %s", what, ",".join(self.engines), self.info.get("pid"),
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        self.alive = False
        self.stats[self.DEATHS] += 1
        error = EngineError(f"{what} {self.info.get('pid')} died: {type(exc).__name__}")
        streams, self._streams = self._streams, {}
        for engine in self.engines.values():
            engine._rids.clear()
        for stream, _, _ in streams.values():
            stream.fail(error)


class HostedEngine:
    """An engine protocol proxy for an engine living in an engine host.

    `template` is a never-started instance of the engine, built in the
    server from the same factory as the host's: it answers
    `check_weights` and `describe` locally, and its speculation monitor
    mirrors the host engine's (`SpecMonitor.apply_snapshot`)."""

    placement = "host"

    def __init__(self, engine_id: str, host: HostLink, template: Engine) -> None:
        self.engine_id = engine_id
        self.kind = template.kind
        self.host = host
        self.template = template
        self.restarts = 0
        self._started = False
        self._state = EngineState.STARTING  # the server's view: starting, ready or dead (closed)
        self._stamp = (0, 0)  # (incarnation, taken) of the host's snapshot in _load
        self._load = dataclasses.replace(template.load(), state=EngineState.STARTING)
        self._rids: dict[str, int] = {}  # request id -> open stream id
        self._ranks = 0  # receiving ranks of a collective transfer (the host's engine says, at start)
        spec = template.speculation
        self.speculation: HostedSpeculation | None = HostedSpeculation(self, spec.monitor) if spec is not None else None
        host.engines[engine_id] = self

    @property
    def host_pid(self) -> int | None:
        return self.host.info.get("pid") if self.host.alive else None

    def describe(self) -> EngineDescription:
        """The template's description, with the KV capacity the host's
        engine reports once started."""
        described = self.template.describe()
        return dataclasses.replace(described, placement=self.placement, kv_capacity_tokens=self._load.kv_capacity_tokens,
                                   workers=self._ranks or described.workers)

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            self.restarts += 1
        self._started = True
        self._state = EngineState.STARTING
        try:
            await self.host.ensure()
            incarnation, taken, load = await self.host.call("start_engine", self.engine_id)
        except BaseException as exc:
            self._state = EngineState.DEAD  # the core's health watch tries again
            if isinstance(exc, Exception) and not isinstance(exc, EngineError):
                raise EngineError(f"engine {self.engine_id}: {type(exc).__name__}: {str(exc).splitlines()[0]}") from exc
            raise
        self._stamp, self._load = (incarnation, taken), load
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

    def _snapshot(self, stamp: tuple[int, int], load: EngineLoad, spec: SpecSnapshot | None) -> None:
        """Take the host's snapshot stamped (incarnation, taken) unless a newer
        one is in: one from before the latest (re)start, or read before the
        one it would replace (a Ray event batch overtaken by a weight call's
        reply), would put an old load or version back."""
        if stamp < self._stamp:
            return
        self._stamp, self._load = stamp, load
        if spec is not None and self.speculation is not None:
            self.speculation.monitor.apply_snapshot(spec)

    def load(self) -> EngineLoad:
        """The snapshot of the host's last batch; `dead` once the host is."""
        load = self._load
        if self._state == EngineState.READY:
            if self.host.alive:
                return load  # the engine's own state (a vLLM engine core may have died)
            state = EngineState.DEAD
        else:
            state = self._state
        return load if load.state == state else dataclasses.replace(load, state=state)

    # -- generation ------------------------------------------------------------------

    def add(self, request: EngineRequest) -> DeltaStream:
        if self._state != EngineState.READY or not self.host.alive:
            raise EngineError(f"engine {self.engine_id} is not running")
        if request.request_id in self._rids:
            raise EngineError(f"request {request.request_id} already running on {self.engine_id}")
        stream_id, stream = self.host.open_stream(self, request.request_id)
        self._rids[request.request_id] = stream_id
        self.host.send_add(self.engine_id, stream_id, request)  # its deltas come on the event stream
        return stream

    async def abort(self, request_id: str) -> PartialResponse:
        stream_id = self._rids.get(request_id)
        if stream_id is None:
            return PartialResponse([], [], [])
        self.host.end_stream(stream_id)
        # A dead host raises: the core keeps the tokens it already received.
        tokens, logprobs, versions = await self.host.call("abort", self.engine_id, request_id)
        return PartialResponse(list(tokens), list(logprobs), list(versions))

    # -- weights ---------------------------------------------------------------------

    def check_weights(self, manifest: Mapping[str, tuple[str, tuple[int, ...]]]) -> None:
        self.template.check_weights(manifest)

    async def update_weights(self, version: int, weights: StagedWeights) -> None:
        payload = await self.host.weights_payload(weights)
        out: WeightsApplied = await self.host.call("update_weights", self.engine_id, version, payload, "policy")
        self._snapshot((out.incarnation, out.taken), out.load, None)
        self.last_update = out

    # -- collective weight transfer -------------------------------------------------
    # The engine in the host joins the trainer's group itself: the tensors go
    # from the trainer's ranks to its workers, never through the host link or
    # this process; these calls are the control plane only.

    def transfer_ranks(self) -> int:
        return self._ranks if self._state == EngineState.READY and self.host.alive else 0

    async def device_report(self) -> list[dict]:
        """Where the engine's workers compute (a vLLM engine's
        `device_report`, run in its host)."""
        return await self.host.call("device_report", self.engine_id)

    async def transfer_devices(self) -> list[RankDevice]:
        return [RankDevice.from_dict(d) for d in await self.host.call("transfer_devices", self.engine_id)]

    async def init_weight_transfer(self, init) -> None:
        await self.host.call("init_weight_transfer", self.engine_id, init)

    async def receive_weights(self, version: int, specs: list) -> None:
        await self.host.call("receive_weights", self.engine_id, version, specs)

    async def finish_received_weights(self, version: int) -> None:
        out: WeightsApplied = await self.host.call("finish_received_weights", self.engine_id, version)
        self._snapshot((out.incarnation, out.taken), out.load, None)
        self.last_update = out

    async def abandon_received_weights(self, fallback: StagedWeights | None, version: int) -> None:
        payload = await self.host.weights_payload(fallback) if fallback is not None else None
        await self.host.call("abandon_received_weights", self.engine_id, version, payload)

    async def close_weight_transfer(self) -> None:
        if not self.host.alive:
            return
        try:
            await self.host.call("close_weight_transfer", self.engine_id)
        except EngineError as exc:
            log.debug("leaving the transfer group on %s: %s", self.engine_id, exc)


class HostedSpeculation(MonitoredSpeculation):
    """Speculation of an engine in a host: calls go to the host; the
    monitor mirrors the host engine's from the event stream's snapshots."""

    def __init__(self, engine: HostedEngine, monitor: SpecMonitor) -> None:
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
        payload = await engine.host.weights_payload(weights)
        await engine.host.call("update_weights", engine.engine_id, version, payload, "draft")
        self._last_draft = (version, weights)
        self.monitor.draft_version = version

    async def restore(self) -> None:
        """After a (re)start in a new host: re-apply the latest drafter."""
        if self._last_draft is not None:
            await self.update_draft_weights(*self._last_draft)


def bind_counters(engines, counters: Counter) -> None:
    """Count the hosts' hops and deaths in `counters` (the core's, so they
    show in Status and /metrics)."""
    for engine in engines:
        if isinstance(engine, HostedEngine):
            fleet = engine.host.fleet
            if fleet.stats is not counters:
                counters.update(fleet.stats)
                fleet.stats.clear()
                fleet.stats = counters
