"""Small asyncio helpers shared by the core, the engines and the drafter."""
from __future__ import annotations

import asyncio


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel a background task and wait until it has stopped (its
    cancellation is not an error; anything else it raised is)."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
