"""The adaptive drafter of a running service: the depth tuner and the online
drafter trainer attached to a `RolloutCore`, per `[engine.spec]`.

    runtime = SpecRuntime(core, SpecConfig.from_dict(cfg.engine.spec))
    await runtime.start()       # after core.start()
    ...
    runtime.status()            # the `spec` section of GetStatus / metrics
    await runtime.stop()        # before core.stop()
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Iterable, Mapping

from rollout_service.engines.weights import StagedWeights
from rollout_service.drafter.drafter_trainer import DrafterTrainer, TrainerConfig, has_draft_model
from rollout_service.drafter.spec_tuner import TunerConfig, TunerLoop
from rollout_service.engines.base import WeightsRejected
from rollout_service.engines.spec import SpecConfig

log = logging.getLogger(__name__)

#: Policy mechanisms (`rollout_service.scheduling.policy`) -> `[engine.spec]`.
MECHANISM_SPECS: dict[str, dict[str, Any]] = {
    "spec": {"method": "draft_model", "tune": True, "train": True},
    "spec-frozen": {"method": "draft_model", "tune": True, "train": False},
    "spec-ngram": {"method": "ngram", "tune": True},
}


def mechanism_spec(mechanisms: Iterable[str], base: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
    """The `[engine.spec]` table a policy's mechanisms ask for (on top of
    `base`), and the mechanisms that are not about speculation."""
    spec = dict(base or {})
    rest = []
    chosen = [m for m in mechanisms if m in MECHANISM_SPECS]
    if len(chosen) > 1:
        raise ValueError(f"policy names two speculation mechanisms {chosen}; pick one")
    for m in mechanisms:
        if m in MECHANISM_SPECS:
            spec.update(MECHANISM_SPECS[m])
        else:
            rest.append(m)
    return spec, rest


class ModelledDrafterTrainer:
    """The online trainer for simulated engines: no model to train, so a
    round is modelled as the drafter catching up with the serving policy
    once `min_new_samples` samples of that policy have finished (the
    simulated engine's `spec_acceptance_drift` makes a stale drafter pay)."""

    def __init__(self, engines: Iterable[Any], cfg: TrainerConfig, policy_version) -> None:
        self.engines = [e for e in engines if has_draft_model(e)]
        self.cfg = cfg
        self.policy_version = policy_version
        self.draft_version = 0
        self.trained_on = 0  # policy version of the last round
        self.new_samples = 0
        self._pending: asyncio.Task | None = None

    def observe(self, sample) -> None:
        version = self.policy_version()
        if sample.versions.max_version != version:
            return
        self.new_samples += 1
        if version > self.trained_on and self.new_samples >= self.cfg.min_new_samples and self._pending is None:
            self._pending = asyncio.create_task(self._round(version))

    async def _round(self, version: int) -> None:
        try:
            self.draft_version += 1
            self.trained_on, self.new_samples = version, 0
            await asyncio.gather(*(e.update_draft_weights(self.draft_version, None) for e in self.engines))
        finally:
            self._pending = None

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        if self._pending is not None:
            self._pending.cancel()

    def status(self) -> dict[str, Any]:
        return {"draft_version": self.draft_version, "trained_on_policy_version": self.trained_on, "modelled": True}


def spec_status(engines: Mapping[str, Any]) -> dict[str, Any]:
    """{engine id: that engine's `spec` section} for the engines that
    report one (schedule in force, draft version, acceptance by position,
    the tuner's arms)."""
    return {eid: e.spec_status() for eid, e in engines.items() if hasattr(e, "spec_status")}


class SpecRuntime:
    def __init__(self, core: Any, spec: SpecConfig) -> None:
        self.core = core
        self.spec = spec
        engines = list(core.engines.values())
        self.tuner = TunerLoop(engines, TunerConfig.from_dict(spec.tuner)) if spec.enabled and spec.tune else None
        self.trainer: DrafterTrainer | ModelledDrafterTrainer | None = None
        if spec.enabled and spec.train:
            trainer_cfg = TrainerConfig.from_dict(spec.trainer)
            if all(getattr(e, "kind", "") == "sim" for e in engines):
                self.trainer = ModelledDrafterTrainer(engines, trainer_cfg, lambda: core.policy_version)
            else:
                self.trainer = DrafterTrainer(engines, trainer_cfg, spec.draft_model_path(), lambda: core.policy_version)
        self.draft_version = 0  # of pushes from outside (PushWeights target "draft")
        self._manifest: dict | None = None

    async def start(self) -> None:
        if self.tuner is not None:
            self.tuner.start()
        if self.trainer is not None and self.trainer.engines:
            self.core.sample_taps.append(self.trainer.observe)
            self.trainer.start()

    async def stop(self) -> None:
        if self.tuner is not None:
            await self.tuner.stop()
        if self.trainer is not None:
            if self.trainer.observe in self.core.sample_taps:
                self.core.sample_taps.remove(self.trainer.observe)
            await self.trainer.stop()

    def status(self) -> dict[str, Any]:
        """The `spec` section of the service status (JSON-serialisable)."""
        out: dict[str, Any] = {
            "method": self.spec.method,
            "tune": self.spec.tune,
            "train": self.spec.train,
            "draft_version": self.draft_version,
            "engines": spec_status(self.core.engines),
        }
        if self.trainer is not None:
            out["trainer"] = self.trainer.status()
        return out

    # -- drafter weights pushed by a trainer (PushWeights with target "draft") ------

    def serving_draft_version(self) -> int:
        """The newest draft version anywhere: pushed through here, trained
        online, or applied to an engine directly."""
        engines = [e.spec_status().get("draft_version", 0) for e in self.core.engines.values() if hasattr(e, "spec_status")]
        return max([self.draft_version, self.trainer.draft_version if self.trainer else 0] + engines)

    def check_draft_weights(self, version: int, manifest: Mapping[str, tuple[str, tuple[int, ...]]]) -> None:
        """Raise WeightsRejected unless `manifest` fits the draft model and
        `version` is newer than the drafter serving now."""
        if self.spec.method != "draft_model":
            raise WeightsRejected(f"header.target: the engines have no draft model (engine.spec.method is {self.spec.method!r})")
        current = self.serving_draft_version()
        if version <= current:
            raise WeightsRejected(f"header.version: must be greater than the serving draft version {current}, got {version}")
        if self._manifest is None:
            from rollout_service.engines.weights import checkpoint_manifest

            self._manifest = checkpoint_manifest(self.spec.draft_model_path())
        for name, (dtype, shape) in manifest.items():
            known = self._manifest.get(name)
            if known is None:
                raise WeightsRejected(f"header.tensors: unknown tensor name {name!r} for the draft model")
            if tuple(shape) != known[1]:
                raise WeightsRejected(f"header.tensors: {name!r} has shape {list(shape)}, the draft model needs {list(known[1])}")

    async def push_draft_weights(self, version: int, staged: StagedWeights) -> int:
        """Apply verified draft weights on every draft-model engine (no
        pause: verified speculation is lossless whatever the drafter)."""
        self.check_draft_weights(version, {})
        for engine in [e for e in self.core.engines.values() if has_draft_model(e)]:
            await engine.update_draft_weights(version, staged)
        self.draft_version = version
        if self.trainer is not None:
            self.trainer.draft_version = max(self.trainer.draft_version, version)
        return version
