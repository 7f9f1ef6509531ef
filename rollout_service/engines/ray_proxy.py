"""The server side of the Ray fleet: `RayHost` (one per actor) spawns its
`EngineHost` actor in a placement-group bundle and reads its event stream;
`RayEngine` (one per engine) implements the engine protocol as a proxy for
the engine living in that actor.

`add` is one actor call (not awaited); every token delta and load snapshot
of every engine of an actor comes back on that actor's single streaming
generator (`EngineHost.events`), whose batches coalesce under load (the
generator is back-pressured to one batch in flight). `load()` reads the
snapshot the last batch carried: cheap and non-blocking. `abort` and weight
updates are one awaited call each. What is not Ray's (the streams, the
engine proxy) is shared with local host processes (`hosted`).
"""
from __future__ import annotations

import asyncio
import functools
import logging
from typing import TYPE_CHECKING, Any, Callable

from rollout_service.engines.base import Engine, EngineError
from rollout_service.engines.hosted import HostedEngine, HostLink
from rollout_service.engines.ray_host import EngineHost
from rollout_service.engines.types import EngineRequest
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


class RayHost(HostLink):
    """The server's side of one `EngineHost` actor: spawns it in its bundle,
    reads its event stream, routes deltas to the engines' open streams."""

    BATCHES, EVENTS, CALLS, DEATHS = "ray_stream_items", "ray_events", "ray_calls", "ray_actor_deaths"

    def __init__(self, fleet: "RayFleet", bundle_index: int, factories: dict[str, Callable[[], Engine]],
                 actor_options: dict[str, Any], heartbeat_s: float) -> None:
        super().__init__(fleet, factories, heartbeat_s)
        self.bundle_index = bundle_index
        self.actor_options = actor_options
        self.actor = None
        fleet.add_host(self)

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
        self.stats[self.CALLS] += 1
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
            stats[self.CALLS] += 1
            async for ref in stream:
                self.dispatch(await ref)
            raise EngineError("the actor's event stream ended")
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            if generation == self.generation and self.alive:
                self.died("Ray actor", exc)

    def send_add(self, engine_id: str, stream_id: int, request: EngineRequest) -> None:
        self.stats[self.CALLS] += 1
        self.actor.add.remote(engine_id, stream_id, request)

    async def weights_payload(self, weights: StagedWeights):
        return await self.fleet.weights_ref(weights)

    async def call(self, method: str, *args) -> Any:
        """One awaited actor call; a dead actor is an EngineError."""
        if not self.alive or self.actor is None:
            raise EngineError(f"Ray actor of bundle {self.bundle_index} is not running")
        self.stats[self.CALLS] += 1
        try:
            return await getattr(self.actor, method).remote(*args)
        except _ray_errors() as exc:
            raise EngineError(f"Ray actor of bundle {self.bundle_index}: {type(exc).__name__}") from exc
        except EngineError:
            raise
        except Exception as exc:  # the engine's own error, re-raised by Ray
            raise EngineError(str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__) from exc

    async def _end(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
        self.alive = False
        self._kill_actor()
        await self.fleet.release()


class RayEngine(HostedEngine):
    """An engine protocol proxy for an engine living in a Ray actor."""

    placement = "ray"

    @property
    def actor_pid(self) -> int | None:
        return self.host_pid

    @property
    def node_id(self) -> str | None:
        return self.host.info.get("node_id")
