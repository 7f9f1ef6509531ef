"""`[engine.spec]`: how the engines speculate, and the depth schedule's math.

An engine speculates with `method` "draft_model" (a small causal LM with the
target's tokenizer), "eagle" (an EAGLE-style head that drafts from the
target's own last hidden state, `rollout_service.drafter.eagle`; `model`
names its directory), "ngram" (prompt lookup, no model) or "siblings"
(suffix matching over the other responses of the same GRPO group,
`vllm_siblings`). The depth K (draft tokens proposed per step) depends on
the running batch size through a schedule [(first, last, K), ...]:
speculation pays in the tail, where a decode step costs almost the same for
one sequence as for sixty-four and verifying several drafted tokens is
nearly free, and it costs throughput in a full batch. Verification is exact
rejection sampling (on a CPU only with `vllm_plugin`, checked at engine
start), so neither the method nor K changes what is sampled.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from rollout_service.engines.tables import from_table

METHODS = ("off", "draft_model", "eagle", "ngram", "siblings")
#: The methods that draft with a model whose weights can be pushed (`target="draft"`).
MODEL_METHODS = ("draft_model", "eagle")
SIBLING_PROPOSER = "rollout_service.engines.vllm_siblings.SiblingProposer"
#: Speculate deeply in the tail, a little in a half-empty batch, never in a full one.
DEFAULT_SCHEDULE = ((1, 4, 4), (5, 16, 2), (17, 1 << 16, 0))


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


#: vLLM's ceiling on CUDA-graph capture sizes, in tokens (`VllmConfig.
#: _set_cudagraph_sizes`; 1024 on data-centre Blackwell).
GRAPH_TOKEN_CEILING = 512


def graph_depths(schedule: Sequence[Sequence[int]], max_seqs: int, max_k: int,
                 ceiling: int = GRAPH_TOKEN_CEILING) -> dict[int, int]:
    """{K: the largest running batch whose decode step at depth K has a
    captured CUDA graph}, for an engine started with `schedule`.

    vLLM 0.32 captures uniform-decode graphs per depth of the start-up
    schedule, for batches up to the widest one running at that depth, within
    `min(max_seqs * (max_k + 1) * 2, ceiling)` tokens; a depth the start-up
    schedule never uses, or a batch beyond its bound, runs eagerly. The
    depth tuner chooses only among these (`DepthTuner(graph_depths=...)`)."""
    lookup = dense_lookup(normalize_schedule(schedule, max_seqs, max_k), max_seqs)
    widest: dict[int, int] = {}
    for batch in range(1, max_seqs + 1):
        widest[lookup[batch]] = batch
    cap = min(max_seqs * (max_k + 1) * 2, ceiling)
    return {k: min(b, cap // (k + 1)) for k, b in sorted(widest.items()) if cap // (k + 1) >= 1}


@dataclass(slots=True)
class SpecConfig:
    """`[engine.spec]`: how the engines speculate (tokens, batch sizes).

    `tune` and `train` switch on the depth tuner and the online drafter
    trainer (`rollout_service.drafter`); `tuner` and `trainer` hold their
    settings and are validated there."""

    method: str = "off"  # off | draft_model | eagle | ngram | siblings
    model: str = ""  # draft model directory; "" means the bundled drafter (draft_model only)
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
    def from_dict(cls, values: "SpecConfig | Mapping[str, Any] | None") -> "SpecConfig":
        """The validated configuration of a `[engine.spec]` table (a
        `SpecConfig` passes through, validated)."""
        cfg = values if isinstance(values, SpecConfig) else from_table(cls, values, "engine.spec")
        cfg.validate()
        return cfg

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    @property
    def has_model(self) -> bool:
        """Whether the engines draft with a model whose weights can be pushed."""
        return self.method in MODEL_METHODS

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
        if self.method == "eagle" and not self.model:
            raise ValueError("engine.spec.model: method 'eagle' needs an EAGLE head directory "
                             "(`rollout-service build-eagle --out DIR` trains one for the bundled reasoner)")
        if self.train and not self.has_model:
            raise ValueError("engine.spec.train needs method = 'draft_model' or 'eagle' (there is no model to train "
                             "otherwise)")
        if self.train and self.method == "eagle" and (self.trainer or {}).get("teacher", "samples") != "policy":
            raise ValueError("engine.spec.trainer.teacher: an EAGLE head drafts from the policy's hidden states and "
                             "trains from the policy; set teacher = \"policy\"")

    def draft_model_path(self) -> str:
        if self.model:
            return self.model
        from rollout_service.assets import tiny_draft_path

        return str(tiny_draft_path())

    def vllm_speculative_config(self, max_seqs: int, platform: str = "cpu") -> dict[str, Any] | None:
        """vLLM's `speculative_config` for an engine of `max_seqs` sequences
        (None when off). Always with a batch-size schedule, so that the depth
        can be changed at run time (`vllm_plugin.rollout_set_spec_schedule`).
        On a GPU `ngram` is vLLM's `ngram_gpu`, which keeps vLLM's async
        scheduling (its CPU `ngram` turns it off at every batch size, as does
        `siblings`, a custom proposer)."""
        if not self.enabled:
            return None
        k = self.num_speculative_tokens
        out: dict[str, Any] = {
            "method": self.method,
            "num_speculative_tokens": k,
            "num_speculative_tokens_per_batch_size": normalize_schedule(self.schedule, max_seqs, k),
        }
        if self.has_model:
            out["model"] = self.draft_model_path()
            out["draft_sample_method"] = self.draft_sample_method
        elif self.method == "siblings":
            out.update(method="custom_class", model=SIBLING_PROPOSER)
        else:
            if platform != "cpu":
                out["method"] = "ngram_gpu"
            out["prompt_lookup_min"] = self.prompt_lookup_min
            out["prompt_lookup_max"] = self.prompt_lookup_max
        return out
