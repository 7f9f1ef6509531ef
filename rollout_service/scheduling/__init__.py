"""Scheduling policies: where each queued request runs (pure functions of a
load snapshot and the queue; no gRPC, no engine kind)."""
from rollout_service.scheduling.placement import Placement, make_placement, PLACEMENTS

__all__ = ["Placement", "make_placement", "PLACEMENTS"]
