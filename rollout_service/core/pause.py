"""Pausing the whole fleet (vLLM's `/pause`, `/resume`, `/is_paused`).

While paused nothing is placed on an engine: submissions queue, and
`resume` places them. How a pause treats what is in flight (`mode`, as
vLLM's `pause_generation`):

  keep   running requests stop with what they generated and wait at the
         head of the queue: the carry-over's pause-resume plan
         (partial/carry_over.py), the same one a weight push applies. On
         `resume` they continue by re-prefill under the weights serving
         then, every token tagged with the version that sampled it.
  abort  every open group ends at once, its unfinished samples aborted
         with what they generated: a request/response caller gets its
         answer (finish reason "abort"), a stream consumer the samples
         (drop reason "paused").
  wait   nothing new starts; returns once what runs on the engines has
         finished (bounded by `timeout_s`; the fleet stays paused).
"""
from __future__ import annotations

import asyncio
from typing import Callable, Protocol

from rollout_service.core.weight_sync import WorkOps
from rollout_service.lifecycle.types import CoreError, Group
from rollout_service.partial.carry_over import CarryOverConfig, plan_carry_over

PAUSE_MODES = ("abort", "wait", "keep")
DRAIN_POLL_S = 0.02  # how often `wait` looks whether the engines have drained


class PauseOps(WorkOps, Protocol):
    """What a pause does to the core's requests."""

    def open_groups(self) -> list[Group]: ...
    def running_count(self) -> int: ...


class FleetPause:
    def __init__(self, work: PauseOps, wake: Callable[[], None], version: Callable[[], int]) -> None:
        self._work = work
        self._wake = wake
        self._version = version
        self.mode: str | None = None  # the mode of the pause in force; None: not paused
        self.on_change: Callable[[str | None], object] | None = None  # called with the new mode (the journal)

    @property
    def paused(self) -> bool:
        return self.mode is not None

    @property
    def holds(self) -> bool:
        """Whether running requests are held (a `keep` pause): nothing may start."""
        return self.mode == "keep"

    async def pause(self, mode: str, timeout_s: float) -> None:
        """Pause placement and treat what is in flight per `mode` (see the
        module docstring). CoreError "invalid" for an unknown mode; for
        `wait`, CoreError "deadline" when requests still run after
        `timeout_s` seconds (the fleet stays paused)."""
        if mode not in PAUSE_MODES:
            raise CoreError("invalid", f"mode: must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        # A keep after a wait still holds what runs; nothing weakens a pause in force.
        if self.mode != "keep":
            self.mode = mode
            if self.on_change is not None:
                self.on_change(mode)
        work = self._work
        if mode == "keep":
            plan = plan_carry_over(CarryOverConfig(mode="pause-resume"), work.unfinished(), work.running_ids(),
                                   self._version())
            for req in plan.preempt:
                await work.preempt(req)
            work.requeue_front(plan.preempt)
        elif mode == "abort":
            for group in work.open_groups():
                await work.give_up(group, "paused")
        else:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while work.running_count():
                if loop.time() >= deadline:
                    raise CoreError("deadline", f"mode=wait: {work.running_count()} requests still running after "
                                                f"{timeout_s:g} s; the fleet stays paused")
                await asyncio.sleep(DRAIN_POLL_S)

    def resume(self) -> None:
        """Place again: held and queued requests start (held ones by re-prefill)."""
        if self.mode is not None and self.on_change is not None:
            self.on_change(None)
        self.mode = None
        self._wake()
