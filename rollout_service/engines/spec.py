"""Speculative decoding as an engine sees it, for callers that still import
this module: the configuration (`spec_config`), the per-step statistics
(`spec_monitor`), what an engine reports (`spec_status`) and the
capability (`speculation`) each live in their own module now."""
from __future__ import annotations

from typing import Any

from rollout_service.engines.spec_config import (  # noqa: F401
    DEFAULT_SCHEDULE,
    METHODS,
    SIBLING_PROPOSER,
    SpecConfig,
    dense_lookup,
    normalize_schedule,
)
from rollout_service.engines.spec_monitor import SpecMonitor, SpecSnapshot, StepObservation  # noqa: F401
from rollout_service.engines.spec_status import DepthBucket, SpecEngineStatus, TunerState  # noqa: F401
from rollout_service.engines.tables import from_table  # noqa: F401


def depth_buckets(engine_status: Any) -> list[dict[str, Any]]:
    """Transitional, for api/ readers of the dict form: the depth per batch
    bucket of an engine's status (a `SpecEngineStatus` or its legacy dict)
    as dicts {"batch": [lo, hi], "k", "best_k", "tokens_per_s_per_seq",
    "observations"}. New code reads `SpecEngineStatus.buckets`."""
    if isinstance(engine_status, SpecEngineStatus):
        return [{"batch": [b.min_batch, b.max_batch], "k": b.k, "best_k": b.best_k,
                 "tokens_per_s_per_seq": {str(k): v for k, v in b.tokens_per_s_per_seq.items()},
                 "observations": {str(k): v for k, v in b.observations.items()}}
                for b in engine_status.buckets]
    buckets = (engine_status.get("tuner") or {}).get("buckets")
    if buckets:
        return buckets
    return [{"batch": [lo, hi], "k": k, "best_k": k, "tokens_per_s_per_seq": {}, "observations": {}}
            for lo, hi, k in engine_status.get("schedule", [])]


def legacy_engine_dict(status: SpecEngineStatus) -> dict[str, Any]:
    """Transitional: a `SpecEngineStatus` in the dict form api/ read before
    it was typed ({"method": "off"} for an engine that does not speculate)."""
    if not status.enabled:
        return {"method": "off"}
    out: dict[str, Any] = {
        "method": status.method, "max_k": status.max_k, "schedule": [list(e) for e in status.schedule],
        "draft_version": status.draft_version, "steps": status.steps, "draft_tokens": status.draft_tokens,
        "accepted_tokens": status.accepted_tokens, "acceptance_rate": status.acceptance_rate,
        "mean_acceptance_length": status.mean_acceptance_length,
        "acceptance_by_position": list(status.acceptance_by_position), "tuner": {},
    }
    if status.tuner is not None:
        out["tuner"] = {"decisions": status.tuner.decisions, "explorations": status.tuner.explorations,
                        "buckets": depth_buckets(status)}
    return out
