"""Speculative decoding as an engine sees it: the configuration, the
depth schedule, and what each engine measures of it.

An engine speculates with `method` "draft_model" (a small causal LM with the
target's tokenizer), "ngram" (prompt lookup, no model) or "siblings"
(suffix matching over the other responses of the same GRPO group,
`vllm_siblings`). The depth K (draft
tokens proposed per step) depends on the running batch size through a
schedule [(first, last, K), ...]: speculation pays in the tail, where a
decode step costs almost the same for one sequence as for sixty-four and
verifying several drafted tokens is nearly free, and it costs throughput in
a full batch. Verification is exact rejection sampling (on a CPU only with
`vllm_plugin`), so neither the method nor K changes what is sampled.

`SpecMonitor` turns an engine's per-step statistics into the observations
the depth tuner learns from (batch size, K in force, step seconds, tokens)
and into the `spec` section of the engine status.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

METHODS = ("off", "draft_model", "ngram", "siblings")
SIBLING_PROPOSER = "rollout_service.engines.vllm_siblings.SiblingProposer"
#: Speculate deeply in the tail, a little in a half-empty batch, never in a full one.
DEFAULT_SCHEDULE = ((1, 4, 4), (5, 16, 2), (17, 1 << 16, 0))


def from_table(cls, values: Mapping[str, Any] | None, where: str):
    """`cls(**values)`, naming unknown keys (a config table `where`) in the error."""
    values = dict(values or {})
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    return cls(**values)


def normalize_schedule(schedule: Sequence[Sequence[int]], max_seqs: int, max_k: int) -> list[tuple[int, int, int]]:
    """Validate a depth schedule and clip it to [1, max_seqs] and K <= max_k.

    Ranges are inclusive batch sizes, sorted, non-overlapping, starting at 1;
    a gap carries the previous K forward (vLLM's rule)."""
    out: list[tuple[int, int, int]] = []
    for i, entry in enumerate(schedule):
        if len(entry) != 3:
            raise ValueError(f"engine.spec.schedule[{i}]: expected [first, last, K], got {list(entry)}")
        lo, hi, k = (int(v) for v in entry)
        if lo < 1 or hi < lo or k < 0:
            raise ValueError(f"engine.spec.schedule[{i}]: need 1 <= first <= last and K >= 0, got {[lo, hi, k]}")
        if out and lo <= out[-1][1]:
            raise ValueError(f"engine.spec.schedule[{i}]: ranges must be sorted and must not overlap")
        if lo > max_seqs:
            break
        out.append((lo, min(hi, max_seqs), min(k, max_k)))
    if not out or out[0][0] != 1:
        raise ValueError("engine.spec.schedule: the first range must start at batch size 1")
    return out


def dense_lookup(schedule: Sequence[Sequence[int]], max_seqs: int) -> list[int]:
    """[K for batch size 0..max_seqs] (index 0 unused), as vLLM expands it."""
    lookup = [0] * (max_seqs + 1)
    last = 0
    nxt = 1
    for lo, hi, k in schedule:
        for b in range(nxt, min(lo, max_seqs + 1)):
            lookup[b] = last
        for b in range(max(lo, nxt), min(hi, max_seqs) + 1):
            lookup[b] = k
        nxt, last = max(nxt, hi + 1), k
    for b in range(nxt, max_seqs + 1):
        lookup[b] = last
    return lookup


@dataclass(slots=True)
class SpecConfig:
    """`[engine.spec]`: how the engines speculate (tokens, batch sizes).

    `tune` and `train` switch on the depth tuner and the online drafter
    trainer (`rollout_service.drafter`); `tuner` and `trainer` hold their
    settings and are validated there."""

    method: str = "off"  # off | draft_model | ngram | siblings
    model: str = ""  # draft model directory; "" means the bundled drafter
    # "greedy": the drafter's argmax (accepted with the target's probability
    # of it); "probabilistic": sampled from the drafter (accepted with
    # probability 1 - TV(target, drafter): better once the drafter matches
    # the target's whole distribution, worse while it is less confident).
    draft_sample_method: str = "greedy"
    num_speculative_tokens: int = 4  # the largest K any batch size may use
    schedule: list[list[int]] = field(default_factory=lambda: [list(e) for e in DEFAULT_SCHEDULE])
    prompt_lookup_min: int = 2  # ngram: shortest suffix to match (tokens)
    prompt_lookup_max: int = 4  # ngram: longest suffix to match (tokens)
    tune: bool = False
    train: bool = False
    tuner: dict[str, Any] = field(default_factory=dict)
    trainer: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> "SpecConfig":
        cfg = from_table(cls, values, "engine.spec")
        cfg.validate()
        return cfg

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"engine.spec.method must be one of {list(METHODS)}, got {self.method!r}")
        if not self.enabled:
            return
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"engine.spec.num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        normalize_schedule(self.schedule, 1 << 16, self.num_speculative_tokens)
        if self.draft_sample_method not in ("probabilistic", "greedy"):
            raise ValueError(f"engine.spec.draft_sample_method must be 'probabilistic' or 'greedy', got {self.draft_sample_method!r}")
        if self.method == "ngram" and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("engine.spec: need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.train and self.method != "draft_model":
            raise ValueError("engine.spec.train needs method = 'draft_model' (there is no model to train otherwise)")

    def draft_model_path(self) -> str:
        if self.model:
            return self.model
        from rollout_service.assets import tiny_draft_path

        return str(tiny_draft_path())

    def vllm_speculative_config(self, max_seqs: int) -> dict[str, Any] | None:
        """vLLM's `speculative_config` for an engine of `max_seqs` sequences
        (None when off). Always with a batch-size schedule, so that the depth
        can be changed at run time (`vllm_plugin.rollout_set_spec_schedule`)."""
        if not self.enabled:
            return None
        k = self.num_speculative_tokens
        out: dict[str, Any] = {
            "method": self.method,
            "num_speculative_tokens": k,
            "num_speculative_tokens_per_batch_size": normalize_schedule(self.schedule, max_seqs, k),
        }
        if self.method == "draft_model":
            out["model"] = self.draft_model_path()
            out["draft_sample_method"] = self.draft_sample_method
        elif self.method == "siblings":
            out.update(method="custom_class", model=SIBLING_PROPOSER)
        else:
            out["prompt_lookup_min"] = self.prompt_lookup_min
            out["prompt_lookup_max"] = self.prompt_lookup_max
        return out


@dataclass(slots=True)
class StepObservation:
    """One engine step as the depth tuner sees it."""

    batch: int  # sequences that produced tokens in the step
    k: int  # speculative depth in force for that batch size
    seconds: float  # step duration (engine-core clock)
    tokens: int  # tokens emitted by the step (accepted drafts + one per sequence)


class SpecMonitor:
    """Per-engine speculative statistics, fed once per engine step.

    Keeps totals (draft tokens proposed and accepted, acceptance by draft
    position), the schedule in force, the draft-weight version, and a
    bounded queue of `StepObservation`s for the depth tuner."""

    def __init__(self, cfg: SpecConfig, max_seqs: int) -> None:
        self.cfg = cfg
        self.max_seqs = max_seqs
        self.schedule = normalize_schedule(cfg.schedule, max_seqs, cfg.num_speculative_tokens) if cfg.enabled else []
        self.lookup = dense_lookup(self.schedule, max_seqs) if cfg.enabled else [0] * (max_seqs + 1)
        self.draft_version = 0
        self.steps = 0
        self.spec_steps = 0  # (request, step) pairs that verified drafts
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.accepted_per_pos = [0] * max(1, cfg.num_speculative_tokens)
        self.drafted_per_pos = [0] * max(1, cfg.num_speculative_tokens)
        self.observations: deque[StepObservation] = deque(maxlen=8192)
        self.tuner_state: dict[str, Any] = {}

    def set_schedule(self, schedule: Sequence[Sequence[int]]) -> None:
        self.schedule = normalize_schedule(schedule, self.max_seqs, self.cfg.num_speculative_tokens)
        self.lookup = dense_lookup(self.schedule, self.max_seqs)

    def k_for(self, batch: int) -> int:
        return self.lookup[min(max(batch, 1), self.max_seqs)]

    def record(self, batch: int, seconds: float | None, tokens: int, spec_stats: Any) -> None:
        """One step: `batch` sequences emitted `tokens` tokens in `seconds`
        (None when unknown, e.g. a step of prefills only); `spec_stats` is
        vLLM's SpecDecodingStats of the step or None."""
        self.steps += 1
        if spec_stats is not None:
            self.spec_steps += spec_stats.num_drafts
            self.draft_tokens += spec_stats.num_draft_tokens
            self.accepted_tokens += spec_stats.num_accepted_tokens
            for i, n in enumerate(spec_stats.num_accepted_tokens_per_pos[: len(self.accepted_per_pos)]):
                self.accepted_per_pos[i] += n
            for i, n in enumerate(spec_stats.num_draft_tokens_per_pos[: len(self.drafted_per_pos)]):
                self.drafted_per_pos[i] += n
        if seconds is not None and batch > 0 and seconds > 0:
            self.observations.append(StepObservation(batch, self.k_for(batch), seconds, tokens))

    def record_expected(self, batch: int, k: int, seconds: float, tokens: int, verify_steps: float,
                        profile: Sequence[float]) -> None:
        """A simulated run in expectation: `verify_steps` (request, step)
        pairs at depth k, draft token i accepted with probability profile[i]."""
        self.steps += 1
        if k > 0:
            self.spec_steps += verify_steps
            self.draft_tokens += verify_steps * k
            self.accepted_tokens += verify_steps * sum(profile)
            for i, q in enumerate(profile[: len(self.accepted_per_pos)]):
                self.accepted_per_pos[i] += verify_steps * q
                self.drafted_per_pos[i] += verify_steps
        if seconds > 0 and batch > 0:
            self.observations.append(StepObservation(batch, k, seconds, tokens))

    def drain(self) -> list[StepObservation]:
        """The observations since the last drain (the tuner consumes them)."""
        out = list(self.observations)
        self.observations.clear()
        return out

    def status(self) -> dict[str, Any]:
        """The `spec` section of an engine's status (JSON-serialisable)."""
        if not self.cfg.enabled:
            return {"method": "off"}
        per_pos = [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)]
        return {
            "method": self.cfg.method,
            "max_k": self.cfg.num_speculative_tokens,
            "schedule": [list(e) for e in self.schedule],
            "draft_version": self.draft_version,
            "steps": self.steps,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            # Tokens per verify step of one request: accepted drafts plus the bonus token.
            "mean_acceptance_length": 1.0 + self.accepted_tokens / self.spec_steps if self.spec_steps else 1.0,
            "acceptance_by_position": per_pos,
            "tuner": dict(self.tuner_state),
        }


def depth_buckets(engine_status: dict[str, Any]) -> list[dict[str, Any]]:
    """The depth in force per running-batch bucket of an engine's `spec`
    status: the tuner's buckets (with its measurements) when it tunes, else
    the fixed schedule's, in the same form (no measurements)."""
    buckets = (engine_status.get("tuner") or {}).get("buckets")
    if buckets:
        return buckets
    return [{"batch": [lo, hi], "k": k, "best_k": k, "tokens_per_s_per_seq": {}, "observations": {}}
            for lo, hi, k in engine_status.get("schedule", [])]
