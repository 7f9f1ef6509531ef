"""What the adaptive drafter reports: typed, read by attribute by GetStatus
(`api/convert.py`), /metrics and /v1/status (`api/http.py`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rollout_service.engines.spec_status import SpecEngineStatus


@dataclass(slots=True, frozen=True)
class TrainerStatus:
    """The online drafter trainer: rounds run, the policy version the last
    round trained on, the buffer, and the last round's measurements (None
    before the first round; a modelled trainer measures nothing)."""

    rounds: int = 0
    trained_on_policy_version: int = 0
    buffered_samples: int = 0
    new_samples: int = 0
    modelled: bool = False
    last_loss: float | None = None
    last_agreement_before: float | None = None
    last_agreement_after: float | None = None
    last_round_seconds: float | None = None
    teacher: str = "samples"  # what the drafter learns from (engine.spec.trainer.teacher)
    distilled_from_policy_version: int | None = None  # the policy version the last round fitted ("policy")
    # The last round's expected per-token acceptance of a sampled draft under
    # that policy, on the newest prefixes, before and after ("policy").
    last_acceptance_before: float | None = None
    last_acceptance_after: float | None = None


@dataclass(slots=True, frozen=True)
class SpecStatus:
    """The `spec` section of the service status. `draft_version` is the
    newest drafter serving on any engine (each engine's
    `speculation.draft_version` is the truth); `engines` holds every
    speculating engine's status by engine id."""

    method: str
    tune: bool
    train: bool
    draft_version: int
    engines: dict[str, SpecEngineStatus] = field(default_factory=dict)
    trainer: TrainerStatus | None = None

    @property
    def trained_on_policy_version(self) -> int:
        return self.trainer.trained_on_policy_version if self.trainer is not None else 0

    @property
    def trainer_rounds(self) -> int:
        return self.trainer.rounds if self.trainer is not None else 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable (the `/v1/status` form)."""
        return asdict(self)
