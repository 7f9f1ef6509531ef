"""The adaptive drafter of a running service: the depth tuner and the online
drafter trainer attached to a running core, per `[engine.spec]`.

    runtime = SpecRuntime(core, cfg.engine.spec)
    await runtime.start()       # after core.start()
    ...
    runtime.status()            # SpecStatus: the `spec` section of GetStatus / metrics
    await runtime.stop()        # before core.stop()
"""
from __future__ import annotations

import logging
from typing import Awaitable, Callable, Mapping, Protocol

from rollout_service.drafter.draft_push import DraftPush
from rollout_service.drafter.drafter_trainer import DrafterTrainer, TrainerConfig, serving_draft_version
from rollout_service.drafter.modelled_trainer import ModelledDrafterTrainer
from rollout_service.drafter.spec_tuner import TunerConfig, TunerLoop
from rollout_service.drafter.status import SpecStatus
from rollout_service.engines.base import Engine
from rollout_service.engines.spec_config import SpecConfig
from rollout_service.engines.spec_status import SpecEngineStatus
from rollout_service.engines.weights import StagedWeights
from rollout_service.lifecycle.types import Sample

log = logging.getLogger(__name__)


class CoreView(Protocol):
    """What the drafter needs of the core (`RolloutCore` has it)."""

    engines: Mapping[str, Engine]
    sample_taps: list[Callable[[Sample], None]]  # called with every finished sample
    weight_taps: list[Callable[[int, StagedWeights | None], Awaitable[None]]]  # awaited once a pushed version serves

    @property
    def policy_version(self) -> int: ...

    async def add_weight_tap(self, tap: Callable[[int, StagedWeights | None], Awaitable[None]]) -> None:
        """Append to weight_taps; call it now if a pushed or restored version serves."""


def spec_status(engines: Mapping[str, Engine]) -> dict[str, SpecEngineStatus]:
    """{engine id: its speculation status} for the engines that speculate."""
    return {eid: e.speculation.status() for eid, e in engines.items() if e.speculation is not None}


class SpecRuntime:
    """Runs the depth tuner and the drafter trainer that `[engine.spec]` asks
    for, reports them, and takes draft weights pushed from outside."""

    def __init__(self, core: CoreView, spec: SpecConfig) -> None:
        self.core = core
        self.spec = spec = SpecConfig.from_dict(spec)
        engines = list(core.engines.values())
        self.tuner = TunerLoop(engines, TunerConfig.from_dict(spec.tuner)) if spec.enabled and spec.tune else None
        self.trainer: DrafterTrainer | ModelledDrafterTrainer | None = None
        if spec.enabled and spec.train:
            trainer_cfg = TrainerConfig.from_dict(spec.trainer)
            if all(e.kind == "sim" for e in engines):
                self.trainer = ModelledDrafterTrainer(engines, trainer_cfg, lambda: core.policy_version)
            else:
                self.trainer = DrafterTrainer(engines, trainer_cfg, spec.draft_model_path(), lambda: core.policy_version,
                                              policy_model_dir=engines[0].describe().model
                                              if trainer_cfg.teacher == "policy" else None)
        self.draft_push = DraftPush(spec, lambda: core.engines.values())

    async def start(self) -> None:
        if self.tuner is not None:
            self.tuner.start()
        if self.trainer is not None and self.trainer.engines:
            self.core.sample_taps.append(self.trainer.observe)
            if isinstance(self.trainer, DrafterTrainer) and self.trainer.policy_model_dir is not None:
                # Called at once when the core already serves pushed weights
                # (restored from a checkpoint, or pushed before the runtime started).
                await self.core.add_weight_tap(self.trainer.policy_updated)
            self.trainer.start()

    async def stop(self) -> None:
        if self.tuner is not None:
            await self.tuner.stop()
        if self.trainer is not None:
            if self.trainer.observe in self.core.sample_taps:
                self.core.sample_taps.remove(self.trainer.observe)
            if isinstance(self.trainer, DrafterTrainer) and self.trainer.policy_updated in self.core.weight_taps:
                self.core.weight_taps.remove(self.trainer.policy_updated)
            await self.trainer.stop()

    def serving_draft_version(self) -> int:
        """The newest drafter serving on any engine (pushed, trained online,
        or applied to an engine directly: the engines keep the version)."""
        return serving_draft_version(self.core.engines.values())

    def status(self) -> SpecStatus:
        """The `spec` section of the service status."""
        return SpecStatus(
            method=self.spec.method,
            tune=self.spec.tune,
            train=self.spec.train,
            draft_version=self.serving_draft_version(),
            engines=spec_status(self.core.engines),
            trainer=self.trainer.status() if self.trainer is not None else None,
        )

    # -- drafter weights pushed by a trainer (PushWeights with target "draft") ------

    def check_draft_weights(self, version: int, manifest: Mapping[str, tuple[str, tuple[int, ...]]]) -> None:
        """Raise WeightsRejected unless `manifest` fits the draft model and
        `version` is newer than the drafter serving now."""
        self.draft_push.check(version, manifest)

    async def push_draft_weights(self, version: int, staged: StagedWeights) -> int:
        """Apply verified draft weights on every draft-model engine."""
        return await self.draft_push.apply(version, staged)
