"""Engines in host processes on this machine (`engine.placement_backend = "process"`).

    server process                                host process (one per `engines_per_host`)
    -----------------------------------------     -----------------------------------------
    RolloutCore -> ProcessEngine (per engine)     EngineHost: 1+ real engines, their output
                   ProcessHost (per host)   <---  processing and deltas; one stream of
                                  a socket pair   EventBatches (loads, deltas, spec snapshots)

The same engines as in the server's own process (a `VllmEngine`'s `AsyncLLM`
front end or a `SimEngine`), and the same host code as a Ray actor's
(`ray_host.EngineHost`): what an engine costs per token (output processing,
detokenising, the simulator's steps) is spent in its host, and the server
receives each host's news as batches, deltas of tokens gathered per stream
as arrays. On a fleet of many engines this is what keeps one server process
from relaying every token of the fleet through its own event loop
(docs/architecture.md, "Engine hosts").

The link is a socket pair; each frame is a 4-byte length and a pickle:

    server -> host   ("adds", [(engine_id, stream_id, request)])  not answered
                     ("call", call_id, method, args)            answered by "ret"
    host -> server   ("hello", info) once, ("ret", call_id, ok, value), ("ev", EventBatch)

A host whose socket closes (it died, was killed) fails its engines' open
streams; the core's health watch restarts them in a new host, as for a Ray
actor. A host exits when the server's end closes, so a killed server leaves
no host behind. Weights: the server's staged file's path goes to the host,
whose engines load it (no copy through the socket).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import socket
import struct
import sys
from collections import Counter
from typing import Any, Callable

from rollout_service.engines.base import Engine, EngineError
from rollout_service.engines.hosted import CLOSE_TIMEOUT_S, HostedEngine, HostLink
from rollout_service.engines.ray_host import EngineHost
from rollout_service.engines.types import EngineRequest
from rollout_service.engines.weights import StagedWeights

log = logging.getLogger(__name__)

HEADER = struct.Struct("!I")
START_TIMEOUT_S = 120.0  # a host's interpreter up and its engines built (not started)


def _frame(obj: Any) -> bytes:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(body)) + body


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    """The next frame, or None at the end of the stream (or a reset link)."""
    try:
        size = HEADER.unpack(await reader.readexactly(HEADER.size))[0]
        return pickle.loads(await reader.readexactly(size))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


class ProcessFleet:
    """The fleet's host processes and their counters."""

    def __init__(self) -> None:
        self.hosts: list[ProcessHost] = []
        self.stats: Counter[str] = Counter()  # host_batches, host_events, host_calls, host_deaths


class ProcessHost(HostLink):
    """The server's end of one host process: spawns it, reads its event
    batches, routes its calls' answers."""

    def __init__(self, fleet: ProcessFleet, index: int, factories: dict[str, Callable[[], Engine]],
                 heartbeat_s: float, batch_s: float = 0.0, nice: int = 0) -> None:
        super().__init__(fleet, factories, heartbeat_s)
        self.index = index
        self.batch_s = batch_s
        self.nice = nice
        self.proc: asyncio.subprocess.Process | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._calls: dict[int, asyncio.Future] = {}
        self._adds: list[tuple[str, int, EngineRequest]] = []
        self._call_ids = itertools.count(1)
        fleet.hosts.append(self)

    async def _spawn(self) -> None:
        self._kill()
        ours, theirs = socket.socketpair()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "rollout_service.engines.proc_fleet", str(theirs.fileno()),
                pass_fds=(theirs.fileno(),), stdin=asyncio.subprocess.DEVNULL)
        finally:
            theirs.close()
        reader, writer = await asyncio.open_connection(sock=ours, limit=1 << 24)
        writer.write(_frame((self.factories, self.heartbeat_s, self.batch_s, self.nice,
                             logging.getLogger().getEffectiveLevel())))
        try:
            hello = await asyncio.wait_for(_read_frame(reader), START_TIMEOUT_S)
            timed_out = False
        except asyncio.TimeoutError:
            hello, timed_out = None, True
        if not hello or hello[0] != "hello":
            writer.close()
            try:  # its link closed: it is exiting (bounded, then killed)
                await asyncio.wait_for(proc.wait(), 0.1 if timed_out else CLOSE_TIMEOUT_S)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
            what = f"did not start within {START_TIMEOUT_S:g} s" if timed_out else \
                f"exited before it was ready (exit code {proc.returncode}; its error is in the server's log)"
            raise EngineError(f"engine host {self.index} ({','.join(self.factories)}) {what}")
        self.proc, self._writer, self.info = proc, writer, hello[1]
        self.generation += 1
        self.alive = True
        self._pump = asyncio.create_task(self._read(reader, self.generation), name=f"engine-host-{self.index}")
        log.info("engine host for %s up: pid %s", ",".join(self.factories), self.info.get("pid"))

    def _kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    async def _read(self, reader: asyncio.StreamReader, generation: int) -> None:
        try:
            while (frame := await _read_frame(reader)) is not None:
                if frame[0] == "ev":
                    self.dispatch(frame[1])
                elif frame[0] == "ret":
                    fut = self._calls.pop(frame[1], None)
                    if fut is not None and not fut.done():
                        if frame[2]:
                            fut.set_result(frame[3])
                        else:
                            fut.set_exception(EngineError(frame[3]))
            raise EngineError("its link closed")
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            if generation == self.generation and self.alive:
                self._lost(exc)

    def _lost(self, exc: BaseException) -> None:
        self.died("engine host", exc)
        self._adds = []  # their streams failed with the host
        self._fail_calls(f"engine host {self.info.get('pid')} died")
        self._kill()

    def _fail_calls(self, why: str) -> None:
        """Every call still waiting for an answer fails with `why`."""
        calls, self._calls = self._calls, {}
        for fut in calls.values():
            if not fut.done():
                fut.set_exception(EngineError(why))

    def _send(self, message: tuple) -> None:
        if not self.alive or self._writer is None:
            raise EngineError(f"engine host {self.index} is not running")
        self._flush_adds()  # a call about a request goes after its add
        self._writer.write(_frame(message))

    def send_add(self, engine_id: str, stream_id: int, request: EngineRequest) -> None:
        """Queued, and sent with the adds queued beside it in one frame
        (a placement pass starts many requests at once)."""
        if not self.alive or self._writer is None:
            raise EngineError(f"engine host {self.index} is not running")
        if not self._adds:
            asyncio.get_running_loop().call_soon(self._flush_adds)
        self._adds.append((engine_id, stream_id, request))

    def _flush_adds(self) -> None:
        adds, self._adds = self._adds, []
        if adds and self.alive and self._writer is not None:
            self.stats[self.CALLS] += 1
            self._writer.write(_frame(("adds", adds)))

    async def call(self, method: str, *args) -> Any:
        """One awaited call of the host's `EngineHost` method; a dead host is an EngineError."""
        cid = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._send(("call", cid, method, args))
        self._calls[cid] = fut
        self.stats[self.CALLS] += 1
        return await fut

    async def weights_payload(self, weights: StagedWeights) -> str:
        return await weights.as_file()

    async def _end(self) -> None:
        self.alive = False
        if self._pump is not None:
            self._pump.cancel()
        self._fail_calls(f"engine host {self.index} closed")
        proc, writer, self._writer = self.proc, self._writer, None
        if writer is not None:
            writer.close()  # the host exits at the end of its link
        if proc is not None and proc.returncode is None:
            try:
                await asyncio.wait_for(proc.wait(), CLOSE_TIMEOUT_S)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()


class ProcessEngine(HostedEngine):
    """An engine protocol proxy for an engine living in a host process."""

    placement = "process"


def make_process_engines(factories: list[tuple[str, Callable[[], Engine]]], *, engines_per_host: int = 8,
                         heartbeat_s: float = 0.25, batch_ms: float = 0.0, nice: int = 0) -> list[ProcessEngine]:
    """One host process per `engines_per_host` engines (started with the engines)."""
    if engines_per_host < 1:
        raise ValueError(f"engine.process.engines_per_host must be >= 1, got {engines_per_host}")
    if not 0 <= nice <= 19:
        raise ValueError(f"engine.process.nice must be 0-19, got {nice}")
    fleet = ProcessFleet()
    engines = []
    for index in range(0, len(factories), engines_per_host):
        chunk = factories[index:index + engines_per_host]
        host = ProcessHost(fleet, index // engines_per_host, dict(chunk), heartbeat_s, batch_ms / 1e3, nice)
        engines += [ProcessEngine(eid, host, make()) for eid, make in chunk]
    return engines


# -- the host process ---------------------------------------------------------------------


class LocalEngineHost(EngineHost):
    """`EngineHost` in a host process of this machine."""

    async def info(self) -> dict[str, Any]:
        return {"pid": os.getpid()}


async def _host_main(fd: int) -> None:
    reader, writer = await asyncio.open_connection(sock=socket.socket(fileno=fd), limit=1 << 24)
    setup = await _read_frame(reader)
    if setup is None:
        return
    factories, heartbeat_s, batch_s, nice, level = setup
    if nice:
        os.nice(nice)  # below the server: on a machine with fewer cores than hosts, the server's loop goes first
    logging.basicConfig(level=level, format=f"%(asctime)s host {os.getpid()} %(levelname)s %(name)s: %(message)s")
    host = LocalEngineHost(factories, heartbeat_s, batch_s)
    writer.write(_frame(("hello", await host.info())))
    tasks: set[asyncio.Task] = set()

    async def pump() -> None:
        try:
            async for batch in host.events():
                writer.write(_frame(("ev", batch)))
                await writer.drain()
        except ConnectionError:
            pass  # the server's end closed: the main loop sees it too

    async def answer(cid: int, method: str, args: tuple) -> None:
        try:
            reply = ("ret", cid, True, await getattr(host, method)(*args))
        except Exception as exc:
            reply = ("ret", cid, False, f"{type(exc).__name__}: {exc}")
        if writer.is_closing():
            return
        try:
            data = _frame(reply)
        except Exception as exc:  # an answer that does not pickle
            data = _frame(("ret", cid, False, f"{type(exc).__name__}: {exc}"))
        writer.write(data)

    events = asyncio.create_task(pump())
    try:
        while (frame := await _read_frame(reader)) is not None:
            if frame[0] == "adds":
                for engine_id, stream_id, request in frame[1]:
                    await host.add(engine_id, stream_id, request)
            else:
                task = asyncio.create_task(answer(*frame[1:]))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
    finally:
        # The server closed its end (or went away): close the engines, bounded.
        events.cancel()
        for task in list(tasks):
            task.cancel()
        for eid in list(host.engines):
            try:
                await asyncio.wait_for(host.close_engine(eid), CLOSE_TIMEOUT_S)
            except Exception as exc:
                log.warning("closing engine %s: %s: %s", eid, type(exc).__name__, exc)



if __name__ == "__main__":
    asyncio.run(_host_main(int(sys.argv[1])))
