"""Translation between the service's own types and rollout.v1 messages.
The one place where both meet."""
from __future__ import annotations

from rollout_proto import rollout_pb2 as pb
from rollout_service.core.status import CoreStatus, EngineStatus
from rollout_service.lifecycle.types import Sample
from rollout_service.engines.weights import TensorSpec
from rollout_service.engines.spec import depth_buckets


def sample_to_pb(s: Sample) -> pb.Sample:
    return pb.Sample(
        sample_id=s.sample_id,
        group_id=s.group_id,
        index=s.index,
        prompt_id=s.prompt_id,
        prompt_token_ids=s.prompt_token_ids,
        response_token_ids=s.response_token_ids,
        logprobs=s.logprobs,
        versions=[pb.VersionSegment(version=v, start=a, length=n) for v, a, n in s.versions.segments],
        min_version=s.versions.min_version,
        max_version=s.versions.max_version,
        finish_reason=int(s.finish_reason),
        engines=s.engines,
        num_migrations=s.num_migrations,
        timing=pb.Timing(queued_at=s.queued_at, first_token_at=s.first_token_at, finished_at=s.finished_at),
        spec=pb.SpecStats(draft_tokens=s.draft_tokens, accepted_tokens=s.accepted_tokens),
        response_text=s.response_text,
        metadata=s.metadata,
        batch_id=s.batch_id,
        drop_reason=s.drop_reason,
    )


def tensor_specs(header: pb.WeightsHeader) -> list[TensorSpec]:
    return [TensorSpec(t.name, t.dtype, tuple(t.shape), t.byte_length, t.sha256) for t in header.tensors]


def engine_status(e: EngineStatus) -> pb.EngineStatus:
    load = e.load
    return pb.EngineStatus(
        engine_id=load.engine_id,
        kind=load.kind,
        state=load.state,
        running=load.running,
        waiting=load.waiting,
        kv_usage=load.kv_usage,
        tokens_per_s=load.tokens_per_s,
        policy_version=load.policy_version,
        assigned=e.assigned,
    )


def status_to_pb(st: CoreStatus, model: str, spec: dict | None = None) -> pb.StatusResponse:
    return pb.StatusResponse(
        policy_version=st.policy_version,
        engines=[engine_status(e) for e in st.engines],
        queued_requests=st.queued_requests,
        running_requests=st.running_requests,
        open_groups=st.open_groups,
        last_cursor=st.last_cursor,
        retained_samples=st.retained_samples,
        scheduler=st.scheduler,
        counters={k: float(v) for k, v in st.counters.items()},
        uptime_s=st.uptime_s,
        model=model,
        spec=spec_status_to_pb(spec) if spec else None,
    )


def spec_status_to_pb(st: dict) -> pb.SpecStatus:
    """`SpecRuntime.status()` -> SpecStatus (engines that speculate only)."""
    trainer = st.get("trainer") or {}
    engines = []
    for eid, e in sorted(st.get("engines", {}).items()):
        if e.get("method", "off") == "off":
            continue
        tuner = e.get("tuner") or {}
        buckets = [
            pb.SpecDepthBucket(
                min_batch=b["batch"][0], max_batch=b["batch"][1], num_speculative_tokens=b["k"], best_k=b["best_k"],
                tokens_per_s_per_seq={int(k): v for k, v in b["tokens_per_s_per_seq"].items()},
                observations={int(k): v for k, v in b["observations"].items()},
            )
            for b in depth_buckets(e)
        ]
        engines.append(pb.SpecEngineStatus(
            engine_id=eid, method=e["method"], max_k=e.get("max_k", 0), draft_version=e.get("draft_version", 0),
            steps=e.get("steps", 0), draft_tokens=round(e.get("draft_tokens", 0)),
            accepted_tokens=round(e.get("accepted_tokens", 0)),  # the simulated engine counts expectations
            mean_acceptance_length=e.get("mean_acceptance_length", 1.0),
            acceptance_by_position=e.get("acceptance_by_position", []), buckets=buckets,
            tuner_decisions=tuner.get("decisions", 0), tuner_explorations=tuner.get("explorations", 0),
        ))
    return pb.SpecStatus(
        method=st.get("method", ""), tune=bool(st.get("tune")), train=bool(st.get("train")),
        draft_version=max([st.get("draft_version", 0), trainer.get("draft_version", 0)] + [e.draft_version for e in engines]),
        trained_on_policy_version=trainer.get("trained_on_policy_version", 0),
        trainer_rounds=trainer.get("rounds", 0), engines=engines,
    )
