"""The background tasks a core owns: referenced while they run (asyncio
keeps only weak references) and cancelled and awaited on stop."""
from __future__ import annotations

import asyncio
import logging
from typing import Coroutine

from rollout_service.aio import cancel_and_wait

log = logging.getLogger(__name__)


class TaskSet:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine, name: str | None = None) -> asyncio.Task:
        """Run `coro` in the background; an exception it raises is logged."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %s failed", task.get_name(), exc_info=task.exception())

    def __len__(self) -> int:
        return len(self._tasks)

    async def cancel_all(self) -> None:
        """Cancel every task and wait until each has stopped."""
        while self._tasks:
            await asyncio.gather(*(cancel_and_wait(t) for t in list(self._tasks)), return_exceptions=True)
