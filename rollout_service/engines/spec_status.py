"""What an engine reports of its speculation: typed, read by attribute by
GetStatus (`api/convert.py`) and /metrics (`api/http.py`).

Token counts are tokens (floats: a simulated engine counts expectations),
rates are per second.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True, frozen=True)
class DepthBucket:
    """The speculative depth in force for running batches of
    [min_batch, max_batch] sequences, with the tuner's measurements (empty
    for a fixed schedule): tokens/s per running sequence and observation
    count per depth K tried."""

    min_batch: int
    max_batch: int
    k: int
    best_k: int
    tokens_per_s_per_seq: dict[int, float] = field(default_factory=dict)
    observations: dict[int, int] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class TunerState:
    """The depth tuner's view of one engine (`drafter.spec_tuner`)."""

    decisions: int
    explorations: int
    buckets: list[DepthBucket]


@dataclass(slots=True, frozen=True)
class SpecEngineStatus:
    """One engine's speculation: the method ("off": it does not speculate),
    the schedule in force, the draft-weight version serving, tokens drafted
    and accepted, acceptance by draft position, the tuner's state."""

    method: str = "off"
    max_k: int = 0
    schedule: list[tuple[int, int, int]] = field(default_factory=list)
    draft_version: int = 0
    steps: int = 0
    verify_steps: float = 0  # (request, step) pairs that verified drafts
    draft_tokens: float = 0
    accepted_tokens: float = 0
    acceptance_rate: float = 0.0
    # Tokens per verify step of one request: accepted drafts plus the bonus token.
    mean_acceptance_length: float = 1.0
    acceptance_by_position: list[float] = field(default_factory=list)
    tuner: TunerState | None = None

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    @property
    def buckets(self) -> list[DepthBucket]:
        """The depth per running-batch bucket: the tuner's buckets (with its
        measurements) when it tunes, else the fixed schedule's."""
        if self.tuner is not None and self.tuner.buckets:
            return list(self.tuner.buckets)
        return [DepthBucket(lo, hi, k, k) for lo, hi, k in self.schedule]

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable (the `/v1/status` form)."""
        return asdict(self)
