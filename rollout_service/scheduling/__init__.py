"""Scheduling policies: where each queued request runs (pure functions of a
load snapshot and the queue; no gRPC, no engine kind)."""
from rollout_service.scheduling.placement import Placement, make_placement, PLACEMENTS
from rollout_service.scheduling.policy import MECHANISMS, PolicySpec, parse_policies, parse_policy

__all__ = ["Placement", "make_placement", "PLACEMENTS", "MECHANISMS", "PolicySpec", "parse_policy", "parse_policies"]
