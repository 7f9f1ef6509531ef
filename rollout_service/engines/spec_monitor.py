"""Per-step statistics of an engine's speculation.

`SpecMonitor` turns an engine's per-step statistics into the observations
the depth tuner learns from (batch size, K in force, step seconds, tokens)
and into the engine's `SpecEngineStatus`.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

from rollout_service.engines.spec_config import SpecConfig, dense_lookup, normalize_schedule
from rollout_service.engines.spec_status import SpecEngineStatus, TunerState


@dataclass(slots=True)
class StepObservation:
    """One engine step as the depth tuner sees it."""

    batch: int  # sequences that produced tokens in the step
    k: int  # speculative depth in force for that batch size
    seconds: float  # step duration (engine-core clock)
    tokens: int  # tokens emitted by the step (accepted drafts + one per sequence)


@dataclass(slots=True)
class SpecSnapshot:
    """A monitor's totals and the observations since the last snapshot: what
    an engine in another process (a Ray actor) sends its proxy."""

    observations: list[StepObservation]
    steps: int
    spec_steps: float
    draft_tokens: float
    accepted_tokens: float
    accepted_per_pos: list[float] = field(default_factory=list)
    drafted_per_pos: list[float] = field(default_factory=list)
    draft_version: int = 0
    schedule: list[tuple[int, int, int]] = field(default_factory=list)


class SpecMonitor:
    """Per-engine speculative statistics, fed once per engine step.

    Keeps totals (draft tokens proposed and accepted, acceptance by draft
    position), the schedule in force, the draft-weight version serving, and
    a bounded queue of `StepObservation`s for the depth tuner."""

    def __init__(self, cfg: SpecConfig, max_seqs: int) -> None:
        self.cfg = cfg
        self.max_seqs = max_seqs
        self.schedule = normalize_schedule(cfg.schedule, max_seqs, cfg.num_speculative_tokens) if cfg.enabled else []
        self.lookup = dense_lookup(self.schedule, max_seqs) if cfg.enabled else [0] * (max_seqs + 1)
        self.draft_version = 0
        self.steps = 0
        self.spec_steps = 0  # (request, step) pairs that verified drafts
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.accepted_per_pos = [0] * max(1, cfg.num_speculative_tokens)
        self.drafted_per_pos = [0] * max(1, cfg.num_speculative_tokens)
        self.observations: deque[StepObservation] = deque(maxlen=8192)
        self.tuner_state: TunerState | None = None
        # {K: largest batch with a captured CUDA graph at depth K}
        # (spec_config.graph_depths); None: the engine runs eagerly, any K.
        self.graph_depths: dict[int, int] | None = None

    def set_schedule(self, schedule: Sequence[Sequence[int]]) -> None:
        self.schedule = normalize_schedule(schedule, self.max_seqs, self.cfg.num_speculative_tokens)
        self.lookup = dense_lookup(self.schedule, self.max_seqs)

    def k_for(self, batch: int) -> int:
        return self.lookup[min(max(batch, 1), self.max_seqs)]

    def record(self, batch: int, seconds: float | None, tokens: int, spec_stats: Any) -> None:
        """One step: `batch` sequences emitted `tokens` tokens in `seconds`
        (None when unknown, e.g. a step of prefills only); `spec_stats` is
        vLLM's SpecDecodingStats of the step or None."""
        self.steps += 1
        if spec_stats is not None:
            self.spec_steps += spec_stats.num_drafts
            self.draft_tokens += spec_stats.num_draft_tokens
            self.accepted_tokens += spec_stats.num_accepted_tokens
            for i, n in enumerate(spec_stats.num_accepted_tokens_per_pos[: len(self.accepted_per_pos)]):
                self.accepted_per_pos[i] += n
            for i, n in enumerate(spec_stats.num_draft_tokens_per_pos[: len(self.drafted_per_pos)]):
                self.drafted_per_pos[i] += n
        if seconds is not None and batch > 0 and seconds > 0:
            self.observations.append(StepObservation(batch, self.k_for(batch), seconds, tokens))

    def record_expected(self, batch: int, k: int, seconds: float, tokens: int, verify_steps: float,
                        profile: Sequence[float]) -> None:
        """A simulated run in expectation: `verify_steps` (request, step)
        pairs at depth k, draft token i accepted with probability profile[i]."""
        self.steps += 1
        if k > 0:
            self.spec_steps += verify_steps
            self.draft_tokens += verify_steps * k
            self.accepted_tokens += verify_steps * sum(profile)
            for i, q in enumerate(profile[: len(self.accepted_per_pos)]):
                self.accepted_per_pos[i] += verify_steps * q
                self.drafted_per_pos[i] += verify_steps
        if seconds > 0 and batch > 0:
            self.observations.append(StepObservation(batch, k, seconds, tokens))

    def drain(self) -> list[StepObservation]:
        """The observations since the last drain (the tuner consumes them)."""
        out = list(self.observations)
        self.observations.clear()
        return out

    def to_snapshot(self) -> SpecSnapshot:
        """Totals plus the observations since the last snapshot (drained)."""
        return SpecSnapshot(self.drain(), self.steps, self.spec_steps, self.draft_tokens, self.accepted_tokens,
                            list(self.accepted_per_pos), list(self.drafted_per_pos), self.draft_version,
                            [tuple(e) for e in self.schedule])

    def apply_snapshot(self, snapshot: SpecSnapshot) -> None:
        """Mirror another monitor's `to_snapshot()` (its observations queue
        up here for the tuner)."""
        self.observations.extend(snapshot.observations)
        self.steps = snapshot.steps
        self.spec_steps = snapshot.spec_steps
        self.draft_tokens = snapshot.draft_tokens
        self.accepted_tokens = snapshot.accepted_tokens
        self.accepted_per_pos = list(snapshot.accepted_per_pos)
        self.drafted_per_pos = list(snapshot.drafted_per_pos)
        self.draft_version = snapshot.draft_version
        if snapshot.schedule and [tuple(e) for e in self.schedule] != snapshot.schedule:
            self.set_schedule(snapshot.schedule)  # e.g. a restarted engine back on the configured one

    def status(self) -> SpecEngineStatus:
        """The engine's speculation as reported in GetStatus and /metrics."""
        if not self.cfg.enabled:
            return SpecEngineStatus()
        per_pos = [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)]
        return SpecEngineStatus(
            method=self.cfg.method,
            max_k=self.cfg.num_speculative_tokens,
            schedule=[tuple(e) for e in self.schedule],
            draft_version=self.draft_version,
            steps=self.steps,
            verify_steps=self.spec_steps,
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens,
            acceptance_rate=self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            mean_acceptance_length=1.0 + self.accepted_tokens / self.spec_steps if self.spec_steps else 1.0,
            acceptance_by_position=per_pos,
            tuner=self.tuner_state,
        )
