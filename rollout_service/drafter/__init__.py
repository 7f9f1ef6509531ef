"""The adaptive drafter: online drafter training, speculative depth tuning,
and their attachment to a running service (see docs/speculative.md)."""
from rollout_service.drafter.drafter_trainer import DrafterTrainer, TrainerConfig
from rollout_service.drafter.runtime import SpecRuntime, spec_status
from rollout_service.drafter.spec_tuner import DepthTuner, TunerConfig, TunerLoop
from rollout_service.drafter.status import SpecStatus, TrainerStatus

__all__ = ["DepthTuner", "DrafterTrainer", "SpecRuntime", "SpecStatus", "TrainerConfig", "TrainerStatus",
           "TunerConfig", "TunerLoop", "spec_status"]
