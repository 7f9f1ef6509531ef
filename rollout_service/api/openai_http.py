"""OpenAI-compatible completions on the side server, for agentic RL harnesses.

`POST /v1/completions` and `POST /v1/chat/completions` (prompt as text or
token ids, or for completions a batch of them, `n`, `logprobs`, `max_tokens`,
`temperature`, `top_p`, `top_k`, `seed`, `stream`) run on the same engines
and policies as gRPC rollouts; every response names the policy version(s)
that produced it (`policy_version`, and per choice `policy_versions` as
version segments). vLLM's extensions `return_token_ids` (the prompt's ids
with the choices) and `return_tokens_as_token_ids` (logprob tokens as
"token_id:<id>") are honoured, so vLLM clients read the answers unchanged.
Malformed requests get 400 with an OpenAI-style JSON error naming the field.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
import uuid

from aiohttp import web

from rollout_service.api.validation import ModelLimits
from rollout_service.core.rollout import CoreError, RolloutCore
from rollout_service.engines.types import FinishReason, SamplingParams
from rollout_service.lifecycle.types import DeltaEvent, GroupSpec, Sample, SampleEvent

# FinishReason -> OpenAI's finish_reason.
FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORTED: "abort"}
# Sampling settings the engines do not implement: accepted at their neutral value only.
_NEUTRAL = {"min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "structured_outputs": None, "prompt_logprobs": None}


class BadRequest(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def error_response(status: int, message: str, param: str | None = None,
                   kind: str = "invalid_request_error") -> web.Response:
    """An OpenAI-shaped JSON error: `param` names the offending field."""
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": None}}, status=status)


def _number(body: dict, key: str, default, lo: float, hi: float, integer: bool = False, lo_open: bool = False):
    value = body.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not float(value).is_integer()):
        raise BadRequest(key, f"must be a{'n integer' if integer else ' number'}, got {value!r}")
    if not math.isfinite(value) or value > hi or value < lo or (lo_open and value == lo):
        bracket = "(" if lo_open else "["
        raise BadRequest(key, f"must be in {bracket}{lo}, {hi}], got {value!r}")
    return int(value) if integer else float(value)


class OpenAIFrontEnd:
    def __init__(self, core: RolloutCore, limits: ModelLimits, tokenizer, model_name: str) -> None:
        self.core = core
        self.limits = limits
        self.tokenizer = tokenizer
        self.model_name = model_name

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
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BadRequest("body", "must be a JSON object") from None
        if not isinstance(body, dict):
            raise BadRequest("body", "must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise BadRequest("model", f"this server serves {self.model_name!r}, got {model!r}")
        return body

    def _encode(self, text: str) -> list[int]:
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
            bad = [t for t in ids if not 0 <= t < self.limits.vocab_size]
            if bad:
                raise BadRequest("prompt", f"token id {bad[0]} is outside [0, {self.limits.vocab_size - 1}]")
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

    def _chat_prompt(self, messages) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages", "must be a non-empty list of {role, content} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}]", "must be an object with string 'role' and 'content'")
        tok = self.tokenizer
        if tok is not None and getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return self.prompt_ids(list(ids))
        # No chat template (e.g. the tiny reasoner): the conversation's text, in order.
        return self.prompt_ids("".join(m["content"] for m in messages))

    def group_spec(self, body: dict, prompt: list[int]) -> tuple[GroupSpec, bool]:
        """A private group for `prompt` from the request's sampling fields
        (`n`, `max_tokens`, `temperature`, ...), and whether logprobs are
        wanted; BadRequest naming the field."""
        budget = self.limits.max_model_len - len(prompt)
        n = _number(body, "n", 1, 1, 128, integer=True)
        max_tokens = _number(body, "max_tokens", min(256, budget), 1, budget, integer=True)
        if "max_completion_tokens" in body:
            max_tokens = _number(body, "max_completion_tokens", max_tokens, 1, budget, integer=True)
        temperature = _number(body, "temperature", 1.0, 0.0, 100.0)
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
        top_k = _number(body, "top_k", -1, -1, self.limits.vocab_size, integer=True)  # 0 or -1: all tokens
        for key, neutral in _NEUTRAL.items():
            if body.get(key) is not None and body[key] != neutral:
                raise BadRequest(key, f"is not supported by this server (only {neutral!r}), got {body[key]!r}")
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
            raise BadRequest("seed", f"must be a non-negative integer, got {seed!r}")
        # Chat sends a boolean, completions an integer (top alternatives; only
        # the sampled token's logprob is returned).
        logprobs = body.get("logprobs")
        if logprobs is not None and not isinstance(logprobs, bool):
            logprobs = _number(body, "logprobs", 0, 0, 20, integer=True)
        want = logprobs is not None and logprobs is not False
        sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                  top_k=top_k if top_k > 0 else -1, seed=seed)
        spec = GroupSpec("", prompt, n, sampling)
        return spec, want

    # -- endpoints ---------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await self.parse_body(request)
            if chat:
                prompts = [self._chat_prompt(body.get("messages"))]
            else:
                if "prompt" not in body:
                    raise BadRequest("prompt", "is required")
                prompts = self._prompt_batch(body["prompt"])
            specs = [self.group_spec(body, p) for p in prompts]
            want_logprobs = specs[0][1]
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise BadRequest("stream", f"must be a boolean, got {stream!r}")
            if stream and len(prompts) > 1:
                raise BadRequest("stream", "streams one prompt per request")
        except BadRequest as exc:
            return error_response(400, str(exc), exc.param)
        groups = []
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        try:
            try:
                for spec, _ in specs:
                    groups.append(self.core.submit_private(spec))
            except CoreError as exc:
                return error_response(429 if exc.code == "exhausted" else 400, str(exc), kind="server_overloaded")
            if stream:
                return await self._stream(request, groups[0], rid, created, chat, want_logprobs)
            results = await asyncio.gather(*(self.collect(g) for g in groups))
            ids_only = body.get("return_tokens_as_token_ids") is True
            with_prompt = body.get("return_token_ids") is True and not chat
            choices = [self._choice(s, chat, want_logprobs, ids_only, i * len(samples) + s.index, with_prompt)
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
            live = [g.group_id for g in groups if g.group_id in self.core.groups]
            if live:  # the client went away: free the engines
                await self.core.abort(live)

    async def collect(self, group) -> list[Sample]:
        """Every sample of a group from `core.submit_private`, in index order."""
        samples: list[Sample] = []
        while len(samples) < group.spec.num_samples:
            event = await group.listener.get()
            if isinstance(event, SampleEvent):
                samples.append(event.sample)
        return sorted(samples, key=lambda s: s.index)

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def _logprobs(self, ids: list[int], logprobs: list[float], chat: bool, ids_only: bool = False) -> dict:
        # Only the sampled token's logprob is known: it is each position's one alternative.
        tokens = [f"token_id:{t}" for t in ids] if ids_only else [self._text([t]) for t in ids]
        if chat:
            return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                for t, lp in zip(tokens, logprobs)]}
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": [{t: lp} for t, lp in zip(tokens, logprobs)],
                "text_offset": None}

    def _choice(self, s: Sample, chat: bool, want_logprobs: bool, ids_only: bool = False, index: int | None = None,
                with_prompt: bool = False) -> dict:
        text = self._text(s.response_token_ids)
        choice = {
            "index": s.index if index is None else index,
            "finish_reason": FINISH_REASONS.get(s.finish_reason, "stop"),
            "logprobs": self._logprobs(s.response_token_ids, s.logprobs, chat, ids_only) if want_logprobs else None,
            "token_ids": s.response_token_ids,
            "policy_versions": [{"version": v, "start": a, "length": n} for v, a, n in s.versions.segments],
        }
        if with_prompt:
            choice["prompt_token_ids"] = s.prompt_token_ids
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return choice

    async def _stream(self, request, group, rid, created, chat, want_logprobs) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"

        async def send(choice: dict, version: int) -> None:
            chunk = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [choice],
                     "policy_version": version}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())

        if chat:
            for i in range(group.spec.num_samples):
                await send({"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}, self.core.policy_version)
        done = 0
        while done < group.spec.num_samples:
            event = await group.listener.get()
            if isinstance(event, DeltaEvent):
                index, delta = event.index, event.delta
                if not delta.token_ids:
                    continue
                text = self._text(delta.token_ids)
                choice = {"index": index, "finish_reason": None, "token_ids": delta.token_ids,
                          "logprobs": self._logprobs(delta.token_ids, delta.logprobs, chat) if want_logprobs else None}
                if chat:
                    choice["delta"] = {"content": text}
                else:
                    choice["text"] = text
                await send(choice, delta.version)
            elif isinstance(event, SampleEvent):
                s = event.sample
                done += 1
                final = {"index": s.index, "finish_reason": FINISH_REASONS.get(s.finish_reason, "stop"), "logprobs": None}
                if chat:
                    final["delta"] = {}
                else:
                    final["text"] = ""
                await send(final, s.versions.max_version)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
