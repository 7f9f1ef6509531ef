"""Trainer-side client of the rollout service.

    from trainer_client import RolloutClient, PromptGroup      # asyncio
    from trainer_client import SyncRolloutClient               # plain Python
"""
from trainer_client.client import RolloutClient, ServiceRestarted
from trainer_client.steps import StepRollout
from trainer_client.sync import SyncRolloutClient
from trainer_client.types import (
    CompletedSample,
    EngineStatus,
    MultiTurn,
    PromptGroup,
    PushResult,
    ServiceStatus,
    SpecDepthBucket,
    SpecEngineStatus,
    SpecStatus,
    Turn,
)

__all__ = ["RolloutClient", "ServiceRestarted", "StepRollout", "SyncRolloutClient", "CompletedSample", "PromptGroup", "PushResult",
           "ServiceStatus", "EngineStatus", "SpecStatus", "SpecEngineStatus", "SpecDepthBucket",
           "MultiTurn", "Turn"]
