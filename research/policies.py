"""The load tests' policy vocabulary: the service's placements and
mechanisms, plus the clairvoyant reference placements (research/oracle.py)
and the drafter's speculation mechanisms."""
from __future__ import annotations

from research.oracle import ORACLE_PLACEMENTS
from rollout_service.drafter.mechanisms import SPEC_MECHANISMS
from rollout_service.scheduling import placement as _placement
from rollout_service.scheduling import policy as _policy
from rollout_service.scheduling.placement import Placement
from rollout_service.scheduling.policy import PolicySpec

PLACEMENTS = {**_placement.PLACEMENTS, **ORACLE_PLACEMENTS}
MECHANISMS = {**_policy.MECHANISMS, **SPEC_MECHANISMS}


def parse_policy(text: str) -> PolicySpec:
    return _policy.parse_policy(text, PLACEMENTS, MECHANISMS)


def parse_policies(text: str) -> list[PolicySpec]:
    return _policy.parse_policies(text, PLACEMENTS, MECHANISMS)


def make_placement(name: str) -> Placement:
    return _placement.make_placement(name, extra=ORACLE_PLACEMENTS)
