"""A clairvoyant reference for the length-aware policies (load tests only).

`length-oracle` is the `length-aware` placement (and, with `+rebalance`, the
rebalancer) with a predictor that reads every sample's true length from the
simulated engine's hint (`sim.target_lengths`). No service can run it: it
shows how much of the gap to the lower bound is scheduling and how much is
not knowing the lengths in advance.

`length-oracle-after-N` (N in `REVEAL_AFTER`) learns a response's true
length only once it has generated N tokens, and predicts like the service
before that: what a perfect detector reading a response's first N tokens
would buy (a bound on what early-token features can do).

`length-noisy-S` (S in `NOISE`) knows every length at placement up to a
log-normal factor exp(S * z), z ~ N(0, 1) drawn once per request: a
predictor of a given accuracy, for asking how good a placement-time
predictor must be before a policy pays (`-packed`: with packing).
"""
from __future__ import annotations

import math
import random

from rollout_service.lifecycle.types import Request
from rollout_service.scheduling.length_aware import LengthAwarePlacement, LengthPackedPlacement
from rollout_service.scheduling.length_predictor import LengthEstimate, LengthPredictor

NAME = "length-oracle"


def true_length(req: Request) -> int | None:
    """The response length the simulated engine will generate, if hinted."""
    hint = req.group.spec.metadata.get("sim.target_lengths")
    if not hint:
        return None
    return min(int(hint.split(",")[req.index]), req.group.spec.sampling.max_tokens)


REVEAL_AFTER = (16, 64, 256)


class OracleLengthPredictor(LengthPredictor):
    """Predicts exactly (the hinted length minus what was generated) once a
    request has generated `reveal_after` tokens; before, like the service."""

    def __init__(self, reveal_after: int = 0) -> None:
        super().__init__()
        self.reveal_after = reveal_after

    def informed(self, req: Request) -> bool:
        return (true_length(req) is not None and len(req.token_ids) >= self.reveal_after) or super().informed(req)

    def predict(self, req: Request) -> LengthEstimate:
        total = true_length(req)
        if total is None or len(req.token_ids) < self.reveal_after:
            return super().predict(req)
        left = float(max(0, total - len(req.token_ids)))
        return LengthEstimate(left, left)


NOISE = (0.25, 0.5, 1.0)


class NoisyLengthPredictor(LengthPredictor):
    """The true length times exp(sigma * z), z ~ N(0, 1) fixed per request."""

    def __init__(self, sigma: float) -> None:
        super().__init__()
        self.sigma = sigma

    def informed(self, req: Request) -> bool:
        return true_length(req) is not None or super().informed(req)

    def predict(self, req: Request) -> LengthEstimate:
        total = true_length(req)
        if total is None:
            return super().predict(req)
        z = random.Random(req.request_id).gauss(0.0, 1.0)
        guess = min(total * math.exp(self.sigma * z), req.group.spec.sampling.max_tokens)
        left = float(max(1.0, guess - len(req.token_ids)))
        return LengthEstimate(left, left)


def _oracle_placements() -> dict:
    """name -> factory of every clairvoyant reference placement (module docstring)."""
    table = {
        NAME: lambda: LengthAwarePlacement(OracleLengthPredictor(), name=NAME),
        f"{NAME}-packed": lambda: LengthPackedPlacement(OracleLengthPredictor(), name=f"{NAME}-packed"),
    }
    for n in REVEAL_AFTER:
        table[f"{NAME}-after-{n}"] = lambda n=n: LengthAwarePlacement(OracleLengthPredictor(n), name=f"{NAME}-after-{n}")
    for sigma in NOISE:
        table[f"length-noisy-{sigma}"] = lambda s=sigma: LengthAwarePlacement(NoisyLengthPredictor(s),
                                                                           name=f"length-noisy-{s}")
        table[f"length-noisy-{sigma}-packed"] = lambda s=sigma: LengthPackedPlacement(
            NoisyLengthPredictor(s), name=f"length-noisy-{s}-packed")
    return table


#: Passed to `make_placement(name, extra=ORACLE_PLACEMENTS)` and the policy parser (research/policies.py).
ORACLE_PLACEMENTS = _oracle_placements()
