"""Policy names: a placement plus the mechanisms switched on for a run.

A policy is written as `+`-joined parts, e.g. `sticky-rr`,
`rebalance+partial+spec` or `static+rebalance`: at most one placement (from
`PLACEMENTS`; `DEFAULT_PLACEMENT` when none is named) and any of the
registered mechanisms (`MECHANISMS`: rebalancing, partial rollout, the
drafter...), each of which registers its name here when it is built.
"""
from __future__ import annotations

from dataclasses import dataclass

from rollout_service.scheduling.placement import PLACEMENTS

DEFAULT_PLACEMENT = "least-assigned"

#: mechanism name -> one-line description; filled in by the modules that implement them.
MECHANISMS: dict[str, str] = {}


def register_mechanism(name: str, description: str) -> None:
    """Make `name` valid in policy names (e.g. "rebalance")."""
    if name in PLACEMENTS:
        raise ValueError(f"{name!r} is already a placement policy")
    MECHANISMS[name] = description


register_mechanism("rebalance", "length-aware placement and rebalancing with partial-rollout migration")
register_mechanism("isolate", "rebalancing also moves co-runners off the engines whose longest response may end the step")
register_mechanism("repack", "rebalancing also regroups in-flight requests onto engines of like predicted lengths")
register_mechanism("partial", "partial rollout: over-provisioned steps, unfinished groups carried into the next version")


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


def _known() -> str:
    mech = sorted(MECHANISMS) or "none registered yet"
    return f"placements: {sorted(PLACEMENTS)}; mechanisms: {mech}"


def parse_policy(text: str) -> PolicySpec:
    """`"sticky-rr"`, `"rebalance+partial"` -> PolicySpec; unknown, repeated
    or conflicting parts are a ValueError naming the part."""
    parts = [p.strip() for p in text.strip().split("+")]
    if not text.strip() or any(not p for p in parts):
        raise ValueError(f"empty policy name in {text!r}; {_known()}")
    placement = None
    mechanisms: list[str] = []
    for part in parts:
        if part in PLACEMENTS:
            if placement is not None:
                raise ValueError(f"policy {text!r} names two placements ({placement!r} and {part!r}); pick one")
            placement = part
        elif part in MECHANISMS:
            if part in mechanisms:
                raise ValueError(f"policy {text!r} names {part!r} twice")
            mechanisms.append(part)
        else:
            raise ValueError(f"unknown policy {part!r} in {text!r}; {_known()}")
    for part in ("isolate", "repack"):
        if part in mechanisms and "rebalance" not in mechanisms:
            raise ValueError(f"policy {text!r}: {part!r} is part of rebalancing; write 'rebalance+{part}'")
    if placement is None and "rebalance" in mechanisms:
        placement = "length-aware"  # rebalancing places by predicted length too
    return PolicySpec(placement or DEFAULT_PLACEMENT, tuple(mechanisms))


def parse_policies(text: str) -> list[PolicySpec]:
    """A comma-separated list of policies, each as in `parse_policy`."""
    specs = [parse_policy(p) for p in text.split(",") if p.strip()]
    if not specs:
        raise ValueError(f"no policy given; {_known()}")
    return specs
