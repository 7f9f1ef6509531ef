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


#: Work handed to another thread (`asyncio.to_thread`) takes no virtual
#: time: the loop waits for it for real, polling this often, before it
#: jumps its clock to the next timer...
_THREAD_POLL_S = 0.05
#: ... for at most this long per job (a thread that itself waits for one of
#: the loop's timers must not stop virtual time forever).
_THREAD_GRACE_S = 30.0


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
        loop = self._vloop
        if loop._in_executor and time.monotonic() < loop._executor_deadline:
            # A thread is working: jumping the clock now would charge the
            # next timer's wait to it, as long as the machine takes.
            return super().select(_THREAD_POLL_S)
        if timeout > 0:
            loop._vtime += timeout
        return []


class VirtualTimeEventLoop(asyncio.SelectorEventLoop):
    """An asyncio loop whose `time()` is virtual and never sleeps for real."""

    def __init__(self) -> None:
        self._vtime = 0.0
        self._in_executor = 0  # jobs running in other threads (run_in_executor, to_thread)
        self._executor_deadline = 0.0  # real time until which the clock waits for them
        super().__init__(_VirtualSelector(self))

    def run_in_executor(self, executor, func, *args):
        fut = super().run_in_executor(executor, func, *args)
        self._in_executor += 1
        self._executor_deadline = time.monotonic() + _THREAD_GRACE_S
        fut.add_done_callback(self._executor_done)
        return fut

    def _executor_done(self, _fut) -> None:
        self._in_executor -= 1

    def time(self) -> float:
        return self._vtime


def run_virtual(coro):
    """Run a coroutine to completion on a fresh virtual-time loop."""
    loop = VirtualTimeEventLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()
