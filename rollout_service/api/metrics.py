"""Prometheus metrics: one collector that reads the core's typed status (and
the speculative decoding runtime's) at scrape time.

Each app gets its own `CollectorRegistry` (`metrics_registry`), never the
process-global one, so two services in one process (tests) do not mix.
Units are in the names: `_seconds`, `_tokens`, `_requests`; counters are
exposed as `<name>_total`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from rollout_service.core.rollout import RolloutCore
from rollout_service.core.status import CoreStatus
from rollout_service.drafter.status import SpecStatus

if TYPE_CHECKING:
    from rollout_service.drafter.runtime import SpecRuntime

# HELP of the core's counters (others get a generic line).
COUNTER_HELP = {
    "samples_submitted": "Samples submitted (num_samples of every group created).",
    "samples_completed": "Samples finished and delivered.",
    "tokens_generated": "Response tokens generated.",
    "groups_submitted": "Groups created by Submit.",
    "groups_completed": "Groups whose every sample was delivered.",
    "groups_aborted": "Groups aborted by a client.",
    "groups_dropped": "Groups dropped by the service (e.g. past max_version_lag).",
    "samples_dropped": "Unfinished samples delivered as aborted when their group was dropped.",
    "weight_updates": "Policy weight updates applied.",
    "tokens_carried": "Tokens of unfinished requests carried over a weight update.",
    "tokens_discarded": "Tokens of unfinished requests discarded by a weight update (restarted).",
    "tokens_reprefilled": "Tokens prefilled again to resume a preempted or migrated request.",
    "engine_restarts": "Engines restarted after a failure.",
    "migrations": "Running requests moved from one engine to another.",
    "requests_requeued": "Requests put back in the queue (engine failure, preemption).",
    "turns_completed": "Generated turns of multi-turn trajectories finished.",
    "turn_events": "Turn events delivered to trainers (trainer-driven trajectories waiting for an observation).",
    "observations_appended": "Observations appended to trajectories (from Continue or an environment).",
    "observation_tokens": "Tokens of the observations appended to trajectories.",
    "observations_too_long": "Environment observations that did not fit their trajectory (it ended at its length limit).",
    "trajectory_moves": "Trajectory turns placed on another engine than the one holding their prefix.",
    "session_moves": "Requests with a session key placed on another engine than the session's last one.",
    "environment_errors": "Environment calls that failed (the trajectory ends, aborted).",
}
HISTOGRAM_HELP = {
    "sample_latency_seconds": "Seconds from a sample being queued to it finishing.",
    "weight_update_seconds": "Seconds to apply a policy weight update on every engine.",
}
# Per-engine gauges: (series, HELP, how to read it from an EngineStatus).
ENGINE_GAUGES = (
    ("running", "Requests running on the engine.", lambda e: e.load.running),
    ("waiting", "Requests waiting in the engine's own queue.", lambda e: e.load.waiting),
    ("assigned", "Requests the service has placed on the engine.", lambda e: e.assigned),
    ("kv_usage", "Fraction of the engine's KV cache in use, in [0, 1].", lambda e: e.load.kv_usage),
    ("kv_used_tokens", "Tokens held in the engine's KV cache.", lambda e: e.load.kv_used_tokens),
    ("kv_capacity_tokens", "Tokens the engine's KV cache can hold.", lambda e: e.load.kv_capacity_tokens),
    ("tokens_per_s", "Tokens the engine generates per second (recent).", lambda e: e.load.tokens_per_s),
    ("policy_version", "The policy version the engine's weights are at.", lambda e: e.load.policy_version),
)


class RolloutCollector(Collector):
    """The service's metrics, computed from `core.status()`, `core.histograms`
    and `spec_runtime.status()` when scraped."""

    def __init__(self, core: RolloutCore, spec_runtime: "SpecRuntime | None" = None) -> None:
        self.core = core
        self.spec_runtime = spec_runtime

    def collect(self) -> Iterator[Metric]:
        st = self.core.status()
        yield from core_families(st)
        for name, hist in self.core.histograms.items():
            yield HistogramMetricFamily(f"rollout_{name}", HISTOGRAM_HELP.get(name, name.replace("_", " ") + "."),
                                        buckets=hist.cumulative(), sum_value=hist.sum)
        if self.spec_runtime is not None:
            yield from spec_families(self.spec_runtime.status())


def metrics_registry(core: RolloutCore, spec_runtime: "SpecRuntime | None" = None) -> CollectorRegistry:
    """A registry of its own holding the service's collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RolloutCollector(core, spec_runtime))
    return registry


def core_families(st: CoreStatus) -> Iterator[Metric]:
    """The core's gauges and counters, and one gauge family per engine series."""
    for name, help_, value in (
        ("policy_version", "The policy version serving (the last weights applied).", st.policy_version),
        ("queued_requests", "Requests (samples) queued in the service, not yet on an engine.", st.queued_requests),
        ("running_requests", "Requests (samples) running on an engine.", st.running_requests),
        ("open_groups", "Groups submitted and not yet complete.", st.open_groups),
        ("retained_samples", "Delivered samples kept for consumers that have not acknowledged them.",
         st.retained_samples),
        ("last_cursor", "Cursor of the last sample delivered.", st.last_cursor),
        ("uptime_seconds", "Seconds since the service started.", st.uptime_s),
        ("placement_last_failed", "1 when the last dispatch to an engine failed, until one succeeds.",
         1 if st.placement_error else 0),
    ):
        yield GaugeMetricFamily(f"rollout_{name}", help_, value=value)
    yield CounterMetricFamily("rollout_placement_errors", "Dispatches of a request to an engine that failed.",
                              value=st.placement_errors)
    counters = st.counters
    for name in sorted(n for n in counters if not n.startswith("samples_lag_") and n != "placement_errors"):
        yield CounterMetricFamily(f"rollout_{name}", COUNTER_HELP.get(name, name.replace("_", " ").capitalize() + "."),
                                  value=counters[name])
    lag = CounterMetricFamily("rollout_samples_by_lag", "Samples delivered, by how many policy versions the oldest "
                              "of their tokens lags the serving version.", labels=["lag"])
    for name in sorted(n for n in counters if n.startswith("samples_lag_")):
        lag.add_metric([name.removeprefix("samples_lag_")], counters[name])
    yield lag
    for series, help_, read in ENGINE_GAUGES:
        family = GaugeMetricFamily(f"rollout_engine_{series}", help_, labels=["engine"])
        for e in st.engines:
            family.add_metric([e.load.engine_id], read(e))
        yield family
    for series, help_ in (
        ("prefix_cache_queried_tokens", "Prompt tokens looked up in the engine's prefix cache at admission."),
        ("prefix_cache_hit_tokens", "Prompt tokens found in the engine's prefix cache (prefill skipped)."),
    ):
        family = CounterMetricFamily(f"rollout_engine_{series}", help_, labels=["engine"])
        for e in st.engines:
            family.add_metric([e.load.engine_id], getattr(e.load, series))
        yield family
    up = GaugeMetricFamily("rollout_engine_state", "1 for the engine's state (starting, ready, updating, dead).",
                           labels=["engine", "state"])
    for e in st.engines:
        up.add_metric([e.load.engine_id, e.load.state], 1)
    yield up


# -- speculative decoding ---------------------------------------------------------

def spec_families(spec: SpecStatus) -> Iterator[Metric]:
    """Speculative decoding per engine: drafted/accepted tokens, acceptance
    length and by position, the depth in force and the tuner's measurements."""
    engines = {eid: e for eid, e in spec.engines.items() if e.enabled}
    for name, key, kind, help_ in (
        ("spec_draft_tokens", "draft_tokens", CounterMetricFamily, "Tokens proposed by the drafter."),
        ("spec_accepted_tokens", "accepted_tokens", CounterMetricFamily, "Proposed tokens the target accepted."),
        ("spec_mean_acceptance_length", "mean_acceptance_length", GaugeMetricFamily,
         "Tokens per verify step, the bonus token included."),
        ("spec_draft_version", "draft_version", GaugeMetricFamily, "The draft weights' version serving."),
    ):
        family = kind(f"rollout_{name}", help_, labels=["engine"])
        for eid, e in engines.items():
            family.add_metric([eid], getattr(e, key))
        yield family
    by_position = GaugeMetricFamily("rollout_spec_acceptance_by_position",
                                    "Fraction of drafts accepted at each position.", labels=["engine", "position"])
    depth = GaugeMetricFamily("rollout_spec_depth", "Speculative tokens per step in force, per running-batch bucket.",
                              labels=["engine", "batch"])
    rate = GaugeMetricFamily("rollout_spec_tokens_per_s_per_seq", "The depth tuner's measured accepted tokens per "
                             "second per sequence, per batch bucket and depth k.", labels=["engine", "batch", "k"])
    for eid, e in engines.items():
        for i, v in enumerate(e.acceptance_by_position):
            by_position.add_metric([eid, str(i + 1)], v)
        for b in e.buckets:
            batch = f"{b.min_batch}-{b.max_batch}"
            depth.add_metric([eid, batch], b.k)
            for k, v in b.tokens_per_s_per_seq.items():
                rate.add_metric([eid, batch, str(k)], v)
    yield from (by_position, depth, rate)
