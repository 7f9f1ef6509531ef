"""Policy names: a placement plus the mechanisms switched on for a run.

A policy is written as `+`-joined parts, e.g. `sticky-rr`,
`rebalance+partial` or `static+rebalance`: at most one placement (from the
placements table; `DEFAULT_PLACEMENT` when none is named) and any of the
mechanisms of the mechanisms table. Both tables are arguments: callers with
their own vocabulary (the load tests' oracle placements, the drafter's
mechanisms) pass theirs; the defaults are `PLACEMENTS` and `MECHANISMS`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from rollout_service.scheduling.placement import PLACEMENTS

DEFAULT_PLACEMENT = "least-assigned"

#: mechanism name -> one-line description: the scheduling side's own.
MECHANISMS: Mapping[str, str] = {
    "rebalance": "length-aware placement and rebalancing with partial-rollout migration",
    "isolate": "rebalancing also moves co-runners off the engines whose longest response may end the step",
    "repack": "rebalancing also regroups in-flight requests onto engines of like predicted lengths",
    "partial": "partial rollout: over-provisioned steps, unfinished groups carried into the next version",
    "affinity": "session affinity: a trajectory's next turn goes to the engine holding its prefix (multi-turn)",
}

@dataclass(slots=True, frozen=True)
class PolicySpec:
    placement: str
    mechanisms: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """Canonical name: the placement, then the mechanisms in the order given."""
        return "+".join((self.placement, *self.mechanisms))

    def has(self, mechanism: str) -> bool:
        return mechanism in self.mechanisms


def _known(placements: Mapping, mechanisms: Mapping) -> str:
    return f"placements: {sorted(placements)}; mechanisms: {sorted(mechanisms)}"


def parse_policy(text: str, placements: Mapping | None = None, mechanisms: Mapping[str, str] | None = None) -> PolicySpec:
    """`"sticky-rr"`, `"rebalance+partial"` -> PolicySpec; unknown, repeated
    or conflicting parts are a ValueError naming the part. `placements` (name
    -> factory) and `mechanisms` (name -> description) are the vocabulary
    (default: `PLACEMENTS` and `MECHANISMS`)."""
    placements = PLACEMENTS if placements is None else placements
    mechanisms = MECHANISMS if mechanisms is None else mechanisms
    parts = [p.strip() for p in text.strip().split("+")]
    if not text.strip() or any(not p for p in parts):
        raise ValueError(f"empty policy name in {text!r}; {_known(placements, mechanisms)}")
    placement = None
    chosen: list[str] = []
    for part in parts:
        if part in placements:
            if placement is not None:
                raise ValueError(f"policy {text!r} names two placements ({placement!r} and {part!r}); pick one")
            placement = part
        elif part in mechanisms:
            if part in chosen:
                raise ValueError(f"policy {text!r} names {part!r} twice")
            chosen.append(part)
        else:
            raise ValueError(f"unknown policy {part!r} in {text!r}; {_known(placements, mechanisms)}")
    for part in ("isolate", "repack"):
        if part in chosen and "rebalance" not in chosen:
            raise ValueError(f"policy {text!r}: {part!r} is part of rebalancing; write 'rebalance+{part}'")
    if placement is None and "rebalance" in chosen:
        placement = "length-aware"  # rebalancing places by predicted length too
    return PolicySpec(placement or DEFAULT_PLACEMENT, tuple(chosen))


def parse_policies(text: str, placements: Mapping | None = None,
                   mechanisms: Mapping[str, str] | None = None) -> list[PolicySpec]:
    """A comma-separated list of policies, each as in `parse_policy`."""
    specs = [parse_policy(p, placements, mechanisms) for p in text.split(",") if p.strip()]
    if not specs:
        raise ValueError(f"no policy given; {_known(PLACEMENTS if placements is None else placements, MECHANISMS if mechanisms is None else mechanisms)}")
    return specs
