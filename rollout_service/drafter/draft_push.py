"""Draft weights pushed by a trainer (PushWeights with target "draft"):
checked against the draft model before any byte is applied, then applied
on every draft-model engine. No pause: verified speculation is lossless
whatever the drafter."""
from __future__ import annotations

from typing import Callable, Iterable, Mapping

from rollout_service.drafter.drafter_trainer import has_draft_model, serving_draft_version
from rollout_service.engines.base import Engine, WeightsRejected
from rollout_service.engines.spec_config import SpecConfig
from rollout_service.engines.weights import StagedWeights, checkpoint_manifest


class DraftPush:
    """Checks and applies draft-weight pushes for the engines `engines()` returns."""

    def __init__(self, spec: SpecConfig, engines: Callable[[], Iterable[Engine]]) -> None:
        self.spec = spec
        self.engines = engines
        self._manifest: dict[str, tuple[str, tuple[int, ...]]] | None = None

    def check(self, version: int, manifest: Mapping[str, tuple[str, tuple[int, ...]]]) -> None:
        """Raise WeightsRejected unless `manifest` {name: (dtype, shape)} fits
        the draft model and `version` is newer than the drafter serving now."""
        if not self.spec.has_model:
            raise WeightsRejected(f"header.target: the engines have no draft model (engine.spec.method is {self.spec.method!r})")
        current = serving_draft_version(self.engines())
        if version <= current:
            raise WeightsRejected(f"header.version: must be greater than the serving draft version {current}, got {version}")
        if self._manifest is None:
            self._manifest = checkpoint_manifest(self.spec.draft_model_path())
        for name, (dtype, shape) in manifest.items():
            known = self._manifest.get(name)
            if known is None:
                raise WeightsRejected(f"header.tensors: unknown tensor name {name!r} for the draft model")
            if tuple(shape) != known[1]:
                raise WeightsRejected(f"header.tensors: {name!r} has shape {list(shape)}, the draft model needs {list(known[1])}")

    async def apply(self, version: int, staged: StagedWeights) -> int:
        """Apply verified draft weights on every draft-model engine; returns
        the version now serving."""
        self.check(version, {})
        for engine in [e for e in self.engines() if has_draft_model(e)]:
            await engine.speculation.update_draft_weights(version, staged)
        return version
