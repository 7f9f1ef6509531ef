"""What a checkpoint holds: the core's state as plain values, taken by
`RolloutCore.snapshot()` and put back by `RolloutCore.restore_snapshot()`."""
from __future__ import annotations

from dataclasses import dataclass, field

from rollout_service.core.delivery import Consumer, Entry
from rollout_service.engines.weights import StagedWeights
from rollout_service.lifecycle.types import Group


@dataclass(slots=True)
class CoreSnapshot:
    """The core between two runs. `groups` are the open groups (each request
    with its partial response; finished ones already delivered), served again
    by re-prefill; `entries` the delivery log's retained samples."""

    policy_version: int
    groups: list[Group] = field(default_factory=list)
    done_group_ids: list[str] = field(default_factory=list)  # Submit stays idempotent
    entries: list[Entry] = field(default_factory=list)
    last_cursor: int = 0
    consumers: list[Consumer] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    weights: StagedWeights | None = None  # of `policy_version` (None: the model's own)
    pause_mode: str | None = None  # the fleet's pause in force (core/pause.py); None: not paused
