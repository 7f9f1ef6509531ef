"""The core's status as typed values (GetStatus, /v1/status and /metrics
read these; nothing reads a status dict by key)."""
from __future__ import annotations

from dataclasses import dataclass, field

from rollout_service.engines.types import EngineLoad


@dataclass(slots=True, frozen=True)
class EngineStatus:
    """One engine as the core sees it: its own load snapshot and how many
    requests the core has placed on it."""

    load: EngineLoad
    assigned: int


@dataclass(slots=True, frozen=True)
class CoreStatus:
    """A snapshot of the core. Counts are requests (samples) or groups as
    named; `uptime_s` is seconds on the service clock. `placement_error` is
    the last placement error while placement keeps failing ("" once a
    placement succeeds); `placement_errors` counts every failed placement."""

    policy_version: int
    engines: list[EngineStatus]
    queued_requests: int
    running_requests: int
    open_groups: int
    last_cursor: int
    retained_samples: int
    scheduler: str
    uptime_s: float
    counters: dict[str, int] = field(default_factory=dict)
    placement_error: str = ""
    placement_errors: int = 0
    journal_error: str = ""  # why state_dir's journal cannot be written ("" while it can)
    paused: str = ""  # the fleet's pause in force (core/pause.py: "keep", "abort", "wait"); "" when not paused

    @property
    def prefix_cache_queried_tokens(self) -> int:
        """Prompt tokens the engines' prefix caches were asked for (cumulative,
        summed over the engines; an engine restart starts its count again)."""
        return sum(e.load.prefix_cache_queried_tokens for e in self.engines)

    @property
    def prefix_cache_hit_tokens(self) -> int:
        """Of those, tokens found cached (prefill the engines skipped)."""
        return sum(e.load.prefix_cache_hit_tokens for e in self.engines)
