"""The service's own types: groups, requests, samples and token deltas.

Protobuf messages never reach this layer; `api/convert.py` translates.
Times are seconds on the service clock (`Clock.now()`), token counts are
tokens.
"""
from __future__ import annotations

import asyncio
import dataclasses
import enum
from dataclasses import dataclass, field

from rollout_service.core.versions import VersionTags


class CoreError(Exception):
    """A request the core refuses; `code` maps to a gRPC status in the api layer."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # "invalid", "not_found", "exhausted", "failed_precondition"


class FinishReason(enum.IntEnum):
    UNSPECIFIED = 0
    STOP = 1
    LENGTH = 2
    ABORTED = 3


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """Per-group sampling settings; validated at the edge."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


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
class EngineRequest:
    """What an engine is asked to generate.

    `generated_token_ids` is a partial response to continue from (empty for
    a fresh request): the engine re-prefills prompt + generated and samples
    at most `max_new_tokens` more. `hints` carries workload hints that only a
    simulated engine reads (e.g. the target response length).
    """

    request_id: str
    prompt_token_ids: list[int]
    generated_token_ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    hints: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class TokenDelta:
    """New tokens of one request from one engine step.

    `version` is the policy version of the weights that sampled them.
    `finish_reason` is set on the last delta of a request.
    """

    token_ids: list[int]
    logprobs: list[float]
    version: int
    finish_reason: FinishReason | None = None
    draft_tokens: int = 0
    accepted_tokens: int = 0


@dataclass(slots=True)
class PartialResponse:
    """Tokens an engine generated for a request before it was aborted."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]


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
    # of the delivery log: ("delta", index, TokenDelta) and ("sample", Sample).
    listener: "asyncio.Queue | None" = None

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


@dataclass(slots=True)
class EngineLoad:
    """A snapshot of one engine's load, as the scheduling policies see it."""

    engine_id: str
    kind: str
    state: str  # "starting", "ready", "updating", "dead"
    running: int
    waiting: int
    max_seqs: int
    kv_used_tokens: int
    kv_capacity_tokens: int
    tokens_per_s: float
    policy_version: int

    @property
    def kv_usage(self) -> float:
        return self.kv_used_tokens / self.kv_capacity_tokens if self.kv_capacity_tokens else 0.0
