"""The core's own types: groups, requests and samples.

The engine boundary types (request, delta, partial response, load, finish
reason, sampling parameters) live in `engines/types.py`; they are imported
here because a request builds its `EngineRequest`.

Protobuf messages never reach this layer; `api/convert.py` translates.
Times are seconds on the service clock (`Clock.now()`), token counts are
tokens.
"""
from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field

from rollout_service.lifecycle.versions import VersionTags
from rollout_service.engines.types import (
    EngineRequest,
    FinishReason,
    SamplingParams,
    TokenDelta,
)


class CoreError(Exception):
    """A request the core refuses; `code` maps to a gRPC status in the api layer."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # "invalid", "not_found", "exhausted", "failed_precondition"


@dataclass(slots=True)
class GroupSpec:
    """One GRPO prompt group as submitted."""

    group_id: str
    prompt_token_ids: list[int]
    num_samples: int
    sampling: SamplingParams
    prompt_id: str = ""
    prompt_text: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    batch_id: str = ""


@dataclass(slots=True)
class Request:
    """One sample's life in the service: queued, running on an engine,
    possibly migrated or resumed, finished."""

    request_id: str  # "<group_id>/<index>", also the sample id
    group: "Group"
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: VersionTags = field(default_factory=VersionTags)
    engines: list[str] = field(default_factory=list)
    num_migrations: int = 0
    engine_id: str | None = None  # where it runs now; None while queued
    segment_start: int = 0  # len(token_ids) when it started on that engine
    attempt: int = 0  # bumped at every (re)start on an engine
    segment_version: int = 0  # the policy version when it (re)started on its engine
    moved_at: float = float("-inf")  # monotonic time of the last migration
    queued_at: float = 0.0
    first_token_at: float = 0.0
    finished_at: float = 0.0
    finish_reason: FinishReason | None = None
    draft_tokens: int = 0
    accepted_tokens: int = 0
    reprefilled_tokens: int = 0

    @property
    def remaining_tokens(self) -> int:
        return self.group.spec.sampling.max_tokens - len(self.token_ids)

    @property
    def hints(self) -> dict[str, str]:
        """Simulated-engine hints for this sample (target length by index)."""
        meta = self.group.spec.metadata
        lengths = meta.get("sim.target_lengths")
        if not lengths:
            return {}
        values = lengths.split(",")
        return {"target_length": values[self.index % len(values)].strip()}

    def engine_request(self) -> EngineRequest:
        sampling = self.group.spec.sampling
        if sampling.seed is not None:
            # One seed per sample: a group's samples must differ. A resumed
            # request restarts its stream (same distribution, other draws).
            sampling = dataclasses.replace(sampling, seed=sampling.seed + self.index + 1_000_003 * max(0, self.attempt - 1))
        return EngineRequest(
            request_id=self.request_id,
            prompt_token_ids=self.group.spec.prompt_token_ids,
            generated_token_ids=list(self.token_ids),
            sampling=sampling,
            max_new_tokens=self.remaining_tokens,
            hints=self.hints,
        )

    def append(self, token_ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        """Append tokens with one policy version per token."""
        self.token_ids.extend(token_ids)
        self.logprobs.extend(logprobs)
        self.versions.extend(versions)

    def reset(self) -> None:
        """Discard the partial response (the request starts over)."""
        self.token_ids.clear()
        self.logprobs.clear()
        self.versions = VersionTags()
        self.draft_tokens = self.accepted_tokens = 0
        self.first_token_at = 0.0

    def append_delta(self, delta: TokenDelta) -> None:
        """Append an engine delta (all its tokens share one version)."""
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        self.versions.append(delta.version, len(delta.token_ids))
        self.draft_tokens += delta.draft_tokens
        self.accepted_tokens += delta.accepted_tokens


@dataclass(slots=True)
class Group:
    spec: GroupSpec
    requests: list[Request] = field(default_factory=list)
    submitted_at: float = 0.0
    finished: int = 0
    aborted: bool = False
    # A private group (e.g. an HTTP completion) reports to this queue instead
    # of the delivery log: a DeltaEvent per engine step, a SampleEvent per sample.
    listener: "asyncio.Queue[ListenerEvent] | None" = None

    @property
    def group_id(self) -> str:
        return self.spec.group_id

    @property
    def complete(self) -> bool:
        return self.finished == self.spec.num_samples


@dataclass(slots=True)
class Sample:
    """A finished (or aborted) sample as delivered to trainers."""

    sample_id: str
    group_id: str
    index: int
    prompt_id: str
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    logprobs: list[float]
    versions: VersionTags
    finish_reason: FinishReason
    engines: list[str]
    num_migrations: int
    queued_at: float
    first_token_at: float
    finished_at: float
    draft_tokens: int = 0
    accepted_tokens: int = 0
    metadata: dict[str, str] = field(default_factory=dict)
    batch_id: str = ""
    response_text: str = ""
    drop_reason: str = ""  # set when the service gave the sample up (e.g. max_version_lag)

    @classmethod
    def from_request(cls, req: Request, finish_reason: FinishReason) -> "Sample":
        spec = req.group.spec
        return cls(
            sample_id=req.request_id,
            group_id=spec.group_id,
            index=req.index,
            prompt_id=spec.prompt_id,
            prompt_token_ids=spec.prompt_token_ids,
            response_token_ids=list(req.token_ids),
            logprobs=list(req.logprobs),
            versions=req.versions.copy(),
            finish_reason=finish_reason,
            engines=list(req.engines),
            num_migrations=req.num_migrations,
            queued_at=req.queued_at,
            first_token_at=req.first_token_at,
            finished_at=req.finished_at,
            draft_tokens=req.draft_tokens,
            accepted_tokens=req.accepted_tokens,
            metadata=dict(spec.metadata),
            batch_id=spec.batch_id,
        )


@dataclass(slots=True, frozen=True)
class DeltaEvent:
    """New tokens of sample `index` of a private group."""

    index: int
    delta: TokenDelta


@dataclass(slots=True, frozen=True)
class SampleEvent:
    """A sample of a private group finished (or was aborted or dropped)."""

    sample: Sample


ListenerEvent = DeltaEvent | SampleEvent
