"""Translation between the service's own types and rollout.v1 messages.
The one place where both meet."""
from __future__ import annotations

from rollout_proto import rollout_pb2 as pb
from rollout_service.core.status import CoreStatus, EngineStatus
from rollout_service.lifecycle.types import Sample, Turn
from rollout_service.lifecycle.versions import NO_VERSION, VersionTags
from rollout_service.engines.types import FinishReason
from rollout_service.engines.weights import TensorSpec
from rollout_service.drafter.status import SpecStatus


def sample_to_pb(s: Sample) -> pb.Sample:
    return WIRE_SAMPLES.complete(WIRE_SAMPLES.body(s), s)


class WireSamples:
    """A sample's rollout.v1 form, which is also its journal record (core's
    `SampleCodec`): the journal writes the body's bytes and keeps the body;
    a stream sends a copy of it with the fields the sample shares with its
    group added (so a journaled sample is converted once)."""

    @staticmethod
    def body(s: Sample) -> pb.Sample:
        """The message without sample_id, prompt_id, prompt_token_ids, metadata and batch_id."""
        return pb.Sample(
            group_id=s.group_id,
            index=s.index,
            response_token_ids=s.response_token_ids,
            logprobs=s.logprobs,
            # Observation tokens carry no policy version: their segments are left out.
            versions=[pb.VersionSegment(version=v, start=a, length=n) for v, a, n in s.versions.segments
                      if v != NO_VERSION],
            min_version=s.versions.min_version,
            max_version=s.versions.max_version,
            finish_reason=int(s.finish_reason),
            engines=s.engines,
            num_migrations=s.num_migrations,
            timing=pb.Timing(queued_at=s.queued_at, first_token_at=s.first_token_at, finished_at=s.finished_at),
            spec=pb.SpecStats(draft_tokens=s.draft_tokens, accepted_tokens=s.accepted_tokens),
            response_text=s.response_text,
            drop_reason=s.drop_reason,
            turns=[turn_to_pb(t) for t in s.turns],
            loss_mask=s.loss_mask,
        )

    @staticmethod
    def complete(m: pb.Sample, s: Sample) -> pb.Sample:
        """`m` (a body) with the group's fields added, in place."""
        m.sample_id, m.prompt_id, m.batch_id = s.sample_id, s.prompt_id, s.batch_id
        m.prompt_token_ids.extend(s.prompt_token_ids)
        m.metadata.update(s.metadata)
        return m

    @staticmethod
    def serialize(m: pb.Sample) -> bytes:
        return m.SerializeToString()

    @staticmethod
    def decode(data: bytes, prompt_token_ids: list[int], prompt_id: str, metadata: dict[str, str], batch_id: str,
               awaiting_observation: bool) -> Sample:
        """The sample of a body's bytes, with its group's fields."""
        m = pb.Sample.FromString(data)
        response = list(m.response_token_ids)
        return Sample(
            sample_id=f"{m.group_id}/{m.index}", group_id=m.group_id, index=m.index, prompt_id=prompt_id,
            prompt_token_ids=prompt_token_ids, response_token_ids=response, logprobs=list(m.logprobs),
            versions=_versions_from(m.versions, len(response)), finish_reason=FinishReason(m.finish_reason),
            engines=list(m.engines), num_migrations=m.num_migrations, queued_at=m.timing.queued_at,
            first_token_at=m.timing.first_token_at, finished_at=m.timing.finished_at,
            draft_tokens=m.spec.draft_tokens, accepted_tokens=m.spec.accepted_tokens, metadata=dict(metadata),
            batch_id=batch_id, response_text=m.response_text, drop_reason=m.drop_reason,
            turns=[turn_from_pb(t) for t in m.turns], loss_mask=list(m.loss_mask),
            awaiting_observation=awaiting_observation,
        )


WIRE_SAMPLES = WireSamples()


def _versions_from(segments, n: int) -> VersionTags:
    """Version tags from the wire's segments, the gaps (observation tokens) and
    what follows the last segment up to `n` tokens filled with NO_VERSION."""
    tags = VersionTags()
    for seg in segments:
        tags.append(NO_VERSION, seg.start - len(tags))
        tags.append(seg.version, seg.length)
    tags.append(NO_VERSION, n - len(tags))
    return tags


_TURN_KINDS = {"generated": pb.Turn.KIND_GENERATED, "observation": pb.Turn.KIND_OBSERVATION}


def turn_to_pb(t: Turn) -> pb.Turn:
    return pb.Turn(
        kind=_TURN_KINDS[t.kind], start=t.start, length=t.length, engine_id=t.engine_id,
        finish_reason=int(t.finish_reason) if t.finish_reason is not None else 0,
        started_at=t.started_at, finished_at=t.finished_at, tool_seconds=t.tool_s,
    )


_TURN_KINDS_BACK = {v: k for k, v in _TURN_KINDS.items()}


def turn_from_pb(t: pb.Turn) -> Turn:
    return Turn(kind=_TURN_KINDS_BACK[t.kind], start=t.start, length=t.length, engine_id=t.engine_id,
                finish_reason=FinishReason(t.finish_reason) if t.finish_reason else None, started_at=t.started_at,
                finished_at=t.finished_at, tool_s=t.tool_seconds)


def tensor_specs(header: pb.WeightsHeader) -> list[TensorSpec]:
    algo = header.checksum_algo or "sha256"  # empty: the senders that predate the field
    return [TensorSpec(t.name, t.dtype, tuple(t.shape), t.byte_length, t.sha256, t.digest, algo) for t in header.tensors]


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


def status_to_pb(st: CoreStatus, model: str, spec: SpecStatus | None = None) -> pb.StatusResponse:
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
        spec=spec_status_to_pb(spec) if spec is not None else None,
        journal_error=st.journal_error,
        paused=st.paused,
    )


def spec_status_to_pb(st: SpecStatus) -> pb.SpecStatus:
    """The drafter runtime's status -> SpecStatus (engines that speculate only)."""
    engines = []
    for eid, e in sorted(st.engines.items()):
        if not e.enabled:
            continue
        buckets = [
            pb.SpecDepthBucket(
                min_batch=b.min_batch, max_batch=b.max_batch, num_speculative_tokens=b.k, best_k=b.best_k,
                tokens_per_s_per_seq={int(k): v for k, v in b.tokens_per_s_per_seq.items()},
                observations={int(k): v for k, v in b.observations.items()},
            )
            for b in e.buckets
        ]
        engines.append(pb.SpecEngineStatus(
            engine_id=eid, method=e.method, max_k=e.max_k, draft_version=e.draft_version,
            steps=e.steps, draft_tokens=round(e.draft_tokens),
            accepted_tokens=round(e.accepted_tokens),  # the simulated engine counts expectations
            mean_acceptance_length=e.mean_acceptance_length,
            acceptance_by_position=e.acceptance_by_position, buckets=buckets,
            tuner_decisions=e.tuner.decisions if e.tuner else 0,
            tuner_explorations=e.tuner.explorations if e.tuner else 0,
        ))
    return pb.SpecStatus(
        method=st.method, tune=st.tune, train=st.train, draft_version=st.draft_version,
        trained_on_policy_version=st.trained_on_policy_version, trainer_rounds=st.trainer_rounds, engines=engines,
    )
