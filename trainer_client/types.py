"""What a trainer reads from the service, as plain Python objects."""
from __future__ import annotations

from dataclasses import dataclass, field

FINISH_REASONS = {0: "unspecified", 1: "stop", 2: "length", 3: "aborted"}
TURN_KINDS = {0: "unspecified", 1: "generated", 2: "observation"}
#: The version of a response token no policy sampled (a trajectory's observation).
NO_VERSION = -1


@dataclass(slots=True)
class Turn:
    """A span of a multi-turn trajectory's response: `kind` "generated"
    (sampled by the policy, trained on) or "observation" (appended between
    turns, masked out). `response_token_ids[start:start + length]`. A
    generated turn names the engine it started on and why it ended; an
    observation's `tool_seconds` is how long it took to arrive after its
    turn ended. Times are seconds since the epoch."""

    kind: str
    start: int
    length: int
    engine_id: str = ""
    finish_reason: str = "unspecified"
    started_at: float = 0.0
    finished_at: float = 0.0
    tool_seconds: float = 0.0

    @classmethod
    def from_pb(cls, t) -> "Turn":
        return cls(kind=TURN_KINDS.get(t.kind, "unspecified"), start=t.start, length=t.length, engine_id=t.engine_id,
                   finish_reason=FINISH_REASONS.get(t.finish_reason, "unspecified"), started_at=t.started_at,
                   finished_at=t.finished_at, tool_seconds=t.tool_seconds)


@dataclass(slots=True)
class MultiTurn:
    """Makes a PromptGroup multi-turn: each sample is a trajectory of at
    most `max_turns` generated turns (`PromptGroup.max_tokens` is the budget
    of one turn) with observations between them. `max_total_tokens` bounds
    the whole response, observations included (0: only the model's context
    does). `environment` names a service-side environment that answers each
    turn; empty: the trainer answers (`RolloutClient.trajectory_groups`, or
    `continue_trajectory` on each turn event)."""

    max_turns: int
    max_total_tokens: int = 0
    environment: str = ""


@dataclass(slots=True)
class CompletedSample:
    """One completion. `versions` are (version, start, length) segments:
    every response token carries the policy version that sampled it.

    A multi-turn trajectory's response holds its generated turns and the
    observations between them: `turns` are its spans in order,
    `response_mask` is 1 per generated and 0 per observation token (all 1
    for a single-turn sample), and `versions` has no segment over an
    observation (`token_versions()` gives those tokens NO_VERSION, -1). A
    sample with `awaiting_observation` is a turn event, not a finished
    sample: the trajectory so far, waiting for an answer to its last turn
    (`RolloutClient.continue_trajectory(sample_id, turn_index, ...)`)."""

    sample_id: str
    group_id: str
    index: int
    prompt_id: str
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    logprobs: list[float]
    versions: list[tuple[int, int, int]]
    finish_reason: str
    engines: list[str]
    num_migrations: int
    cursor: int = 0
    group_complete: bool = False
    min_version: int = -1
    max_version: int = -1
    queued_at: float = 0.0
    first_token_at: float = 0.0
    finished_at: float = 0.0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    response_text: str = ""
    batch_id: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    drop_reason: str = ""
    turns: list[Turn] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    awaiting_observation: bool = False

    @property
    def turn_index(self) -> int:
        """The number of the last generated turn (from 0): what a turn
        event's answer names; -1 for a single-turn sample."""
        return sum(1 for t in self.turns if t.kind == "generated") - 1

    @property
    def behaviour_logprobs(self) -> list[float]:
        """log p(token) under the policy version that sampled it (for
        importance weighting against the current policy)."""
        return self.logprobs

    def loss_mask(self, current_version: int | None = None, max_lag: int | None = None) -> list[int]:
        """One entry per response token: 1 to train on, 0 to mask out.
        Observations of a trajectory are 0; with `current_version` and
        `max_lag`, so are tokens sampled more than `max_lag` versions before
        `current_version` (too stale)."""
        mask = list(self.response_mask) or [1] * len(self.response_token_ids)
        if current_version is None or max_lag is None:
            return mask
        oldest = current_version - max_lag
        return [m if v >= oldest else 0 for m, v in zip(mask, self.token_versions())]

    def token_versions(self) -> list[int]:
        """The policy version of each response token (NO_VERSION, -1, for a
        trajectory's observation tokens)."""
        out = [NO_VERSION] * len(self.response_token_ids)
        for version, start, length in self.versions:
            out[start:start + length] = [version] * length
        return out

    @classmethod
    def from_pb(cls, s, cursor: int = 0, group_complete: bool = False,
                awaiting_observation: bool = False) -> "CompletedSample":
        return cls(
            sample_id=s.sample_id,
            group_id=s.group_id,
            index=s.index,
            prompt_id=s.prompt_id,
            prompt_token_ids=list(s.prompt_token_ids),
            response_token_ids=list(s.response_token_ids),
            logprobs=list(s.logprobs),
            versions=[(v.version, v.start, v.length) for v in s.versions],
            finish_reason=FINISH_REASONS.get(s.finish_reason, "unspecified"),
            engines=list(s.engines),
            num_migrations=s.num_migrations,
            cursor=cursor,
            group_complete=group_complete,
            min_version=s.min_version,
            max_version=s.max_version,
            queued_at=s.timing.queued_at,
            first_token_at=s.timing.first_token_at,
            finished_at=s.timing.finished_at,
            draft_tokens=s.spec.draft_tokens,
            accepted_tokens=s.spec.accepted_tokens,
            response_text=s.response_text,
            batch_id=s.batch_id,
            metadata=dict(s.metadata),
            drop_reason=s.drop_reason,
            turns=[Turn.from_pb(t) for t in s.turns],
            response_mask=list(s.loss_mask) or [1] * len(s.response_token_ids),
            awaiting_observation=awaiting_observation,
        )


@dataclass(slots=True)
class PromptGroup:
    """A GRPO group to submit: one prompt (token ids or text), `num_samples`
    completions, sampling settings (None means the server's default).
    `multi_turn` makes each completion a trajectory of turns (then
    `max_tokens` is the budget of one turn and `stop` strings or
    `stop_token_ids` typically hold the tool-call delimiters; stop strings
    need vLLM engines)."""

    prompt_token_ids: list[int] | None = None
    prompt_text: str = ""
    num_samples: int = 8
    max_tokens: int = 256
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    min_tokens: int = 0  # end and stop tokens suppressed until this many (= max_tokens: exactly max_tokens)
    group_id: str = ""
    prompt_id: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    multi_turn: MultiTurn | None = None


@dataclass(slots=True)
class PushResult:
    """What a weight push did: the version now serving (on every engine),
    the tensor bytes the service received (streamed, or read from the file
    for `push_weights_file`) and the seconds from the header reaching the
    service to the version being live."""

    applied_version: int
    bytes_received: int
    seconds: float
    target: str = "policy"  # "policy" or "draft"

    @classmethod
    def from_pb(cls, reply, target: str = "policy") -> "PushResult":
        return cls(applied_version=reply.applied_version, bytes_received=reply.bytes_received,
                   seconds=reply.seconds, target=target)


@dataclass(slots=True)
class EngineStatus:
    """One engine: its state ("starting", "ready", "updating", "dead"), the
    requests running and waiting on it, the fraction of its KV cache in use
    ([0, 1]), its recent tokens/s, the policy version of its weights and
    how many requests the service has placed on it."""

    engine_id: str
    kind: str  # "sim", "vllm"
    state: str
    running: int
    waiting: int
    kv_usage: float
    tokens_per_s: float
    policy_version: int
    assigned: int

    @classmethod
    def from_pb(cls, e) -> "EngineStatus":
        return cls(engine_id=e.engine_id, kind=e.kind, state=e.state, running=e.running, waiting=e.waiting,
                   kv_usage=e.kv_usage, tokens_per_s=e.tokens_per_s, policy_version=e.policy_version,
                   assigned=e.assigned)


@dataclass(slots=True)
class SpecDepthBucket:
    """Speculative depth for running batches of `min_batch`..`max_batch`
    sequences: the depth in force, the depth tuner's greedy choice, and its
    measurements per depth k (accepted tokens/s per sequence; engine steps
    observed)."""

    min_batch: int
    max_batch: int
    num_speculative_tokens: int
    best_k: int
    tokens_per_s_per_seq: dict[int, float] = field(default_factory=dict)
    observations: dict[int, int] = field(default_factory=dict)

    @classmethod
    def from_pb(cls, b) -> "SpecDepthBucket":
        return cls(min_batch=b.min_batch, max_batch=b.max_batch, num_speculative_tokens=b.num_speculative_tokens,
                   best_k=b.best_k, tokens_per_s_per_seq=dict(b.tokens_per_s_per_seq),
                   observations=dict(b.observations))


@dataclass(slots=True)
class SpecEngineStatus:
    """Speculative decoding on one engine: method, maximum depth, the draft
    weights' version, engine steps, tokens drafted and accepted, tokens per
    verify step (bonus included), acceptance by draft position, the depth
    buckets and the depth tuner's decision counts."""

    engine_id: str
    method: str  # "draft_model", "eagle", "ngram", "siblings"
    max_k: int
    draft_version: int
    steps: int
    draft_tokens: int
    accepted_tokens: int
    mean_acceptance_length: float
    acceptance_by_position: list[float] = field(default_factory=list)
    buckets: list[SpecDepthBucket] = field(default_factory=list)
    tuner_decisions: int = 0
    tuner_explorations: int = 0

    @classmethod
    def from_pb(cls, e) -> "SpecEngineStatus":
        return cls(engine_id=e.engine_id, method=e.method, max_k=e.max_k, draft_version=e.draft_version,
                   steps=e.steps, draft_tokens=e.draft_tokens, accepted_tokens=e.accepted_tokens,
                   mean_acceptance_length=e.mean_acceptance_length,
                   acceptance_by_position=list(e.acceptance_by_position),
                   buckets=[SpecDepthBucket.from_pb(b) for b in e.buckets],
                   tuner_decisions=e.tuner_decisions, tuner_explorations=e.tuner_explorations)


@dataclass(slots=True)
class SpecStatus:
    """Speculative decoding on the service: the method, whether the depth
    tuner (`tune`) and the online drafter trainer (`train`) run, the draft
    version, the policy version the drafter was last trained on, trainer
    rounds, and the engines that speculate."""

    method: str
    tune: bool
    train: bool
    draft_version: int
    trained_on_policy_version: int
    trainer_rounds: int
    engines: list[SpecEngineStatus] = field(default_factory=list)

    @classmethod
    def from_pb(cls, s) -> "SpecStatus":
        return cls(method=s.method, tune=s.tune, train=s.train, draft_version=s.draft_version,
                   trained_on_policy_version=s.trained_on_policy_version, trainer_rounds=s.trainer_rounds,
                   engines=[SpecEngineStatus.from_pb(e) for e in s.engines])


@dataclass(slots=True)
class ServiceStatus:
    """A snapshot of the service. Requests are samples: `queued_requests`
    wait for an engine, `running_requests` run on one; `open_groups` are
    submitted groups not yet complete; `last_cursor` is the cursor of the
    last sample delivered; `retained_samples` are kept for consumers that
    have not acknowledged them. `counters` by name (samples_completed,
    tokens_generated, ...); `uptime_s` in seconds; `spec` is None when the
    engines do not speculate; `incarnation` is constant while the service's
    state_dir survives (see ServiceRestarted); `journal_error` says why
    state_dir cannot be written ("" while it can); `paused` is the fleet's
    pause in force (vLLM's /pause mode: "keep", "abort", "wait"; "" when
    not paused)."""

    policy_version: int
    model: str
    scheduler: str
    engines: list[EngineStatus]
    queued_requests: int
    running_requests: int
    open_groups: int
    last_cursor: int
    retained_samples: int
    uptime_s: float
    counters: dict[str, int] = field(default_factory=dict)
    spec: SpecStatus | None = None
    incarnation: str = ""
    journal_error: str = ""
    paused: str = ""

    @classmethod
    def from_pb(cls, st) -> "ServiceStatus":
        return cls(
            policy_version=st.policy_version, model=st.model, scheduler=st.scheduler,
            engines=[EngineStatus.from_pb(e) for e in st.engines], queued_requests=st.queued_requests,
            running_requests=st.running_requests, open_groups=st.open_groups, last_cursor=st.last_cursor,
            retained_samples=st.retained_samples, uptime_s=st.uptime_s,
            counters={k: round(v) for k, v in st.counters.items()},  # whole counts, sent as doubles
            spec=SpecStatus.from_pb(st.spec) if st.HasField("spec") else None, incarnation=st.incarnation,
            journal_error=st.journal_error, paused=st.paused,
        )
