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


def _named(placement: LengthAwarePlacement, name: str) -> LengthAwarePlacement:
    placement.name = name
    return placement


def _packed(placement: LengthAwarePlacement, name: str) -> LengthAwarePlacement:
    placement.pack = True
    return _named(placement, name)


def _oracle_placement(reveal_after: int = 0):
    def make() -> LengthAwarePlacement:
        placement = LengthAwarePlacement(OracleLengthPredictor(reveal_after))
        placement.name = f"{NAME}-after-{reveal_after}" if reveal_after else NAME
        return placement
    return make


PLACEMENTS.setdefault(NAME, _oracle_placement())
PLACEMENTS.setdefault(f"{NAME}-packed", lambda: _packed(LengthAwarePlacement(OracleLengthPredictor()), f"{NAME}-packed"))
for _n in REVEAL_AFTER:
    PLACEMENTS.setdefault(f"{NAME}-after-{_n}", _oracle_placement(_n))
for _sigma in NOISE:
    PLACEMENTS.setdefault(f"length-noisy-{_sigma}", lambda s=_sigma: _named(LengthAwarePlacement(NoisyLengthPredictor(s)),
                                                                     f"length-noisy-{s}"))
    PLACEMENTS.setdefault(f"length-noisy-{_sigma}-packed",
                          lambda s=_sigma: _packed(LengthAwarePlacement(NoisyLengthPredictor(s)), f"length-noisy-{s}-packed"))
