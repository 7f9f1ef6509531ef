"""The policy vocabulary for speculation: mechanism names and the
`[engine.spec]` table each asks for (the load tests' policies use them)."""
from __future__ import annotations

from typing import Any, Iterable, Mapping

#: Policy mechanisms -> `[engine.spec]`.
MECHANISM_SPECS: dict[str, dict[str, Any]] = {
    "spec": {"method": "draft_model", "tune": True, "train": True},
    "spec-frozen": {"method": "draft_model", "tune": True, "train": False},
    "spec-fixed": {"method": "draft_model", "tune": False, "train": False},
    "spec-ngram": {"method": "ngram", "tune": True},
    "spec-siblings": {"method": "siblings", "tune": True},
    "spec-eagle": {"method": "eagle", "tune": True, "train": False},
}

#: Their names as the policy vocabulary takes them (name -> description);
#: `scheduling.policy.parse_policy(text, mechanisms={**MECHANISMS, **SPEC_MECHANISMS})`.
SPEC_MECHANISMS: dict[str, str] = {
    "spec": "speculative decoding in the tail with the online-trained drafter and the depth tuner",
    "spec-frozen": "speculative decoding in the tail with the bundled drafter, never retrained (baseline)",
    "spec-fixed": "the bundled drafter, never retrained, on the fixed depth schedule (no depth tuner)",
    "spec-ngram": "speculative decoding in the tail with n-gram (prompt lookup) drafts and the depth tuner",
    "spec-siblings": "speculative decoding in the tail with drafts from the group's sibling responses and the depth tuner",
    "spec-eagle": "speculative decoding in the tail with an EAGLE head (model = a `rollout-service build-eagle` "
                  "directory), never retrained, and the depth tuner",
}


def mechanism_spec(mechanisms: Iterable[str], base: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
    """The `[engine.spec]` table a policy's mechanisms ask for (on top of
    `base`), and the mechanisms that are not about speculation."""
    spec = dict(base or {})
    rest = []
    chosen = [m for m in mechanisms if m in MECHANISM_SPECS]
    if len(chosen) > 1:
        raise ValueError(f"policy names two speculation mechanisms {chosen}; pick one")
    for m in mechanisms:
        if m in MECHANISM_SPECS:
            spec.update(MECHANISM_SPECS[m])
        else:
            rest.append(m)
    return spec, rest
