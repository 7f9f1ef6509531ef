"""Drafting from sibling responses: a model-free vLLM proposer for GRPO.

The samples of one GRPO group answer the same prompt, and in the tail the
long ones run beside (or after) siblings that already wrote much of the same
text. This proposer drafts the next K tokens of a request by suffix
matching: it finds the longest suffix of the request's tokens (up to
`MAX_MATCH`, at least `MIN_MATCH`) in the tokens of its siblings (running in
the same batch or finished on this engine) and in its own context, and
proposes what followed the match (Seer, arXiv 2511.14617; DAS, arXiv
2511.13841). Drafts are verified by rejection sampling like any other, so
sampling stays exact; the proposal costs a few vector compares per request.

Siblings are recognised by request id: the rollout core names every sample
`<group id>/<index>`, and vLLM appends `-<8 characters>`.

It plugs into vLLM as `speculative_config={"method": "custom_class", "model":
"rollout_service.engines.vllm_siblings.SiblingProposer", ...}` and needs the
worker extension's `rollout_attach_sibling_drafter()` once after start-up:
vLLM's custom-proposer interface passes neither request ids nor the depth
K of the step, so the attach gives the proposer the model runner (for the
request ids of the batch), wraps the runner's draft step (for K) and its
input batch's `remove_request` (to keep the tokens of finished siblings).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

MIN_MATCH = 2  # tokens of suffix that must match
MAX_MATCH = 12
MAX_GROUPS = 512  # groups whose finished siblings are remembered
MAX_FINISHED = 16  # finished siblings remembered per group


def group_of(request_id: str) -> str | None:
    """The GRPO group of a vLLM request id (`<group>/<index>-<suffix>`)."""
    external = request_id.rsplit("-", 1)[0]
    if "/" not in external:
        return None
    return external.rsplit("/", 1)[0]


def propose_from(context: np.ndarray, sources: list[np.ndarray], k: int,
                 min_match: int = MIN_MATCH, max_match: int = MAX_MATCH) -> list[int]:
    """Up to k tokens that followed the longest match of `context`'s suffix
    in `sources` (the context itself may be one of them: its trivial match
    at its own end has no continuation and is skipped). Later matches win
    ties."""
    if k <= 0 or len(context) < min_match or not sources:
        return []
    parts = []
    for src in sources:
        parts.append(src)
        parts.append(np.array([-1], dtype=src.dtype))
    hay = np.concatenate(parts)
    n = len(hay)
    # length[p]: how many tokens of context's suffix end at hay[p].
    length = np.zeros(n, dtype=np.int32)
    alive = hay == context[-1]
    alive[-1] = False
    for d in range(max_match):
        if d:
            shifted = np.zeros(n, dtype=bool)
            if d < n and d < len(context):
                shifted[d:] = hay[:-d] == context[-1 - d]
            alive &= shifted
        if not alive.any():
            break
        length += alive
        if d + 1 >= len(context):
            break
    # A match needs a continuation: the next token is not a separator.
    nxt = np.empty(n, dtype=hay.dtype)
    nxt[:-1] = hay[1:]
    nxt[-1] = -1
    length[nxt < 0] = 0
    best = int(length.max())
    if best < min_match:
        return []
    p = int(np.flatnonzero(length == best)[-1])
    cont = hay[p + 1 : p + 1 + k]
    stop = np.flatnonzero(cont < 0)
    if stop.size:
        cont = cont[: stop[0]]
    return cont.tolist()


class SiblingProposer:
    """vLLM custom proposer (see the module docstring)."""

    def __init__(self, vllm_config) -> None:
        spec = vllm_config.speculative_config
        self.k = spec.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.runner = None
        self.step_k = self.k  # K the scheduler chose for the step being drafted
        self.finished: OrderedDict[str, list[np.ndarray]] = OrderedDict()
        self.proposed = 0

    # -- wiring (called once in the worker, after start-up) -------------------------

    def attach(self, runner) -> None:
        if self.runner is runner:
            return
        self.runner = runner
        original_draft = runner.propose_draft_token_ids

        def propose_draft_token_ids(scheduler_output, *args, **kwargs):
            self.step_k = int(getattr(scheduler_output, "num_spec_tokens_to_schedule", self.k))
            return original_draft(scheduler_output, *args, **kwargs)

        runner.propose_draft_token_ids = propose_draft_token_ids
        batch = runner.input_batch
        original_remove = batch.remove_request

        def remove_request(req_id):
            self._remember(req_id)
            return original_remove(req_id)

        batch.remove_request = remove_request

    def _remember(self, req_id: str) -> None:
        batch = self.runner.input_batch
        group = group_of(req_id)
        index = batch.req_id_to_index.get(req_id) if group is not None else None
        if index is None:
            return
        tokens = batch.token_ids_cpu[index, : batch.num_tokens_no_spec[index]].copy()
        kept = self.finished.setdefault(group, [])
        kept.append(tokens)
        del kept[:-MAX_FINISHED]
        self.finished.move_to_end(group)
        while len(self.finished) > MAX_GROUPS:
            self.finished.popitem(last=False)

    # -- vLLM's proposer interface ----------------------------------------------------

    def load_model(self, *args, **kwargs) -> None:
        pass  # no model

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        k = min(self.step_k, self.k)
        if self.runner is None or k <= 0:
            return drafts
        req_ids = self.runner.input_batch.req_ids
        groups: dict[str, list[int]] = {}
        for i, rid in enumerate(req_ids[: len(sampled_token_ids)]):
            g = group_of(rid) if rid is not None else None
            if g is not None:
                groups.setdefault(g, []).append(i)
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            if not sampled or n >= self.max_model_len - 1:
                continue
            context = token_ids_cpu[i, :n]
            rid = req_ids[i] if i < len(req_ids) else None
            g = group_of(rid) if rid is not None else None
            sources = list(self.finished.get(g, ())) if g is not None else []
            if g is not None:
                sources += [token_ids_cpu[j, : int(num_tokens_no_spec[j])] for j in groups[g] if j != i]
            sources.append(context)
            room = self.max_model_len - 1 - n
            drafts[i] = propose_from(context, sources, min(k, room))
            self.proposed += len(drafts[i])
        return drafts
