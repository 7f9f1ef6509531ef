"""The speculation capability of an engine, declared: `engine.speculation`
is a `Speculation` when the engine speculates, None when it does not.

    spec = engine.speculation
    if spec is not None:
        spec.monitor.drain()              # step observations for the depth tuner
        await spec.set_schedule([(1, 4, 4), (5, 64, 0)])
        if spec.has_draft_model:
            await spec.update_draft_weights(version, staged)
        spec.draft_version                # the drafter serving on this engine

The engine's `draft_version` is the one source of truth of which drafter
serves; the drafter runtime and trainer read it from here.
"""
from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

from rollout_service.engines.spec_config import SpecConfig
from rollout_service.engines.spec_monitor import SpecMonitor
from rollout_service.engines.spec_status import SpecEngineStatus
from rollout_service.engines.weights import StagedWeights


@runtime_checkable
class Speculation(Protocol):
    """What every speculating engine offers (vLLM, simulated, Ray proxy)."""

    monitor: SpecMonitor

    @property
    def config(self) -> SpecConfig:
        """The engine's `[engine.spec]` configuration."""

    @property
    def has_draft_model(self) -> bool:
        """Whether the engine drafts with a model (method "draft_model" or
        "eagle"), i.e. whether `update_draft_weights` applies."""

    @property
    def draft_version(self) -> int:
        """The draft-weight version serving (0: the model directory's)."""

    def status(self) -> SpecEngineStatus:
        """Method, schedule in force, draft version, acceptance, tuner state."""

    async def set_schedule(self, schedule: Sequence[Sequence[int]]) -> None:
        """Replace the depth per running-batch size ([(first, last, K), ...]);
        it takes effect between two engine steps."""

    async def update_draft_weights(self, version: int, weights: StagedWeights | None) -> None:
        """Apply draft-model weights between two steps. Lossless whatever the
        weights: drafts are verified against the target. `version` numbers
        the drafter, not the policy; it becomes `draft_version`. Raises
        EngineError on an engine without a draft model."""


class MonitoredSpeculation:
    """The part every engine kind shares: configuration, status and draft
    version read from the engine's `SpecMonitor`. Engines subclass it and
    implement `set_schedule` and `update_draft_weights`."""

    def __init__(self, monitor: SpecMonitor) -> None:
        self.monitor = monitor

    @property
    def config(self) -> SpecConfig:
        return self.monitor.cfg

    @property
    def has_draft_model(self) -> bool:
        return self.monitor.cfg.has_model

    @property
    def draft_version(self) -> int:
        return self.monitor.draft_version

    def status(self) -> SpecEngineStatus:
        return self.monitor.status()
