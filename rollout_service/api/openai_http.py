"""OpenAI-compatible completions on the side server, for agentic RL harnesses.

`POST /v1/completions` and `POST /v1/chat/completions` (prompt as text or
token ids, or for completions a batch of them, `n`, `logprobs` and for chat
`top_logprobs`, `max_tokens`, `temperature`, `top_p`, `top_k`, `seed`,
`stop`, `min_tokens`, `ignore_eos`, `stream`, `stream_options.include_usage`)
run on the same engines and policies as gRPC rollouts; every response names
the policy version(s) that produced it (`policy_version`, and per choice
`policy_versions` as version segments). vLLM's extensions `return_token_ids`
(the prompt's ids with the choices), `return_tokens_as_token_ids` (logprob
tokens as "token_id:<id>"), `stop_token_ids` and `include_stop_str_in_output`
are honoured, so vLLM clients read the answers unchanged.

Every key of a request is either honoured or refused: an unknown key, or a
known one this server does not implement (at other than its neutral value),
gets 400 with an OpenAI-style JSON error naming it, as does a malformed
field. `X-Session-Id` (header) or `user` is the request's session key, kept
in the group's metadata as `session_id` for the scheduler's affinity.

A request ends with its groups: a gRPC `Abort` that covers them, a client
that disconnects (the server cancels its handler) and `http_request_timeout_s`
all abort them; what was generated is answered with finish reason "abort".
Bodies over INLINE_BODY_BYTES are parsed, tokenized and checked in a thread.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import time
import uuid

from aiohttp import web

from rollout_service.api.validation import (MAX_ID_CHARS, MAX_SEED, MAX_STOP_CHARS, MAX_STOP_STRINGS,
                                            MAX_STOP_TOKEN_IDS, MAX_TEMPERATURE, MAX_TEXT_CHARS, ModelLimits)
from rollout_service.core.rollout import CoreError, RolloutCore
from rollout_service.engines.types import FinishReason, SamplingParams
from rollout_service.lifecycle.types import CACHE_SALT_KEY, DeltaEvent, GroupSpec, Sample, SampleEvent
from rollout_service.scheduling.affinity import SESSION_KEY

# FinishReason -> OpenAI's finish_reason.
FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORTED: "abort"}
# Settings the engines do not implement: accepted at their neutral value(s) only.
_NEUTRAL = {"min_p": (0.0,), "repetition_penalty": (1.0,), "presence_penalty": (0.0,),
            "frequency_penalty": (0.0,), "structured_outputs": (None,), "prompt_logprobs": (None,),
            "logit_bias": (None, {}), "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1),
            "response_format": (None, {"type": "text"}), "parallel_tool_calls": (None,)}
# Keys each endpoint honours (besides _NEUTRAL's); anything else is a 400.
_COMMON_KEYS = {"model", "n", "max_tokens", "temperature", "top_p", "top_k", "seed", "stream", "stream_options",
                "logprobs", "stop", "stop_token_ids", "include_stop_str_in_output", "min_tokens", "ignore_eos",
                "user", "return_token_ids", "return_tokens_as_token_ids", "cache_salt"}
_COMPLETION_KEYS = _COMMON_KEYS | {"prompt"}
_CHAT_KEYS = _COMMON_KEYS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice"}
# Known OpenAI / vLLM request keys that are not implemented: "unsupported", not "unknown".
_UNSUPPORTED = {"functions", "function_call", "audio", "modalities", "prediction", "reasoning_effort",
                "service_tier", "store", "metadata", "web_search_options", "verbosity", "use_beam_search",
                "length_penalty", "allowed_token_ids", "bad_words", "guided_json", "guided_regex",
                "guided_choice", "guided_grammar", "guided_decoding_backend", "skip_special_tokens",
                "spaces_between_special_tokens", "truncate_prompt_tokens", "add_special_tokens",
                "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs",
                "documents", "priority", "request_id", "logits_processors", "vllm_xargs",
                "kv_transfer_params", "prompt_embeds", "echo", "suffix", "logit_bias", "best_of",
                "response_format", "parallel_tool_calls"} | set(_NEUTRAL)
SESSION_HEADER = "X-Session-Id"
# A request body larger than this is parsed, tokenized and checked off the
# event loop (a thread hop costs more than a small prompt's checks).
INLINE_BODY_BYTES = 64 * 1024
# After its groups were aborted, a request waits at most this long for their
# last events (they are queued by the abort itself).
ABORT_DRAIN_S = 5.0
MAX_BODY_BYTES = 16 * 2**20  # largest HTTP request body (the side server's client_max_size)


async def read_body(request: web.Request) -> bytes:
    """The request's body; BadRequest past MAX_BODY_BYTES."""
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise BadRequest("body", f"must be at most {MAX_BODY_BYTES} bytes, got {request.content_length}") from None


_TRUE = {"1", "true", "t", "yes", "y", "on"}
_FALSE = {"0", "false", "f", "no", "n", "off"}


def query_flag(request: web.Request, name: str, default: bool) -> bool:
    """A boolean query parameter as FastAPI reads it ("true", "0", "yes",
    ...); BadRequest naming it otherwise."""
    value = request.query.get(name)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise BadRequest(name, f"must be a boolean, got {_short(value)}")


MAX_CACHE_SALT_CHARS = 1024  # vLLM's limit


def cache_salt(body: dict) -> str | None:
    """The request's `cache_salt` (vLLM: 1-1024 characters); BadRequest naming it."""
    salt = body.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT_CHARS):
        raise BadRequest("cache_salt", f"must be a string of 1-{MAX_CACHE_SALT_CHARS} characters, got {_short(salt)}")
    return salt


class BadRequest(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def error_response(status: int, message: str, param: str | None = None,
                   kind: str = "invalid_request_error") -> web.Response:
    """vLLM's (OpenAI-shaped) JSON error: `param` names the offending field,
    `code` is the HTTP status (vLLM's `ErrorResponse`)."""
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": status}},
                             status=status)


def _number(body: dict, key: str, default, lo: float, hi: float, integer: bool = False, lo_open: bool = False):
    value = body.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            integer and isinstance(value, float) and not value.is_integer()):
        raise BadRequest(key, f"must be a{'n integer' if integer else ' number'}, got {_short(value)}")
    # Compared as given: an integer too large for a float (10**400) is out of range, not an overflow.
    if (isinstance(value, float) and not math.isfinite(value)) or value > hi or value < lo or (lo_open and value == lo):
        bracket = "(" if lo_open else "["
        raise BadRequest(key, f"must be in {bracket}{lo}, {hi}], got {_short(value)}")
    return int(value) if integer else float(value)


def _short(value, limit: int = 80) -> str:
    """`repr(value)`, cut to `limit` characters (an error message never echoes a huge value)."""
    big = isinstance(value, int) and value.bit_length() > 200
    text = f"an integer of {value.bit_length()} bits" if big else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _is_neutral(value, options) -> bool:
    return any(value == o and isinstance(value, bool) == isinstance(o, bool) for o in options)


def check_keys(body: dict, allowed: set[str]) -> None:
    """BadRequest naming the first key that is neither honoured nor at a
    neutral value of an unimplemented setting."""
    for key, value in body.items():
        if key in allowed:
            continue
        if key in _NEUTRAL and _is_neutral(value, _NEUTRAL[key]):
            continue
        if key in _UNSUPPORTED:
            raise BadRequest(key, f"unsupported parameter {key!r}: this server does not implement it"
                             + (f" (only {_NEUTRAL[key][-1]!r})" if key in _NEUTRAL else "") + f", got {_short(value)}")
        raise BadRequest(key, f"unknown parameter {key!r}")


def find_stop(text: str, stops, start: int = 0) -> tuple[int, str] | None:
    """(index, string) of the stop string that completes earliest in
    `text[start:]` (vLLM's rule), or None."""
    best = None
    for stop in stops:
        i = text.find(stop, start)
        if i >= 0 and (best is None or i + len(stop) < best[0] + len(best[1])):
            best = (i, stop)
    return best


class ResponseText:
    """A choice's text from its tokens (the service's tokens are the truth),
    cut before the first stop string (after `min_tokens` tokens, like vLLM)
    unless `include_stop`; `push` returns the text safe to stream so far
    (holding back what could be the start of a stop string, or an
    incomplete character), `finish` the rest.

    Decoding is incremental (vLLM's two offsets): each push decodes the new
    tokens after a window of the tokens before them, so a response costs
    time linear in its length, and the text is the full decode's."""

    def __init__(self, decode, stops: tuple[str, ...] = (), include_stop: bool = False, min_tokens: int = 0) -> None:
        self.decode = decode
        self.stops = stops
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self.ids: list[int] = []
        self.full = ""  # the decode of ids[:self._read]
        self._prefix = 0  # ids[_prefix:_read]: context for decoding what follows
        self._read = 0
        self._stop_start: int | None = None  # where a stop string may begin (after min_tokens tokens)
        self._searched = 0  # len(full) at the last stop search
        self.sent = 0
        self.stop_reason: str | None = None  # the stop string the text was cut at

    @property
    def text(self) -> str:
        """The text sent so far."""
        return self.full[:self.sent]

    def _decode_new(self, final: bool) -> None:
        """Extend `full` with the new tokens' text, unless it ends in an
        incomplete character (and more may come)."""
        if self._read == len(self.ids):
            return
        before = self.decode(self.ids[self._prefix:self._read])
        after = self.decode(self.ids[self._prefix:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.full += after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)

    def push(self, ids: list[int], final: bool = False) -> str:
        self.ids += ids
        if self.stop_reason is not None:
            return ""
        self._decode_new(final)
        full = self.full
        hit = None
        if self.stops and len(self.ids) >= self.min_tokens:
            if self._stop_start is None:
                self._stop_start = len(self.decode(self.ids[:self.min_tokens])) if self.min_tokens else 0
            longest = max(map(len, self.stops))
            hit = find_stop(full, self.stops, max(self._stop_start, self._searched - longest + 1))
            self._searched = len(full)
        if hit is not None:
            end = hit[0] + (len(hit[1]) if self.include_stop else 0)
            self.stop_reason = hit[1]
            final = True
        else:
            end = len(full)
            if not final:
                if self.stops and not self.include_stop:
                    end -= max(map(len, self.stops)) - 1
                while end > self.sent and full[end - 1] == "\ufffd":
                    end -= 1
        out = full[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out

    def finish(self) -> str:
        return self.push([], final=True)


class OpenAIFrontEnd:
    def __init__(self, core: RolloutCore, limits: ModelLimits, tokenizer, model_name: str,
                 request_timeout_s: float = 1800.0) -> None:
        self.core = core
        self.limits = limits
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.request_timeout_s = request_timeout_s  # seconds a request's groups may run before they are aborted
        self.inflight: dict[str, list[str]] = {}  # request id -> its group ids, while it runs (/abort_requests)
        self.version_labels: dict[int, str] = {}  # policy version -> vLLM weight-version label (str(version) if none)

    def version_label(self, version: int) -> str:
        return self.version_labels.get(version, str(version))

    @contextlib.contextmanager
    def tracking(self, request_ids: list[str], groups: list):
        """Name a request's groups by its ids (vLLM's external request ids)
        while the block runs."""
        ids = [g.group_id for g in groups]
        for rid in request_ids:
            self.inflight[rid] = ids
        try:
            yield
        finally:
            for rid in request_ids:
                if self.inflight.get(rid) is ids:
                    del self.inflight[rid]

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rollout-service",
             "max_model_len": self.limits.max_model_len}]})

    # -- request parsing ---------------------------------------------------------

    async def parse_body(self, request: web.Request) -> dict:
        """The request's JSON object; BadRequest when it is not one, or names
        another model than the one served."""
        return self.parse_raw(await read_body(request))

    def parse_raw(self, raw: bytes) -> dict:
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON or UTF-8, a number past Python's digit limit, too deep
            raise BadRequest("body", "must be a JSON object") from None
        if not isinstance(body, dict):
            raise BadRequest("body", "must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise BadRequest("model", f"this server serves {self.model_name!r}, got {_short(model)}")
        return body

    def _encode(self, text: str) -> list[int]:
        if len(text) > MAX_TEXT_CHARS:
            raise BadRequest("prompt", f"at most {MAX_TEXT_CHARS} characters, got {len(text)}")
        if self.tokenizer is None:
            raise BadRequest("prompt", "this server has no tokenizer; send token ids")
        return list(self.tokenizer.encode(text))

    def prompt_ids(self, prompt) -> list[int]:
        """One prompt (text, or token ids checked against the vocabulary) as
        token ids, shorter than max_model_len; BadRequest naming `prompt`."""
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = self._encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            if ids and not 0 <= min(ids) <= max(ids) < self.limits.vocab_size:
                bad = next(t for t in ids if not 0 <= t < self.limits.vocab_size)
                raise BadRequest("prompt", f"token id {bad} is outside [0, {self.limits.vocab_size - 1}]")
        else:
            raise BadRequest("prompt", "must be a string or a list of token ids (one prompt per request)")
        if not ids:
            raise BadRequest("prompt", "must not be empty")
        if len(ids) >= self.limits.max_model_len:
            raise BadRequest("prompt", f"{len(ids)} tokens; must be shorter than {self.limits.max_model_len}")
        return ids

    def _prompt_batch(self, prompt) -> list[list[int]]:
        """A completions prompt: one (text or token ids) or a list of them."""
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            if len(prompt) > self.limits.max_groups_per_submit:
                raise BadRequest("prompt", f"{len(prompt)} prompts; at most {self.limits.max_groups_per_submit}")
            return [self.prompt_ids(p) for p in prompt]
        return [self.prompt_ids(prompt)]

    def _chat_prompt(self, messages, tools=None) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages", "must be a non-empty list of {role, content} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}]", "must be an object with string 'role' and 'content'")
        chars = sum(len(m["content"]) for m in messages)
        if chars > MAX_TEXT_CHARS:
            raise BadRequest("messages", f"at most {MAX_TEXT_CHARS} characters of content, got {chars}")
        tok = self.tokenizer
        if tok is not None and getattr(tok, "chat_template", None):
            extra = {"tools": tools} if tools else {}
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # newer transformers return an encoding
                ids = ids["input_ids"]
            return self.prompt_ids(list(ids))
        # No chat template (e.g. the tiny reasoner): the conversation's text, in order.
        return self.prompt_ids("".join(m["content"] for m in messages))

    def supports_tools(self) -> bool:
        """Whether the model's chat template renders `tools`."""
        template = getattr(self.tokenizer, "chat_template", None) if self.tokenizer is not None else None
        if isinstance(template, dict):
            template = " ".join(map(str, template.values()))
        return bool(template) and "tools" in template

    def chat_tools(self, body: dict):
        """The request's `tools` for the chat template (None without any);
        BadRequest naming `tools` or `tool_choice` where the model's chat
        template does not support them. Tool calls come back in the message
        content as the model wrote them (no tool-call parser)."""
        tools = body.get("tools")
        choice = body.get("tool_choice")
        if tools is None or tools == []:
            if choice not in (None, "none"):
                raise BadRequest("tool_choice", f"needs 'tools', got {_short(choice)}")
            return None
        if not self.supports_tools():
            raise BadRequest("tools", f"unsupported parameter 'tools': the chat template of {self.model_name!r} "
                             "does not support tools")
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise BadRequest("tools", "must be a list of tool objects")
        if choice not in (None, "none", "auto"):
            raise BadRequest("tool_choice", f"only 'auto' or 'none' (no constrained decoding), got {_short(choice)}")
        return None if choice == "none" else tools

    def _stops(self, body: dict) -> tuple[tuple[str, ...], tuple[int, ...]]:
        stop = body.get("stop")
        if stop is None:
            stops: tuple[str, ...] = ()
        elif isinstance(stop, str):
            stops = (stop,)
        elif isinstance(stop, list) and all(isinstance(x, str) for x in stop):
            stops = tuple(stop)
        else:
            raise BadRequest("stop", f"must be a string or a list of strings, got {_short(stop)}")
        if len(stops) > MAX_STOP_STRINGS or any(not 1 <= len(x) <= MAX_STOP_CHARS for x in stops):
            raise BadRequest("stop", f"at most {MAX_STOP_STRINGS} strings of 1-{MAX_STOP_CHARS} characters, "
                             f"got {_short(stop)}")
        ids = body.get("stop_token_ids")
        if ids is None:
            ids = []
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise BadRequest("stop_token_ids", f"must be a list of token ids, got {_short(ids)}")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise BadRequest("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} token ids, got {len(ids)}")
        bad = [t for t in ids if not 0 <= t < self.limits.vocab_size]
        if bad:
            raise BadRequest("stop_token_ids", f"token id {bad[0]} is outside [0, {self.limits.vocab_size - 1}]")
        if (stops or ids) and self._simulated():
            param = "stop" if stops else "stop_token_ids"
            raise BadRequest(param, "stop strings and stop token ids need vLLM engines; this server's engines "
                             "are simulated (they generate no text)")
        return stops, tuple(ids)

    def _simulated(self) -> bool:
        return any(getattr(e, "kind", "") == "sim" for e in self.core.engines.values())

    @staticmethod
    def _flag(body: dict, key: str) -> bool:
        value = body.get(key, False)
        if value is None:
            return False
        if not isinstance(value, bool):
            raise BadRequest(key, f"must be a boolean, got {_short(value)}")
        return value

    def group_spec(self, body: dict, prompt: list[int], chat: bool = False) -> tuple[GroupSpec, bool]:
        """A private group for `prompt` from the request's sampling fields
        (`n`, `max_tokens`, `temperature`, ...), and whether logprobs are
        wanted (`sampling.logprobs` is the top alternatives asked for);
        BadRequest naming the field."""
        budget = self.limits.max_model_len - len(prompt)
        n = _number(body, "n", 1, 1, 128, integer=True)
        max_tokens = _number(body, "max_tokens", min(256, budget), 1, budget, integer=True)
        if "max_completion_tokens" in body:
            max_tokens = _number(body, "max_completion_tokens", max_tokens, 1, budget, integer=True)
        temperature = _number(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE)
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
        top_k = _number(body, "top_k", -1, -1, self.limits.vocab_size, integer=True)  # 0 or -1: all tokens
        for key, neutral in _NEUTRAL.items():
            if key in body and not _is_neutral(body[key], neutral):
                raise BadRequest(key, f"unsupported parameter {key!r}: this server does not implement it "
                                 f"(only {neutral[-1]!r}), got {_short(body[key])}")
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED):
            raise BadRequest("seed", f"must be an integer in [0, {MAX_SEED}], got {_short(seed)}")
        min_tokens = _number(body, "min_tokens", 0, 0, max_tokens, integer=True)
        ignore_eos = self._flag(body, "ignore_eos")
        self._flag(body, "include_stop_str_in_output")
        stops, stop_ids = self._stops(body)
        # Chat sends a boolean and `top_logprobs` (alternatives), completions
        # an integer (alternatives besides the sampled token, as vLLM).
        logprobs = body.get("logprobs")
        if chat:
            want = self._flag(body, "logprobs")
            top = _number(body, "top_logprobs", 0, 0, 20, integer=True)
            if top and not want:
                raise BadRequest("top_logprobs", "needs 'logprobs': true")
        else:
            top = 0
            if logprobs is not None and not isinstance(logprobs, bool):
                top = _number(body, "logprobs", 0, 0, 20, integer=True)
            want = logprobs is not None and logprobs is not False
        sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                  top_k=top_k if top_k > 0 else -1, seed=seed, stop=stops, stop_token_ids=stop_ids,
                                  min_tokens=min_tokens, ignore_eos=ignore_eos, logprobs=top if want else 0)
        spec = GroupSpec("", prompt, n, sampling)
        return spec, want

    def session_id(self, request: web.Request, body: dict) -> str | None:
        """The session key: the `X-Session-Id` header, else `user`."""
        sid = request.headers.get(SESSION_HEADER)
        param = SESSION_HEADER
        if sid is None:
            sid, param = body.get("user"), "user"
        if sid is None:
            return None
        if not isinstance(sid, str) or not 0 < len(sid) <= MAX_ID_CHARS:
            raise BadRequest(param, f"must be a non-empty string of at most {MAX_ID_CHARS} characters, "
                             f"got {_short(sid)}")
        return sid

    # -- endpoints ---------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def off_loop(self, request: web.Request, parse):
        """`parse(raw body)`, in a thread when the body is large (tokenizing
        and checking a long prompt would block the event loop)."""
        raw = await read_body(request)
        if len(raw) > INLINE_BODY_BYTES:
            return await asyncio.to_thread(parse, raw)
        return parse(raw)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body, prompts, specs, stream, include_usage = await self.off_loop(
                request, lambda raw: self._parse(request, raw, chat))
        except BadRequest as exc:
            return error_response(400, str(exc), exc.param)
        return await self._run(request, chat, body, prompts, specs, stream, include_usage)

    def _parse(self, request: web.Request, raw: bytes, chat: bool):
        """A completions request's body, prompts (token ids), group specs,
        `stream` and `include_usage`; BadRequest naming the field."""
        body = self.parse_raw(raw)
        check_keys(body, _CHAT_KEYS if chat else _COMPLETION_KEYS)
        if chat:
            prompts = [self._chat_prompt(body.get("messages"), self.chat_tools(body))]
        else:
            if "prompt" not in body:
                raise BadRequest("prompt", "is required")
            prompts = self._prompt_batch(body["prompt"])
        specs = [self.group_spec(body, p, chat) for p in prompts]
        stream = body.get("stream", False)
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise BadRequest("stream", f"must be a boolean, got {_short(stream)}")
        if stream and len(prompts) > 1:
            raise BadRequest("stream", "streams one prompt per request")
        include_usage = self._stream_options(body, stream)
        session = self.session_id(request, body)
        salt = cache_salt(body)
        for spec, _ in specs:
            if session is not None:
                spec.metadata[SESSION_KEY] = session
            if salt is not None:
                spec.metadata[CACHE_SALT_KEY] = salt
        return body, prompts, specs, stream, include_usage

    async def _run(self, request: web.Request, chat: bool, body: dict, prompts, specs, stream: bool,
                   include_usage: bool) -> web.StreamResponse:
        want_logprobs = specs[0][1]
        groups = []
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        include_stop = body.get("include_stop_str_in_output") is True
        ids_only = body.get("return_tokens_as_token_ids") is True
        try:
            try:
                for spec, _ in specs:
                    groups.append(self.core.submit_private(spec))
            except CoreError as exc:
                return error_response(429 if exc.code == "exhausted" else 400, str(exc), kind="server_overloaded")
            self.inflight[rid] = [g.group_id for g in groups]
            if stream:
                return await self._stream(request, groups[0], rid, created, chat, want_logprobs, include_usage,
                                          include_stop, ids_only)
            tops = [{} for _ in groups]
            results = await asyncio.gather(*(self.collect(g, t) for g, t in zip(groups, tops)))
            with_prompt = body.get("return_token_ids") is True and not chat
            choices = [self._choice(s, chat, want_logprobs, ids_only, i * len(samples) + s.index, with_prompt,
                                    sampling=groups[i].spec.sampling, include_stop=include_stop,
                                    tops=tops[i].get(s.index))
                       for i, samples in enumerate(results) for s in samples]
            completion_tokens = sum(len(s.response_token_ids) for samples in results for s in samples)
            usage = {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": completion_tokens}
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            response = {
                "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": self.model_name, "choices": choices, "usage": usage,
                "policy_version": max(s.versions.max_version for samples in results for s in samples),
            }
            if chat and body.get("return_token_ids") is True:
                response["prompt_token_ids"] = prompts[0]
            return web.json_response(response)
        finally:
            self.inflight.pop(rid, None)
            live = [g.group_id for g in groups if g.group_id in self.core.groups]
            if live:  # the client went away (cancelled), or an error: free the engines
                await self.core.abort(live)

    @staticmethod
    def _stream_options(body: dict, stream: bool) -> bool:
        """Whether a final usage chunk is wanted; BadRequest naming the field."""
        options = body.get("stream_options")
        if options is None:
            return False
        if not stream:
            raise BadRequest("stream_options", "is only allowed with 'stream': true")
        if not isinstance(options, dict):
            raise BadRequest("stream_options", f"must be an object, got {_short(options)}")
        for key in options:
            if key != "include_usage" and not (key == "continuous_usage_stats" and options[key] in (None, False)):
                raise BadRequest(f"stream_options.{key}", f"unsupported parameter 'stream_options.{key}'")
        usage = options.get("include_usage", False)
        if usage is None:
            usage = False
        if not isinstance(usage, bool):
            raise BadRequest("stream_options.include_usage", f"must be a boolean, got {_short(usage)}")
        return usage

    async def events(self, group):
        """The events of a group from `core.submit_private` until its last
        sample. Past `request_timeout_s` the group is aborted: its unfinished
        samples end with finish reason ABORTED."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout_s
        left = group.spec.num_samples
        while left:
            try:
                async with asyncio.timeout_at(deadline):
                    event = await group.listener.get()
            except TimeoutError:
                if deadline > loop.time() + ABORT_DRAIN_S / 2 or group.group_id not in self.core.groups:
                    raise  # aborted already and still no events: the core lost them
                deadline = loop.time() + ABORT_DRAIN_S
                await self.core.abort([group.group_id])  # queues every unfinished sample, aborted
                continue
            left -= isinstance(event, SampleEvent)
            yield event

    async def collect(self, group, tops: dict | None = None) -> list[Sample]:
        """Every sample of a group from `core.submit_private`, in index order
        (see `events`); `tops`, when given, gets each sample's per-token
        alternatives (index -> list, None where an engine reported none)."""
        samples: list[Sample] = []
        async for event in self.events(group):
            if isinstance(event, SampleEvent):
                samples.append(event.sample)
            elif tops is not None and event.delta.token_ids:
                d = event.delta
                tops.setdefault(event.index, []).extend(d.top_logprobs or [None] * len(d.token_ids))
        return sorted(samples, key=lambda s: s.index)

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def _token(self, t: int, ids_only: bool) -> str:
        return f"token_id:{t}" if ids_only else self._text([t])

    def _logprobs(self, ids: list[int], logprobs: list[float], chat: bool, ids_only: bool = False,
                  alternatives: int = 0, tops: list | None = None, offset: int = 0) -> dict:
        """Logprobs as vLLM returns them: per token the sampled one, and its
        alternatives in vLLM's order (the sampled token first, then the top
        ones by rank): chat lists the first `top_logprobs` of them,
        completions maps the first `logprobs` + 1, with each token's
        `text_offset` (characters of the tokens before it, from `offset`).
        Where an engine reported no alternatives (simulated engines) only
        the sampled token is known."""
        tokens = [self._token(t, ids_only) for t in ids]
        lps = [max(lp, -9999.0) for lp in logprobs]
        tops = list(tops or [])
        tops = [tops[i] if i < len(tops) and tops[i] else [(t, lp)] for i, (t, lp) in enumerate(zip(ids, lps))]
        if chat:
            def entry(token: str, lp: float) -> dict:
                return {"token": token, "logprob": max(lp, -9999.0), "bytes": list(token.encode(errors="replace"))}
            return {"content": [{**entry(tok, lp),
                                 "top_logprobs": [entry(self._token(a, ids_only), alp) for a, alp in top[:alternatives]]}
                                for tok, lp, top in zip(tokens, lps, tops)]}
        return {"tokens": tokens, "token_logprobs": lps,
                "top_logprobs": [{self._token(a, ids_only): max(alp, -9999.0) for a, alp in top[:alternatives + 1]}
                                 for top in tops],
                "text_offset": list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset))[:len(tokens)]}

    def _choice(self, s: Sample, chat: bool, want_logprobs: bool, ids_only: bool = False, index: int | None = None,
                with_prompt: bool = False, sampling: SamplingParams | None = None, include_stop: bool = False,
                tops: list | None = None) -> dict:
        sampling = sampling or SamplingParams(max_tokens=1)
        text = ResponseText(self._text, sampling.stop, include_stop, sampling.min_tokens)
        text.push(s.response_token_ids, final=True)
        finish = "stop" if text.stop_reason is not None else FINISH_REASONS.get(s.finish_reason, "stop")
        choice = {
            "index": s.index if index is None else index,
            "finish_reason": finish,
            "stop_reason": text.stop_reason,
            "logprobs": (self._logprobs(s.response_token_ids, s.logprobs, chat, ids_only, sampling.logprobs, tops)
                         if want_logprobs else None),
            "token_ids": s.response_token_ids,
            "policy_versions": [{"version": v, "start": a, "length": n} for v, a, n in s.versions.segments],
        }
        if with_prompt:
            choice["prompt_token_ids"] = s.prompt_token_ids
        if chat:
            choice["message"] = {"role": "assistant", "content": text.text}
        else:
            choice["text"] = text.text
        return choice

    async def _stream(self, request, group, rid, created, chat, want_logprobs, include_usage=False,
                      include_stop=False, ids_only=False) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        sampling = group.spec.sampling

        async def send(choices: list[dict], version: int, usage: dict | None = None) -> None:
            chunk = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": choices,
                     "policy_version": version}
            if include_usage:
                chunk["usage"] = usage
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())

        def content(choice: dict, piece: str) -> dict:
            if chat:
                choice["delta"] = {"content": piece} if piece else {}
            else:
                choice["text"] = piece
            return choice

        texts = [ResponseText(self._text, sampling.stop, include_stop, sampling.min_tokens)
                 for _ in range(group.spec.num_samples)]
        if chat:
            for i in range(group.spec.num_samples):
                await send([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
                           self.core.policy_version)
        prompt_tokens = len(group.spec.prompt_token_ids)
        completion_tokens = 0
        offsets = [0] * group.spec.num_samples  # characters of the tokens streamed so far (logprobs' text_offset)
        async for event in self.events(group):
            if isinstance(event, DeltaEvent):
                index, delta = event.index, event.delta
                if not delta.token_ids:
                    continue
                piece = texts[index].push(delta.token_ids)
                logprobs = (self._logprobs(delta.token_ids, delta.logprobs, chat, ids_only, sampling.logprobs,
                                           delta.top_logprobs, offsets[index]) if want_logprobs else None)
                if logprobs is not None and not chat:
                    offsets[index] += sum(len(t) for t in logprobs["tokens"])
                await send([content({"index": index, "finish_reason": None, "token_ids": delta.token_ids,
                                     "logprobs": logprobs}, piece)], delta.version)
            elif isinstance(event, SampleEvent):
                s = event.sample
                completion_tokens += len(s.response_token_ids)
                text = texts[s.index]
                piece = text.finish()
                finish = "stop" if text.stop_reason is not None else FINISH_REASONS.get(s.finish_reason, "stop")
                final = {"index": s.index, "finish_reason": finish, "stop_reason": text.stop_reason, "logprobs": None}
                await send([content(final, piece)], s.versions.max_version)
        if include_usage:
            await send([], self.core.policy_version, {"prompt_tokens": prompt_tokens,
                                                      "completion_tokens": completion_tokens,
                                                      "total_tokens": prompt_tokens + completion_tokens})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
