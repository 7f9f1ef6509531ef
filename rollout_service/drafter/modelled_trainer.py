"""The online drafter trainer of simulated engines: there is no model to
train, so a round is modelled as the drafter catching up with the serving
policy once `min_new_samples` samples of that policy have finished (the
simulated engine's `spec_acceptance_drift` makes a stale drafter pay)."""
from __future__ import annotations

import asyncio
from typing import Callable, Iterable

from rollout_service.drafter.drafter_trainer import TrainerConfig, has_draft_model, serving_draft_version
from rollout_service.drafter.status import TrainerStatus
from rollout_service.engines.base import Engine
from rollout_service.lifecycle.types import Sample


class ModelledDrafterTrainer:
    """`DrafterTrainer`'s interface, for simulated engines."""

    def __init__(self, engines: Iterable[Engine], cfg: TrainerConfig, policy_version: Callable[[], int]) -> None:
        self.engines = [e for e in engines if has_draft_model(e)]
        self.cfg = cfg
        self.policy_version = policy_version
        self.trained_on = 0  # policy version of the last round
        self.rounds = 0
        self.new_samples = 0
        self._pending: asyncio.Task | None = None

    @property
    def draft_version(self) -> int:
        """The newest drafter serving on this trainer's engines."""
        return serving_draft_version(self.engines)

    def observe(self, sample: Sample) -> None:
        version = self.policy_version()
        if sample.versions.max_version != version:
            return
        self.new_samples += 1
        if version > self.trained_on and self.new_samples >= self.cfg.min_new_samples and self._pending is None:
            self._pending = asyncio.create_task(self._round(version))

    async def _round(self, version: int) -> None:
        try:
            draft_version = self.draft_version + 1
            self.trained_on, self.new_samples = version, 0
            self.rounds += 1
            await asyncio.gather(*(e.speculation.update_draft_weights(draft_version, None) for e in self.engines))
        finally:
            self._pending = None

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        if self._pending is not None:
            self._pending.cancel()

    def status(self) -> TrainerStatus:
        return TrainerStatus(rounds=self.rounds, trained_on_policy_version=self.trained_on,
                             new_samples=self.new_samples, modelled=True)
