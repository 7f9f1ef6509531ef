"""Edge validation: every field of every request, checked before the core
sees it. A bad field raises `FieldError` (-> INVALID_ARGUMENT, naming the
field and its allowed range); an oversized request raises `TooLarge`
(-> RESOURCE_EXHAUSTED)."""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Protocol

from rollout_proto import rollout_pb2 as pb
from rollout_service.engines.types import SamplingParams
from rollout_service.lifecycle.types import GroupSpec, MultiTurnSpec

MAX_NUM_SAMPLES = 1024
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_TEMPERATURE = 2.0  # vLLM refuses hotter sampling; so does the OpenAI API
MAX_TURNS = 1024
MAX_ID_CHARS = 256
MAX_METADATA_BYTES = 65_536  # characters of a group's metadata keys and values together
MAX_STOP_TOKEN_IDS = 256
MAX_TEXT_CHARS = 1_000_000  # a prompt or observation given as text
MAX_SEED = 2**63 - 1  # vLLM's (int64); per-sample and per-attempt offsets wrap (Request.engine_request)
MAX_ABORT_GROUP_IDS = 4096
# A Submit with more prompt texts than this, or more characters of text or
# token ids than INLINE_PROMPT_UNITS, is validated in a worker thread:
# tokenising and checking them would block the event loop.
INLINE_PROMPT_TEXTS = 8
INLINE_PROMPT_UNITS = 65_536


class FieldError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field} {message}")
        self.field = field


class TooLarge(ValueError):
    pass


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(slots=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int
    max_groups_per_submit: int = 4096
    max_samples_per_submit: int = 65_536
    text: bool = True  # the engines detokenize (stop strings work); False on simulated engines


def _check_id(field: str, value: str) -> None:
    if len(value) > MAX_ID_CHARS:
        raise FieldError(field, f"must be at most {MAX_ID_CHARS} characters, got {len(value)}")


def _check_text(field: str, text: str) -> None:
    if len(text) > MAX_TEXT_CHARS:
        raise FieldError(field, f"must be at most {MAX_TEXT_CHARS} characters, got {len(text)}")


def _check_tokens(field: str, ids, vocab: int) -> None:
    if len(ids) and 0 <= min(ids) and max(ids) < vocab:  # at C speed; the loop only names the culprit
        return
    for j, t in enumerate(ids):
        if not 0 <= t < vocab:
            raise FieldError(f"{field}[{j}]", f"must be a token id in [0, {vocab - 1}], got {t}")


def sampling_params(field: str, sp: pb.SamplingParams, prompt_len: int, limits: ModelLimits) -> SamplingParams:
    budget = limits.max_model_len - prompt_len
    if not 1 <= sp.max_tokens <= budget:
        raise FieldError(
            f"{field}.max_tokens",
            f"must be in [1, {budget}] (max_model_len {limits.max_model_len} - prompt {prompt_len}), got {sp.max_tokens}",
        )
    temperature = sp.temperature if sp.HasField("temperature") else 1.0
    if not (math.isfinite(temperature) and 0.0 <= temperature <= MAX_TEMPERATURE):
        raise FieldError(f"{field}.temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {temperature}")
    top_p = sp.top_p if sp.HasField("top_p") else 1.0
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise FieldError(f"{field}.top_p", f"must be in (0, 1], got {top_p}")
    top_k = sp.top_k if sp.HasField("top_k") else -1
    if top_k != -1 and not 1 <= top_k <= limits.vocab_size:
        raise FieldError(f"{field}.top_k", f"must be -1 or in [1, {limits.vocab_size}], got {top_k}")
    min_tokens = sp.min_tokens if sp.HasField("min_tokens") else 0
    if min_tokens > sp.max_tokens:
        raise FieldError(f"{field}.min_tokens", f"must be in [0, max_tokens {sp.max_tokens}], got {min_tokens}")
    if len(sp.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise FieldError(f"{field}.stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} token ids, got {len(sp.stop_token_ids)}")
    _check_tokens(f"{field}.stop_token_ids", sp.stop_token_ids, limits.vocab_size)
    if sp.HasField("seed") and sp.seed > MAX_SEED:
        raise FieldError(f"{field}.seed", f"must be in [0, {MAX_SEED}], got {sp.seed}")
    if sp.stop:
        if len(sp.stop) > MAX_STOP_STRINGS:
            raise FieldError(f"{field}.stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(sp.stop)}")
        for j, stop in enumerate(sp.stop):
            if not 1 <= len(stop) <= MAX_STOP_CHARS:
                raise FieldError(f"{field}.stop[{j}]", f"must be 1-{MAX_STOP_CHARS} characters, got {len(stop)}")
        if not limits.text:
            raise FieldError(f"{field}.stop", "stop strings need engines that detokenize (vLLM); this server's "
                             "engines are simulated: use stop_token_ids")
    return SamplingParams(
        max_tokens=sp.max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=top_k,
        stop_token_ids=tuple(sp.stop_token_ids),
        seed=sp.seed if sp.HasField("seed") else None,
        stop=tuple(sp.stop),
        min_tokens=min_tokens,
    )


def submit_request(req: pb.SubmitRequest, limits: ModelLimits, tokenizer: Tokenizer | None) -> list[GroupSpec]:
    if not req.groups:
        raise FieldError("groups", "must contain at least 1 group")
    if len(req.groups) > limits.max_groups_per_submit:
        raise TooLarge(f"groups: {len(req.groups)} groups exceed the limit of {limits.max_groups_per_submit} per Submit")
    _check_id("batch_id", req.batch_id)
    specs = []
    for i, g in enumerate(req.groups):
        f = f"groups[{i}]"
        _check_id(f"{f}.group_id", g.group_id)
        _check_id(f"{f}.prompt_id", g.prompt_id)
        if not 1 <= g.num_samples <= MAX_NUM_SAMPLES:
            raise FieldError(f"{f}.num_samples", f"must be in [1, {MAX_NUM_SAMPLES}], got {g.num_samples}")
        if g.prompt_token_ids and g.prompt_text:
            raise FieldError(f"{f}.prompt_text", "set prompt_token_ids or prompt_text, not both")
        if g.prompt_text:
            _check_text(f"{f}.prompt_text", g.prompt_text)
            if tokenizer is None:
                raise FieldError(f"{f}.prompt_text", "this server has no tokenizer; send prompt_token_ids")
            prompt = list(tokenizer.encode(g.prompt_text))
        else:
            prompt = list(g.prompt_token_ids)
        if not prompt:
            raise FieldError(f"{f}.prompt_token_ids", "prompt is empty: set prompt_token_ids or prompt_text")
        if len(prompt) >= limits.max_model_len:
            raise FieldError(
                f"{f}.prompt_token_ids",
                f"prompt of {len(prompt)} tokens must be shorter than max_model_len {limits.max_model_len}",
            )
        if not g.prompt_text:  # after the length check: a range check of an over-long prompt is wasted
            _check_tokens(f"{f}.prompt_token_ids", prompt, limits.vocab_size)
        meta_bytes = sum(len(k) + len(v) for k, v in g.metadata.items())
        if meta_bytes > MAX_METADATA_BYTES:
            raise FieldError(f"{f}.metadata", f"must be at most {MAX_METADATA_BYTES} characters (keys and values), "
                             f"got {meta_bytes}")
        if not g.HasField("sampling"):
            raise FieldError(f"{f}.sampling.max_tokens", f"must be in [1, {limits.max_model_len - len(prompt)}], got 0")
        sampling = sampling_params(f"{f}.sampling", g.sampling, len(prompt), limits)
        multi_turn = multi_turn_spec(f"{f}.multi_turn", g.multi_turn) if g.HasField("multi_turn") else None
        specs.append(
            GroupSpec(
                group_id=g.group_id,
                prompt_token_ids=prompt,
                num_samples=g.num_samples,
                sampling=sampling,
                prompt_id=g.prompt_id,
                prompt_text=g.prompt_text,
                metadata=dict(g.metadata),
                batch_id=req.batch_id,
                multi_turn=multi_turn,
            )
        )
    total = sum(s.num_samples for s in specs)
    if total > limits.max_samples_per_submit:
        raise TooLarge(f"groups: {total} samples exceed the limit of {limits.max_samples_per_submit} per Submit")
    return specs


def multi_turn_spec(field: str, mt: pb.MultiTurn) -> MultiTurnSpec:
    """A group's multi-turn settings. The per-turn budget is the group's
    sampling.max_tokens (checked against the context as for any group); an
    environment name the service does not know is the core's to reject."""
    if not 1 <= mt.max_turns <= MAX_TURNS:
        raise FieldError(f"{field}.max_turns", f"must be in [1, {MAX_TURNS}], got {mt.max_turns}")
    _check_id(f"{field}.environment", mt.environment)
    return MultiTurnSpec(max_turns=mt.max_turns, max_total_tokens=mt.max_total_tokens, environment=mt.environment)


@dataclass(slots=True, frozen=True)
class Continuation:
    sample_id: str
    turn: int
    observation_token_ids: list[int]
    done: bool


def continue_request(req: pb.ContinueRequest, limits: ModelLimits, tokenizer: Tokenizer | None) -> Continuation:
    """A trainer's answer to a turn event: the observation as token ids or
    text (tokenized here), or done. Whether it fits the trajectory is the
    core's to check."""
    if not req.sample_id:
        raise FieldError("sample_id", "must not be empty")
    _check_id("sample_id", req.sample_id)
    if req.observation_token_ids and req.observation_text:
        raise FieldError("observation_text", "set observation_token_ids or observation_text, not both")
    if req.done and (req.observation_token_ids or req.observation_text):
        field = "observation_token_ids" if req.observation_token_ids else "observation_text"
        raise FieldError(field, "must be empty with done: a finished trajectory takes no observation")
    if req.observation_text:
        _check_text("observation_text", req.observation_text)
        if tokenizer is None:
            raise FieldError("observation_text", "this server has no tokenizer; send observation_token_ids")
        observation = list(tokenizer.encode(req.observation_text, add_special_tokens=False))
    else:
        observation = list(req.observation_token_ids)
        if len(observation) >= limits.max_model_len:
            raise FieldError("observation_token_ids", f"{len(observation)} tokens must be fewer than max_model_len "
                             f"{limits.max_model_len}")
        _check_tokens("observation_token_ids", observation, limits.vocab_size)
    return Continuation(req.sample_id, req.turn, observation, req.done)


async def submit_request_off_loop(req: pb.SubmitRequest, limits: ModelLimits,
                                  tokenizer: Tokenizer | None) -> list[GroupSpec]:
    """`submit_request`, in a worker thread when the request carries more
    than INLINE_PROMPT_TEXTS prompt texts to tokenise (a few run inline:
    a thread hop costs more than they do), or more than INLINE_PROMPT_UNITS
    characters and token ids in all."""
    if len(req.groups) > limits.max_groups_per_submit:
        return submit_request(req, limits, tokenizer)  # refused before any prompt is read
    texts = sum(1 for g in req.groups if g.prompt_text) if tokenizer is not None else 0
    units = sum(len(g.prompt_text) + len(g.prompt_token_ids) for g in req.groups)
    if texts > INLINE_PROMPT_TEXTS or units > INLINE_PROMPT_UNITS:
        return await asyncio.to_thread(submit_request, req, limits, tokenizer)
    return submit_request(req, limits, tokenizer)


async def continue_request_off_loop(req: pb.ContinueRequest, limits: ModelLimits,
                                    tokenizer: Tokenizer | None) -> Continuation:
    """`continue_request`, in a worker thread for an observation over
    INLINE_PROMPT_UNITS characters or token ids."""
    if len(req.observation_text) + len(req.observation_token_ids) > INLINE_PROMPT_UNITS:
        return await asyncio.to_thread(continue_request, req, limits, tokenizer)
    return continue_request(req, limits, tokenizer)


def consumer_id(field: str, value: str) -> str:
    if not value:
        raise FieldError(field, "must not be empty")
    _check_id(field, value)
    return value


def abort_request(req: pb.AbortRequest) -> None:
    if not (req.group_ids or req.batch_id or req.all):
        raise FieldError("group_ids", "name at least one group, a batch_id, or set all")
    if len(req.group_ids) > MAX_ABORT_GROUP_IDS:
        raise FieldError("group_ids", f"at most {MAX_ABORT_GROUP_IDS} group ids, got {len(req.group_ids)}")
    _check_id("batch_id", req.batch_id)
    for i, g in enumerate(req.group_ids):
        if not g:
            raise FieldError(f"group_ids[{i}]", "must not be empty")
        _check_id(f"group_ids[{i}]", g)
