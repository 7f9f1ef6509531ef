"""The adaptive drafter: online drafter training, speculative depth tuning,
and their attachment to a running service (see docs/speculative.md)."""
from rollout_service.drafter.drafter_trainer import DrafterTrainer, TrainerConfig
from rollout_service.drafter.runtime import SpecRuntime, spec_status
from rollout_service.drafter.spec_tuner import DepthTuner, TunerConfig, TunerLoop
from rollout_service.scheduling.policy import MECHANISMS, register_mechanism

for _name, _description in (
    ("spec", "speculative decoding in the tail with the online-trained drafter and the depth tuner"),
    ("spec-frozen", "speculative decoding in the tail with the bundled drafter, never retrained (baseline)"),
    ("spec-ngram", "speculative decoding in the tail with n-gram (prompt lookup) drafts and the depth tuner"),
):
    if _name not in MECHANISMS:
        register_mechanism(_name, _description)

__all__ = ["DepthTuner", "DrafterTrainer", "SpecRuntime", "TrainerConfig", "TunerConfig", "TunerLoop", "spec_status"]
