"""The engine boundary: what the layers above send an engine and get back.

Every engine kind (`vllm`, `sim`, `ray`) speaks these types and nothing of
the core's. Token counts are tokens, times are seconds.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class EngineState(enum.StrEnum):
    """An engine's lifecycle state (str-valued: compares equal to "ready")."""

    STARTING = "starting"
    READY = "ready"
    UPDATING = "updating"  # applying policy weights; running requests are paused, not lost
    DEAD = "dead"


class FinishReason(enum.IntEnum):
    UNSPECIFIED = 0
    STOP = 1
    LENGTH = 2
    ABORTED = 3


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """Per-group sampling settings; validated at the edge.

    `stop` are stop strings: an engine that detokenises (vLLM) ends a
    request when its generated text contains one (finish STOP; the tokens up
    to and including the one completing the string are returned, the edge
    trims the text). `min_tokens` suppresses end and stop tokens (and stop
    strings) until that many tokens were generated; `ignore_eos` keeps
    generating past the end token (stop_token_ids still stop). `logprobs` is
    how many top alternatives to report per token besides the sampled one
    (0: the sampled token's logprob only). Counts are of the whole response:
    an engine continuing a partial response subtracts what was generated.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int = 0

    def __post_init__(self) -> None:  # lists (e.g. from JSON) become tuples
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))


@dataclass(slots=True)
class EngineRequest:
    """What an engine is asked to generate.

    `generated_token_ids` is a partial response to continue from (empty for
    a fresh request): the engine re-prefills prompt + generated and samples
    at most `max_new_tokens` more. `hints` carries workload hints that only a
    simulated engine reads (e.g. the target response length). `cache_salt`
    partitions the engine's prefix cache: a request reuses cached KV only of
    requests with the same salt ("": no salt); the core salts by the policy
    version that computes the context, so no request attends to KV of other
    weights unless the carry-over mode says so.
    """

    request_id: str
    prompt_token_ids: list[int]
    generated_token_ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    hints: dict[str, str] = field(default_factory=dict)
    cache_salt: str = ""


@dataclass(slots=True)
class TokenDelta:
    """New tokens of one request from one engine step.

    `version` is the policy version of the weights that sampled them.
    `finish_reason` is set on the last delta of a request. `top_logprobs`,
    when the request asked for alternatives (`SamplingParams.logprobs`) and
    the engine knows them, holds per token the (token id, logprob) pairs
    in vLLM's order: the sampled token first, then the top alternatives by
    rank (the sampled one not repeated); None when the engine has none.
    """

    token_ids: list[int]
    logprobs: list[float]
    version: int
    finish_reason: FinishReason | None = None
    draft_tokens: int = 0
    accepted_tokens: int = 0
    top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def tokens_only(self) -> bool:
        """Tokens and nothing else (no finish, drafts or alternatives): what
        `DeltaStream.push_tokens` carries without the delta itself."""
        return (self.finish_reason is None and not self.draft_tokens and not self.accepted_tokens
                and self.top_logprobs is None)


@dataclass(slots=True)
class PartialResponse:
    """Tokens an engine generated for a request before it was aborted."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]


@dataclass(slots=True)
class EngineLoad:
    """A snapshot of one engine's load, as the scheduling policies see it.

    `prefix_cache_queried_tokens` / `prefix_cache_hit_tokens` are cumulative
    since the engine (re)started: prompt tokens its prefix cache was asked
    for when a request was admitted, and those it already held (vLLM's own
    counters; a simulated engine's model of them)."""

    engine_id: str
    kind: str
    state: EngineState
    running: int
    waiting: int
    max_seqs: int
    kv_used_tokens: int  # tokens of KV cache in use
    kv_capacity_tokens: int  # tokens the KV cache holds (0: unknown, e.g. not started)
    tokens_per_s: float
    policy_version: int
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_used_tokens / self.kv_capacity_tokens if self.kv_capacity_tokens else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / q if q else 0.0


@dataclass(slots=True, frozen=True)
class EngineDescription:
    """What an engine is (not how loaded it is): the edges (OpenAI / vLLM
    compatible endpoints, status) read it instead of engine attributes.

    `model` is the model directory ("" for a simulated engine without one);
    `kv_capacity_tokens` is 0 until the engine has started and sized its
    cache; `speculation` is the method or "off"; `draft_model` the draft
    model directory when the method drafts with a model ("draft_model",
    "eagle"), else ""."""

    engine_id: str
    kind: str  # "vllm" or "sim"
    placement: str  # "local" or "ray"
    model: str
    model_name: str
    max_seqs: int
    max_model_len: int
    kv_capacity_tokens: int
    dtype: str = ""  # the weights' dtype as served ("float32"); "" for a simulated engine
    logprobs_mode: str = "processed_logprobs"
    workers: int = 1  # model worker processes (tensor x pipeline parallel ranks)
    speculation: str = "off"
    draft_model: str = ""
