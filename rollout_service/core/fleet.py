"""The engines of the fleet, their health watch and their restarts.

`Fleet` owns the engines and which of them are restarting. It restarts an
engine that died: what the core had placed there is evacuated (continued
elsewhere with its partial response), the engine is started again and
brought to the serving weights before it takes requests.
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Awaitable, Callable, Iterable

from rollout_service.core.tasks import TaskSet
from rollout_service.engines.base import Engine
from rollout_service.engines.types import EngineLoad

log = logging.getLogger(__name__)


class Fleet:
    def __init__(
        self,
        engines: Iterable[Engine],
        counters: Counter[str],
        tasks: TaskSet,
        evacuate: Callable[[str], Awaitable[None]],
        bring_up: Callable[[Engine], Awaitable[None]],
        on_change: Callable[[], None],
    ) -> None:
        self.engines: dict[str, Engine] = {e.engine_id: e for e in engines}
        self._counters = counters
        self._tasks = tasks
        self._evacuate = evacuate  # continue what runs on an engine elsewhere
        self._bring_up = bring_up  # give a restarted engine the serving weights
        self._on_change = on_change  # an engine came back: placement may run
        self._restarting: set[str] = set()

    def is_restarting(self, engine_id: str) -> bool:
        return engine_id in self._restarting

    @property
    def restarting(self) -> frozenset[str]:
        return frozenset(self._restarting)

    def placeable_loads(self) -> list[EngineLoad]:
        """Load snapshots of the engines placement may use (not restarting)."""
        return [e.load() for eid, e in self.engines.items() if eid not in self._restarting]

    def live(self) -> list[Engine]:
        """Engines that are up: neither restarting nor dead."""
        return [e for eid, e in self.engines.items() if eid not in self._restarting and e.load().state != "dead"]

    async def start(self) -> None:
        await asyncio.gather(*(e.start() for e in self.engines.values()))

    async def close(self) -> None:
        await asyncio.gather(*(e.close() for e in self.engines.values()), return_exceptions=True)

    async def watch(self, interval_s: float) -> None:
        """Restart engines that died, every `interval_s` seconds. Their
        requests were already re-queued with their partial responses by the
        runners that saw them fail."""
        while True:
            await asyncio.sleep(interval_s)
            for engine_id, engine in self.engines.items():
                if engine_id not in self._restarting and engine.load().state == "dead":
                    self._restarting.add(engine_id)
                    self._tasks.spawn(self._restart(engine), name=f"restart-{engine_id}")

    async def _restart(self, engine: Engine) -> None:
        log.warning("engine %s died; restarting it", engine.engine_id)
        self._counters["engine_restarts"] += 1
        try:
            # Anything still placed there is lost to that process: continue it elsewhere.
            await self._evacuate(engine.engine_id)
            await engine.start()
            await self._bring_up(engine)
            log.info("engine %s is back", engine.engine_id)
        except Exception:
            log.exception("restart of %s failed; will retry", engine.engine_id)
        finally:
            self._restarting.discard(engine.engine_id)
            self._on_change()
