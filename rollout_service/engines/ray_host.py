"""The host side of engines in other processes: `EngineHost` runs inside a
Ray actor or a local host process (`proc_fleet`), hosts one or more real
engines (a `VllmEngine` or a `SimEngine`, unchanged) and multiplexes what
they produce onto one event stream.

What crosses to the server (`hosted`) is typed: an `EventBatch` per stream
item, holding load snapshots, stream events (token deltas, stream ends,
errors) and speculation snapshots. Deltas of tokens only that share a
version travel as one `DeltaRun` of arrays, gathered per stream, not an
object each: an engine that steps every sequence every step sends one token
per sequence per step, and a server that falls behind gets several per
stream in one. Weights arrive through Ray's object store and are staged once per
actor and version as a safetensors file in the node's /dev/shm; a local
host gets the server's staged file's path.
"""
from __future__ import annotations

import asyncio
import enum
import glob
import logging
import os
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Mapping, Sequence

from rollout_service.engines.base import Engine
from rollout_service.engines.spec_monitor import SpecSnapshot
from rollout_service.engines.stream import DeltaStream
from rollout_service.engines.types import EngineDescription, EngineLoad, EngineRequest, EngineState, TokenDelta
from rollout_service.engines.weights import StagedWeights, WeightTensor

log = logging.getLogger(__name__)

STAGING_PREFIX = "rollout-weights-ray-"


class EventKind(enum.IntEnum):
    DELTA = 0  # token deltas of a request
    END = 1  # the request's stream ended without a finish (aborted)
    ERROR = 2  # the request failed on the engine


@dataclass(slots=True)
class StreamEvent:
    """News of one request stream (`stream_id`, opened by the proxy)."""

    stream_id: int
    kind: EventKind
    delta: TokenDelta | None = None  # DELTA
    error: str = ""  # ERROR: "ExceptionType: message"


@dataclass(slots=True)
class DeltaRun:
    """Deltas of tokens and nothing else (no finish, no drafts, no
    alternatives) of several streams, all sampled by `version`, gathered per
    stream: the i-th stream got the next `counts[i]` tokens of `token_ids`
    (and `logprobs`)."""

    version: int
    stream_ids: array = field(default_factory=lambda: array("q"))
    counts: array = field(default_factory=lambda: array("q"))
    token_ids: array = field(default_factory=lambda: array("q"))
    logprobs: array = field(default_factory=lambda: array("d"))


@dataclass(slots=True)
class EventBatch:
    """One item of an actor's event stream: per engine its load snapshot
    (`EngineHost.snapshot`), the stream events since the last batch, and
    speculation snapshots of the engines that speculate."""

    loads: dict[str, tuple[int, int, EngineLoad]]
    events: list[StreamEvent | DeltaRun] = field(default_factory=list)
    spec: dict[str, SpecSnapshot] = field(default_factory=dict)


@dataclass(slots=True)
class WeightsApplied:
    """The reply of `EngineHost.update_weights` (seconds)."""

    stage_s: float
    apply_s: float
    incarnation: int
    taken: int  # when the load was read (`EngineHost.snapshot`)
    load: EngineLoad


def _gather(gathered: dict[int, tuple[list[int], list[float]]], stream_id: int, token_ids: list[int],
            logprobs: list[float]) -> None:
    """Add a stream's tokens to those a run gathered for it."""
    known = gathered.get(stream_id)
    if known is None:
        gathered[stream_id] = (list(token_ids), list(logprobs))
    else:
        known[0].extend(token_ids)
        known[1].extend(logprobs)


class EngineHost:
    """Runs inside a Ray actor process: hosts one or more engines and
    multiplexes what they produce onto one event stream.

    `factories` maps engine ids to zero-argument callables that build the
    engines (pickled by reference: `functools.partial(SimEngine, ...)`)."""

    def __init__(self, factories: Mapping[str, Callable[[], Engine]], heartbeat_s: float = 0.25,
                 batch_s: float = 0.0) -> None:
        self.engines: dict[str, Engine] = {eid: make() for eid, make in factories.items()}
        self.incarnation: Counter[str] = Counter()  # bumped at every start of an engine
        self._taken = 0  # load snapshots read so far
        self.heartbeat_s = heartbeat_s
        self.batch_s = batch_s  # news waits at most this long for more to join its batch
        self._streams: dict[tuple[str, str], int] = {}  # (engine id, request id) -> stream id
        self._events: list[StreamEvent | DeltaRun] = []
        # This batch's runs, each with its tokens gathered per stream; the
        # last takes more tokens while it is the last event.
        self._open_runs: list[tuple[DeltaRun, dict[int, tuple[list[int], list[float]]]]] = []
        self._token_relay = self._relay_tokens  # one object, so that a step's streams share it
        self._wake: asyncio.Event | None = None
        self._staged: dict[str, tuple[int, StagedWeights]] = {}  # target -> (version, staged file)
        self._stage_lock: asyncio.Lock | None = None
        remove_orphan_staging()

    def snapshot(self, engine_id: str) -> tuple[int, int, EngineLoad]:
        """(incarnation, taken, load) of an engine now: `taken` orders the
        snapshots of this host, so the server keeps the newest of those that
        reach it out of order (under Ray an event batch and a call's reply
        travel apart)."""
        self._taken += 1
        return self.incarnation[engine_id], self._taken, self.engines[engine_id].load()

    def _event(self) -> asyncio.Event:
        if self._wake is None:
            self._wake = asyncio.Event()
        return self._wake

    def _push(self, event: StreamEvent) -> None:
        self._events.append(event)
        self._event().set()

    def _gathering(self, version: int) -> dict[int, tuple[list[int], list[float]]]:
        """The tokens gathered per stream in the open run of `version` (one
        opened when the last event is not such a run)."""
        events = self._events
        runs = self._open_runs
        if not runs or not events or events[-1] is not runs[-1][0] or runs[-1][0].version != version:
            run = DeltaRun(version)
            runs.append((run, {}))
            events.append(run)
            self._event().set()
        return runs[-1][1]

    def _relay_tokens(self, streams: Sequence[DeltaStream], token_ids: Sequence[list[int]],
                      logprobs: Sequence[list[float]], version: int) -> None:
        """A step's deltas of tokens only (`push_tokens_many`; each stream's
        target is its (key, stream id)), gathered into the open run in one pass."""
        gathered = self._gathering(version)
        live = self._streams
        for stream, ids, lps in zip(streams, token_ids, logprobs):
            key, stream_id = stream.target
            if live.get(key) == stream_id:  # else aborted: the server took the partial
                _gather(gathered, stream_id, ids, lps)

    def _push_tokens(self, stream_id: int, token_ids: list[int], logprobs: list[float], version: int) -> None:
        _gather(self._gathering(version), stream_id, token_ids, logprobs)

    def _close_runs(self) -> None:
        """Lay the gathered tokens of this batch's runs out as arrays."""
        for run, gathered in self._open_runs:
            for stream_id, (token_ids, logprobs) in gathered.items():
                run.stream_ids.append(stream_id)
                run.counts.append(len(token_ids))
                run.token_ids.extend(token_ids)
                run.logprobs.extend(logprobs)
        self._open_runs = []

    def _push_delta(self, stream_id: int, d: TokenDelta) -> None:
        if d.tokens_only:
            self._push_tokens(stream_id, d.token_ids, d.logprobs, d.version)
        else:
            self._push(StreamEvent(stream_id, EventKind.DELTA, delta=d))

    async def info(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {"pid": os.getpid(), "node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address()}

    async def start_engine(self, engine_id: str) -> tuple[int, int, EngineLoad]:
        engine = self.engines[engine_id]
        if self.incarnation[engine_id] == 0 or engine.load().state == EngineState.DEAD:
            await engine.start()
        self.incarnation[engine_id] += 1
        return self.snapshot(engine_id)

    async def describe(self, engine_id: str) -> EngineDescription:
        return self.engines[engine_id].describe()

    async def add(self, engine_id: str, stream_id: int, request: EngineRequest) -> None:
        key = (engine_id, request.request_id)
        try:
            deltas = self.engines[engine_id].add(request)
        except Exception as exc:
            self._push(StreamEvent(stream_id, EventKind.ERROR, error=f"{type(exc).__name__}: {exc}"))
            return
        self._streams[key] = stream_id
        if isinstance(deltas, DeltaStream):
            self._attach(key, stream_id, deltas)
        else:
            asyncio.get_running_loop().create_task(self._forward(key, stream_id, deltas))

    def _attach(self, key: tuple[str, str], stream_id: int, deltas: DeltaStream) -> None:
        """Take the stream's deltas in its engine's step (no task per request)."""
        streams = self._streams

        def sink(d: TokenDelta) -> None:
            if streams.get(key) != stream_id:
                return  # aborted: the server took the partial
            self._push_delta(stream_id, d)
            if d.finish_reason is not None:
                del streams[key]

        def failed(exc: BaseException) -> None:
            if streams.get(key) == stream_id:
                del streams[key]
                self._push(StreamEvent(stream_id, EventKind.ERROR, error=f"{type(exc).__name__}: {exc}"))

        deltas.attach(sink, failed, relay=self._token_relay, target=(key, stream_id))

    async def _forward(self, key: tuple[str, str], stream_id: int, deltas: AsyncIterator[TokenDelta]) -> None:
        # Consume to the end even after an abort (the engine ends the stream);
        # what follows an abort is dropped: the server took the partial.
        try:
            async for d in deltas:
                if self._streams.get(key) == stream_id:
                    self._push_delta(stream_id, d)
        except Exception as exc:
            if self._streams.get(key) == stream_id:
                self._push(StreamEvent(stream_id, EventKind.ERROR, error=f"{type(exc).__name__}: {exc}"))
        else:
            if self._streams.get(key) == stream_id:
                self._push(StreamEvent(stream_id, EventKind.END))
        finally:
            if self._streams.get(key) == stream_id:
                del self._streams[key]

    async def abort(self, engine_id: str, request_id: str) -> tuple[list[int], list[float], list[int]]:
        self._streams.pop((engine_id, request_id), None)
        p = await self.engines[engine_id].abort(request_id)
        return p.token_ids, p.logprobs, p.versions

    async def events(self):
        """The host's one stream of `EventBatch`es: a batch `batch_s` after
        the first news (as soon as there is news, at 0), else every
        `heartbeat_s` (load snapshots)."""
        wake = self._event()
        while True:
            try:
                await asyncio.wait_for(wake.wait(), self.heartbeat_s)
            except asyncio.TimeoutError:
                pass
            if self.batch_s > 0 and self._events:
                await asyncio.sleep(self.batch_s)
            wake.clear()
            self._close_runs()
            events, self._events = self._events, []
            loads = {eid: self.snapshot(eid) for eid in self.engines}
            spec = {eid: e.speculation.monitor.to_snapshot()
                    for eid, e in self.engines.items() if e.speculation is not None}
            yield EventBatch(loads, events, spec)

    async def _stage(self, target: str, version: int, payload: list | str) -> tuple[StagedWeights, float]:
        """One staged file per actor and version, shared by its engines (a
        local host is given the server's staged file: `payload` its path)."""
        if isinstance(payload, str):
            return StagedWeights([], source_path=payload), 0.0
        if self._stage_lock is None:
            self._stage_lock = asyncio.Lock()
        async with self._stage_lock:
            known = self._staged.get(target)
            if known is not None and known[0] == version:
                return known[1], 0.0
            t0 = time.perf_counter()
            staged = StagedWeights([WeightTensor(n, dt, tuple(shape), memoryview(a)) for n, dt, shape, a in payload],
                                   prefix=f"{STAGING_PREFIX}{os.getpid()}-")
            await staged.as_file()
            staged.tensors = []  # the file has them: let the object store copy go
            if known is not None:
                known[1].cleanup()
            self._staged[target] = (version, staged)
            return staged, time.perf_counter() - t0

    async def update_weights(self, engine_id: str, version: int, payload: list | str,
                             target: str = "policy") -> WeightsApplied:
        """`payload` is the pushed tensors, resolved from the object store by
        Ray before the call runs: [(name, dtype, shape, uint8 array)]; or,
        in a local host, the path of the server's staged file.
        `target` "draft" applies them to the engine's draft model."""
        staged, stage_s = await self._stage(target, version, payload)
        del payload
        t0 = time.perf_counter()
        engine = self.engines[engine_id]
        if target == "policy":
            await engine.update_weights(version, staged)
        else:
            await self._speculation(engine_id).update_draft_weights(version, staged)
        return WeightsApplied(stage_s, time.perf_counter() - t0, *self.snapshot(engine_id))

    # -- collective weight transfer: the actor's engine joins the trainer's
    # group itself (its workers receive straight from the trainer's ranks);
    # only the control calls travel through Ray.

    async def transfer_ranks(self, engine_id: str) -> int:
        return self.engines[engine_id].transfer_ranks()

    async def device_report(self, engine_id: str) -> list[dict]:
        return list(await self.engines[engine_id].device_report())

    async def transfer_devices(self, engine_id: str) -> list[dict]:
        return [d.to_dict() for d in await self.engines[engine_id].transfer_devices()]

    async def init_weight_transfer(self, engine_id: str, init) -> None:
        await self.engines[engine_id].init_weight_transfer(init)

    async def receive_weights(self, engine_id: str, version: int, specs: list) -> None:
        await self.engines[engine_id].receive_weights(version, specs)

    async def finish_received_weights(self, engine_id: str, version: int) -> WeightsApplied:
        t0 = time.perf_counter()
        engine = self.engines[engine_id]
        await engine.finish_received_weights(version)
        return WeightsApplied(0.0, time.perf_counter() - t0, *self.snapshot(engine_id))

    async def abandon_received_weights(self, engine_id: str, version: int, payload: list | str | None) -> None:
        """Put the serving weights (`payload`, resolved by Ray; None: the
        model's own files) back after a failed receive."""
        fallback = (await self._stage("policy", version, payload))[0] if payload is not None else None
        del payload
        await self.engines[engine_id].abandon_received_weights(fallback, version)

    async def close_weight_transfer(self, engine_id: str) -> None:
        await self.engines[engine_id].close_weight_transfer()

    def _speculation(self, engine_id: str):
        spec = self.engines[engine_id].speculation
        if spec is None:
            raise RuntimeError(f"engine {engine_id} does not speculate")
        return spec

    async def set_spec_schedule(self, engine_id: str, schedule) -> None:
        await self._speculation(engine_id).set_schedule(schedule)

    async def close_engine(self, engine_id: str) -> None:
        await self.engines[engine_id].close()
        if all(e.load().state == EngineState.DEAD for e in self.engines.values()):
            for _, staged in self._staged.values():
                staged.cleanup()
            self._staged.clear()


def remove_orphan_staging() -> None:
    """Staging files of actors on this node that died without closing (a
    killed actor cannot clean up after itself)."""
    for path in glob.glob(f"/dev/shm/{STAGING_PREFIX}*"):
        try:
            pid = int(os.path.basename(path)[len(STAGING_PREFIX):].split("-", 1)[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            try:
                os.unlink(path)
            except OSError as exc:
                log.debug("orphan staging file %s: %s", path, exc)
        except (ValueError, PermissionError):
            pass
