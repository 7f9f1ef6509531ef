"""What a trainer reads from the service, as plain Python objects."""
from __future__ import annotations

from dataclasses import dataclass, field

FINISH_REASONS = {0: "unspecified", 1: "stop", 2: "length", 3: "aborted"}


@dataclass(slots=True)
class CompletedSample:
    """One completion. `versions` are (version, start, length) segments:
    every response token carries the policy version that sampled it."""

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

    @property
    def behaviour_logprobs(self) -> list[float]:
        """log p(token) under the policy version that sampled it (for
        importance weighting against the current policy)."""
        return self.logprobs

    def loss_mask(self, current_version: int, max_lag: int) -> list[int]:
        """1 for tokens sampled at most `max_lag` versions before
        `current_version`, 0 for staler ones (mask them out of the loss)."""
        oldest = current_version - max_lag
        return [1 if v >= oldest else 0 for v in self.token_versions()]

    def token_versions(self) -> list[int]:
        """The policy version of each response token."""
        out: list[int] = []
        for version, _, length in self.versions:
            out.extend([version] * length)
        return out

    @classmethod
    def from_pb(cls, s, cursor: int = 0, group_complete: bool = False) -> "CompletedSample":
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
        )


@dataclass(slots=True)
class PromptGroup:
    """A GRPO group to submit: one prompt (token ids or text), `num_samples`
    completions, sampling settings (None means the server's default)."""

    prompt_token_ids: list[int] | None = None
    prompt_text: str = ""
    num_samples: int = 8
    max_tokens: int = 256
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    group_id: str = ""
    prompt_id: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
