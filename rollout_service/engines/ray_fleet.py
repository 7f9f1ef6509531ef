"""Engines as Ray actors: the fleet on a Ray cluster (`engine.placement_backend = "ray"`).

    server process                               Ray actor process (one per bundle)
    ------------------------------------         ------------------------------------
    RolloutCore -> RayEngine (one per engine)    EngineHost: 1+ real engines
                   RayHost (one per actor)  <--  events(): one stream of EventBatches
                   RayFleet (placement group)       (load snapshots + token deltas)

This module builds the fleet: one placement group, one bundle per actor
(CPU here; `GPU` = the engine's tensor-parallel size on a GPU cluster),
spread over the cluster's nodes, and the weights' object-store cache. The
actor side is `ray_host`, the server-side proxies `ray_proxy`. The core,
the scheduling policies, migration, partial rollout and speculative
decoding do not know the difference.

Weights. A push is put once into Ray's object store (`RayFleet.weights_ref`,
in the server); every actor receives the same ObjectRef, so the trainer's
bytes cross the network once per node, not once per engine. Each actor
stages the tensors as one safetensors file in its node's /dev/shm and
applies it with its engine's own `update_weights`.

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
import logging
import weakref
from collections import Counter
from typing import Any, Callable

from rollout_service.engines.base import Engine
from rollout_service.engines.ray_proxy import RayEngine, RayHost
from rollout_service.engines.weights import StagedWeights

log = logging.getLogger(__name__)


class RayFleet:
    """The fleet's placement group and actors, the pushed weights in the
    object store, and Ray's hop counters."""

    def __init__(self, bundles: list[dict[str, float]], strategy: str, started_ray: bool) -> None:
        from ray.util.placement_group import placement_group

        self.pg = placement_group(bundles, strategy=strategy)
        self.bundles = bundles
        self.strategy = strategy
        self._ready: asyncio.Future | None = None
        self.started_ray = started_ray
        self.hosts: list[RayHost] = []
        self.stats: Counter[str] = Counter()  # ray_calls, ray_stream_items, ray_events, ray_actor_deaths
        self._open = 0
        self._weight_refs: "weakref.WeakKeyDictionary[StagedWeights, asyncio.Future]" = weakref.WeakKeyDictionary()

    def add_host(self, host: RayHost) -> None:
        self.hosts.append(host)
        self._open += 1

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

    async def weights_ref(self, weights: StagedWeights):
        """The pushed weights in Ray's object store: put once per push, shared
        by every actor of the fleet (and dropped when the push is)."""
        fut = self._weight_refs.get(weights)
        if fut is None:
            import numpy as np
            import ray

            fut = self._weight_refs[weights] = asyncio.get_running_loop().create_future()
            payload = [(t.name, t.dtype, tuple(t.shape), np.frombuffer(t.data, dtype=np.uint8)) for t in weights.tensors]
            try:
                fut.set_result(await asyncio.to_thread(ray.put, payload))
            except BaseException as exc:
                del self._weight_refs[weights]
                fut.set_exception(exc)
                fut.exception()  # retrieved here; raised below
                raise
        return await asyncio.shield(fut)

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
