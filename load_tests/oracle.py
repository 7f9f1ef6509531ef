"""A clairvoyant reference for the length-aware policies (load tests only).

`length-oracle` is the `length-aware` placement (and, with `+rebalance`, the
rebalancer) with a predictor that reads every sample's true length from the
simulated engine's hint (`sim.target_lengths`). No service can run it: it
shows how much of the gap to the lower bound is scheduling and how much is
not knowing the lengths in advance.
"""
from __future__ import annotations

from rollout_service.core.types import Request
from rollout_service.scheduling.length_aware import LengthAwarePlacement
from rollout_service.scheduling.length_predictor import LengthEstimate, LengthPredictor
from rollout_service.scheduling.placement import PLACEMENTS

NAME = "length-oracle"


def true_length(req: Request) -> int | None:
    """The response length the simulated engine will generate, if hinted."""
    hint = req.group.spec.metadata.get("sim.target_lengths")
    if not hint:
        return None
    return min(int(hint.split(",")[req.index]), req.group.spec.sampling.max_tokens)


class OracleLengthPredictor(LengthPredictor):
    """Predicts exactly: the hinted length minus what was generated."""

    def predict(self, req: Request) -> LengthEstimate:
        total = true_length(req)
        if total is None:
            return super().predict(req)
        left = float(max(0, total - len(req.token_ids)))
        return LengthEstimate(left, left)


def _oracle_placement() -> LengthAwarePlacement:
    placement = LengthAwarePlacement(OracleLengthPredictor())
    placement.name = NAME
    return placement


PLACEMENTS.setdefault(NAME, _oracle_placement)
