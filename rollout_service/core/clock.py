"""Service time, real or virtual.

`Clock.now()` is seconds since the epoch, derived from the running event
loop's monotonic time, so the same core code runs in real time (served over
gRPC) and in virtual time: `VirtualTimeEventLoop` jumps its clock to the next
timer whenever nothing is ready, so an hour of simulated fleet time passes in
seconds of wall time without changing a line of the core or the policies.
"""
from __future__ import annotations

import asyncio
import selectors
import time


class Clock:
    def __init__(self) -> None:
        self._loop_t0: float | None = None
        self._epoch0 = time.time()

    def _loop_time(self) -> float:
        return asyncio.get_running_loop().time()

    def now(self) -> float:
        """Seconds since the epoch on the service's clock."""
        t = self._loop_time()
        if self._loop_t0 is None:
            self._loop_t0 = t
        return self._epoch0 + (t - self._loop_t0)

    def monotonic(self) -> float:
        return self._loop_time()


class _VirtualSelector(selectors.DefaultSelector):
    """Polls for real I/O without blocking; advances virtual time instead of sleeping."""

    def __init__(self, loop: "VirtualTimeEventLoop") -> None:
        super().__init__()
        self._vloop = loop

    def select(self, timeout=None):
        events = super().select(0)
        if events:
            return events
        if timeout is None:
            # Nothing scheduled: only another thread can wake us (to_thread).
            return super().select(None)
        if timeout > 0:
            self._vloop._vtime += timeout
        return []


class VirtualTimeEventLoop(asyncio.SelectorEventLoop):
    """An asyncio loop whose `time()` is virtual and never sleeps for real."""

    def __init__(self) -> None:
        self._vtime = 0.0
        super().__init__(_VirtualSelector(self))

    def time(self) -> float:
        return self._vtime


def run_virtual(coro):
    """Run a coroutine to completion on a fresh virtual-time loop."""
    loop = VirtualTimeEventLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()
