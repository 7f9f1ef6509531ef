"""Carry-over of unfinished requests across a weight update (pure planning).

Modes (per run):
  continue      in-flight requests keep generating under the new weights
                (their earlier tokens keep their old version tags)
  pause-resume  they are aborted with their partial responses before the
                weights change and resumed by re-prefill under the new ones
  restart       their tokens are discarded and they are generated again

`max_version_lag` bounds staleness: after the update to version v, any
unfinished request holding a token older than v - max_version_lag is
restarted (or its whole group dropped, per `stale_action`). Carried work is
queued ahead of new work.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rollout_service.lifecycle.types import Group, Request

CARRY_MODES = ("continue", "pause-resume", "restart")
STALE_ACTIONS = ("restart", "drop")


@dataclass(slots=True)
class CarryOverConfig:
    mode: str = "continue"
    max_version_lag: int = -1  # -1: unbounded
    stale_action: str = "restart"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.mode not in CARRY_MODES:
            raise ValueError(f"carry_over.mode must be one of {CARRY_MODES}, got {self.mode!r}")
        if self.stale_action not in STALE_ACTIONS:
            raise ValueError(f"carry_over.stale_action must be one of {STALE_ACTIONS}, got {self.stale_action!r}")
        if self.max_version_lag < -1:
            raise ValueError(f"carry_over.max_version_lag must be -1 (unbounded) or >= 0, got {self.max_version_lag}")


@dataclass(slots=True)
class CarryPlan:
    preempt: list[Request] = field(default_factory=list)  # abort with partial before the update; re-queued (front) after it
    restart: list[Request] = field(default_factory=list)  # tokens discarded, re-queued (front)
    drop: list[Group] = field(default_factory=list)       # groups given up (reported, not retried)


def plan_carry_over(cfg: CarryOverConfig, unfinished: list[Request], running: set[str], new_version: int) -> CarryPlan:
    """Decide, for the unfinished requests at an update to `new_version`,
    which are paused (and resumed after it), restarted or dropped. `running` holds the ids
    of those currently on an engine."""
    plan = CarryPlan()
    oldest_allowed = new_version - cfg.max_version_lag if cfg.max_version_lag >= 0 else None
    dropped: set[str] = set()
    for req in unfinished:
        is_running = req.request_id in running
        # A running request may hold tokens its engine has not reported yet:
        # they are at least as old as the version it started this segment at.
        oldest = req.versions.min_version if req.token_ids else None
        if is_running:
            oldest = req.segment_version if oldest is None else min(oldest, req.segment_version)
        stale = oldest_allowed is not None and oldest is not None and oldest < oldest_allowed
        if stale and cfg.stale_action == "drop":
            if req.group.group_id not in dropped:
                dropped.add(req.group.group_id)
                plan.drop.append(req.group)
            continue
        if cfg.mode == "restart" or stale:
            if is_running:
                plan.preempt.append(req)
            if req.token_ids or is_running:
                plan.restart.append(req)
        elif cfg.mode == "pause-resume" and is_running:
            plan.preempt.append(req)
    return plan
