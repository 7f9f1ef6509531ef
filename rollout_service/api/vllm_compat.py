"""The rest of stock `vllm serve`'s HTTP surface, for the whole fleet.

RL libraries that drive a `vllm serve` process (TRL's `VLLMClient` and
async GRPO, SkyRL, prime-rl) find here what they ask for besides the OpenAI
endpoints (api/openai_http.py, which also accept vLLM's `return_token_ids`,
`return_tokens_as_token_ids`, `cache_salt` and batches of prompts); the
control routes (`/pause`, `/resume`, `/abort_requests`) are in
api/vllm_control.py, the weight-transfer routes in api/vllm_weights.py. Answers follow vLLM 0.32's shapes; the fleet is
described as one data-parallel deployment of its engines:

- `GET /server_info?config_format=json|text`: `{"vllm_config": {...}}` with
  the parts clients read (`model_config.dtype`, `model_config.logprobs_mode`,
  `parallel_config`: `data_parallel_size` = engines, `world_size` = workers
  of one engine, `world_size_across_dp` = workers of every engine), plus
  `rollout_service`: the serving policy version, how weights reach the
  service, and the checkpoint's tensor names, dtypes and shapes;
  `weight_transfer_config.backend` is that of the weight-transfer routes.
- `GET /version`: the vLLM version the engines run (the service's own
  version behind simulated engines).
- `GET /get_world_size?include_dp=true|false`: the workers of every engine
  (with `include_dp`, the default) or of one.
- `POST /inference/v1/generate`: token ids in, token ids out, streaming or
  not; each choice carries `weight_versions`, the spans of output tokens
  sampled by each policy version (`[start, end)`, a version's label); a key
  this server does not honour, at the top or in `sampling_params`, is a 400
  naming it. `X-Session-ID` gives session affinity, `cache_salt` its own
  prefix-cache partition.
- `POST /reset_prefix_cache`: nothing to do: the engines' prefix caches are
  partitioned by policy version (every request's `cache_salt`), so no
  request reuses KV computed by other weights; answers `{"success": true}`.
- `GET /weight_info`: the serving policy version's label.

Generation runs through the same core and engines as every other front end
(`core.submit_private`): placement, rebalancing, carry-over and speculation
apply as to gRPC groups.
"""
from __future__ import annotations

import json
import sys
import time
import uuid

from aiohttp import web

import rollout_service
from rollout_service.api.collective import _backend
from rollout_service.api.validation import MAX_ID_CHARS
from rollout_service.api.openai_http import (FINISH_REASONS, BadRequest, OpenAIFrontEnd, _short, cache_salt,
                                             check_keys, error_response, query_flag)
from rollout_service.core.rollout import CoreError, RolloutCore
from rollout_service.lifecycle.types import CACHE_SALT_KEY, DeltaEvent, Sample, SampleEvent
from rollout_service.scheduling.affinity import SESSION_KEY

_GENERATE_KEYS = {"request_id", "model", "token_ids", "features", "content_parts", "sampling_params", "stream",
                  "stream_options", "return_token_ids", "output_mode", "cache_salt", "priority",
                  "kv_transfer_params", "ec_transfer_params", "reasoning_ended", "reasoning_parser_kwargs",
                  "token_offsets"}
# vLLM SamplingParams keys honoured here (the text-only ones are moot: tokens out).
_GENERATE_SAMPLING_KEYS = {"n", "max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "stop",
                           "stop_token_ids", "include_stop_str_in_output", "min_tokens", "ignore_eos",
                           "output_kind", "detokenize", "skip_special_tokens", "spaces_between_special_tokens"}
# Top-level generate keys accepted at their neutral value only (else a 400 naming them).
_GENERATE_NEUTRAL = {"output_mode": ("tokens",), "priority": (0,), "kv_transfer_params": (None,),
                     "ec_transfer_params": (None,), "reasoning_ended": (None,), "reasoning_parser_kwargs": (None,),
                     "token_offsets": (None,)}


def _renamed(exc: BadRequest, param: str) -> BadRequest:
    return BadRequest(param, str(exc).removeprefix(f"{exc.param}: "))


class VllmCompat:
    """Routes of `vllm serve` that are not OpenAI's, on top of an OpenAIFrontEnd."""

    def __init__(self, front: OpenAIFrontEnd) -> None:
        self.front = front
        self.core: RolloutCore = front.core
        self._checkpoint: dict | None = None
        self._checkpoint_read = False

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/version", self.version)
        app.router.add_get("/get_world_size", self.world_size)
        app.router.add_get("/weight_info", self.weight_info)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.router.add_post("/inference/v1/generate", self.generate)

    # -- configuration -------------------------------------------------------------

    def checkpoint_tensors(self) -> dict | None:
        """{name: {"dtype", "shape"}} of the served checkpoint (what a push may
        carry; a tied output layer is not one of them), or None when the
        engines have no checkpoint (simulated engines take any manifest)."""
        if not self._checkpoint_read:
            self._checkpoint_read = True
            dirs = {e.describe().model for e in self.core.engines.values() if e.kind == "vllm"}
            dirs.discard("")
            if len(dirs) == 1:
                from rollout_service.engines.weights import checkpoint_manifest

                manifest = checkpoint_manifest(dirs.pop())
                self._checkpoint = {n: {"dtype": d, "shape": list(s)} for n, (d, s) in manifest.items()} or None
        return self._checkpoint

    def _one(self, field: str, default):
        """An engine description field when every engine agrees, else `default`."""
        values = {getattr(e.describe(), field) for e in self.core.engines.values()}
        values.discard("")
        return values.pop() if len(values) == 1 else default

    def parallel_config(self) -> dict:
        """The fleet as one data-parallel vLLM deployment: one replica per
        engine, `world_size` the workers of one engine, `world_size_across_dp`
        of all."""
        workers = [e.describe().workers for e in self.core.engines.values()]
        return {"tensor_parallel_size": max(workers, default=1), "pipeline_parallel_size": 1,
                "data_parallel_size": len(workers), "world_size": max(workers, default=1),
                "world_size_across_dp": sum(workers)}

    def weight_transfer_config(self) -> dict | None:
        """{"backend"} of the weight-transfer routes (api/vllm_weights.py):
        NCCL on GPUs, gloo on CPUs; None when an engine cannot join a group."""
        live = self.core.fleet.live()
        if not live or any(e.transfer_ranks() <= 0 for e in live):
            return None
        return {"backend": _backend(self.core, "")}

    async def server_info(self, request: web.Request) -> web.Response:
        fmt = request.query.get("config_format", "text")
        if fmt not in ("text", "json"):
            return error_response(400, f"config_format: must be 'text' or 'json', got {_short(fmt)}",
                                  "config_format")
        config = {
            "model_config": {
                "model": self.front.model_name,
                "served_model_name": self.front.model_name,
                "max_model_len": self.front.limits.max_model_len,
                "logprobs_mode": self._one("logprobs_mode", "processed_logprobs"),
                # Simulated engines have no weights: float32, what a push to them may carry.
                "dtype": f"torch.{self._one('dtype', 'float32')}",
            },
            "parallel_config": self.parallel_config(),
            "weight_transfer_config": self.weight_transfer_config(),
        }
        return web.json_response({
            "vllm_config": config if fmt == "json" else str(config),
            "vllm_env": {},
            "system_env": {},
            "rollout_service": {
                "policy_version": self.core.policy_version,
                "engines": len(self.core.engines),
                "weight_push": "gRPC rollout.v1.RolloutService/PushWeights",
                "checkpoint_tensors": self.checkpoint_tensors(),
            },
        })

    async def version(self, _request: web.Request) -> web.Response:
        vllm = sys.modules.get("vllm") if any(e.kind == "vllm" for e in self.core.engines.values()) else None
        return web.json_response({"version": getattr(vllm, "__version__", None) or rollout_service.__version__})

    async def world_size(self, request: web.Request) -> web.Response:
        try:
            include_dp = query_flag(request, "include_dp", True)
        except BadRequest as exc:
            return error_response(400, str(exc), exc.param)
        parallel = self.parallel_config()
        return web.json_response({"world_size": parallel["world_size_across_dp" if include_dp else "world_size"]})

    async def weight_info(self, _request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.front.version_label(self.core.policy_version)})

    def weight_versions(self, s: Sample) -> list[dict]:
        """vLLM's `WeightVersionSpan`s of a sample: output tokens `[start, end)`
        sampled by the weights labelled `version`."""
        return [{"version": self.front.version_label(v), "start": a, "end": a + n} for v, a, n in s.versions.segments]

    async def reset_prefix_cache(self, _request: web.Request) -> web.Response:
        # Prefix caches are partitioned by policy version (cache_salt): no
        # request reuses KV of other weights, so there is nothing to reset.
        return web.json_response({"success": True})

    # -- tokens in, tokens out -------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        front = self.front
        try:
            body, prompt, spec, want_logprobs = await front.off_loop(request, lambda raw: self._parse(request, raw))
        except BadRequest as exc:
            return error_response(400, str(exc), exc.param)
        # vLLM's id: from the body's `request_id` (or X-Request-Id), prefixed.
        rid = f"generate-tokens-{request.headers.get('X-Request-Id') or body.get('request_id') or uuid.uuid4().hex}"
        try:
            group = self.core.submit_private(spec)
        except CoreError as exc:
            return error_response(429 if exc.code == "exhausted" else 400, str(exc), kind="server_overloaded")
        with front.tracking([rid, body.get("request_id") or rid], [group]):
            try:
                if body.get("stream"):
                    return await self._stream(request, body, rid, group, prompt, want_logprobs)
                tops: dict = {}
                samples = await front.collect(group, tops)
            finally:
                if group.group_id in self.core.groups:  # the client went away (cancelled): free the engines
                    await self.core.abort([group.group_id])
        usage = {"prompt_tokens": len(prompt), "completion_tokens": sum(len(s.response_token_ids) for s in samples)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        response = {
            "request_id": rid,
            "model": front.model_name,
            "created": int(time.time()),
            "output_mode": "tokens",
            "choices": [self._choice(s, want_logprobs, spec.sampling.logprobs, tops.get(s.index)) for s in samples],
            "usage": usage,
            "prompt_token_ids": prompt if body.get("return_token_ids") else None,
            "policy_version": max(s.versions.max_version for s in samples),
        }
        return web.json_response(response)

    async def _stream(self, request: web.Request, body: dict, rid: str, group, prompt: list[int],
                      want_logprobs: bool) -> web.StreamResponse:
        """vLLM's token stream: a chunk per engine step of each choice, its
        last with the finish reason and the choice's `weight_versions`; the
        prompt's ids on the first chunk with `return_token_ids`; usage per
        `stream_options`; then `[DONE]`."""
        include_usage, continuous = self._stream_options(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        alternatives = group.spec.sampling.logprobs
        first = [bool(body.get("return_token_ids"))]
        generated = [0] * group.spec.num_samples

        async def send(choice: dict | None, usage: dict | None = None) -> None:
            chunk = {"request_id": rid, "output_mode": "tokens", "choices": [choice] if choice else []}
            if first[0] and choice:
                chunk["prompt_token_ids"], first[0] = prompt, False
            if usage is not None:
                chunk["usage"] = usage
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())

        def usage_of(completion: int) -> dict:
            return {"prompt_tokens": len(prompt), "completion_tokens": completion,
                    "total_tokens": len(prompt) + completion}

        async for event in self.front.events(group):
            if isinstance(event, DeltaEvent):
                d = event.delta
                if not d.token_ids:
                    continue
                generated[event.index] += len(d.token_ids)
                logprobs = ({"content": self._logprob_content(d.token_ids, d.logprobs, alternatives, d.top_logprobs)}
                            if want_logprobs else None)
                await send({"index": event.index, "finish_reason": None, "stop_reason": None,
                            "token_ids": d.token_ids, "logprobs": logprobs},
                           usage_of(generated[event.index]) if continuous else None)
            elif isinstance(event, SampleEvent):
                s = event.sample
                await send({"index": s.index, "finish_reason": FINISH_REASONS.get(s.finish_reason, "stop"),
                            "stop_reason": None, "token_ids": [], "logprobs": None,
                            "weight_versions": self.weight_versions(s)},
                           usage_of(generated[s.index]) if continuous else None)
        if include_usage:
            await send(None, usage_of(sum(generated)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    @staticmethod
    def _stream_options(body: dict) -> tuple[bool, bool]:
        """(include_usage, continuous_usage_stats) of `stream_options`; BadRequest naming the field."""
        options = body.get("stream_options")
        if options is None:
            return False, False
        if not body.get("stream"):
            raise BadRequest("stream_options", "is only allowed with 'stream': true")
        if not isinstance(options, dict):
            raise BadRequest("stream_options", f"must be an object, got {_short(options)}")
        flags = []
        for key in ("include_usage", "continuous_usage_stats"):
            value = options.get(key)
            if value is not None and not isinstance(value, bool):
                raise BadRequest(f"stream_options.{key}", f"must be a boolean, got {_short(value)}")
            flags.append(bool(value))
        unknown = set(options) - {"include_usage", "continuous_usage_stats"}
        if unknown:
            key = sorted(unknown)[0]
            raise BadRequest(f"stream_options.{key}", f"unsupported parameter 'stream_options.{key}'")
        return flags[0], flags[1]

    def _parse(self, request: web.Request, raw: bytes):
        """The request's body, prompt ids, group spec and whether logprobs are
        wanted; BadRequest naming the field."""
        front = self.front
        body = front.parse_raw(raw)
        check_keys(body, _GENERATE_KEYS)
        for key, neutral in _GENERATE_NEUTRAL.items():
            if key in body and body[key] not in neutral:
                raise BadRequest(key, f"unsupported parameter {key!r}: this server does not implement it "
                                      f"(only {neutral[0]!r}), got {_short(body[key])}")
        rid = body.get("request_id")
        if rid is not None and not (isinstance(rid, str) and len(rid) <= MAX_ID_CHARS):
            raise BadRequest("request_id", f"must be a string of at most {MAX_ID_CHARS} characters")
        if body.get("features") is not None or body.get("content_parts") is not None:
            raise BadRequest("features", "multimodal inputs are not supported by this server")
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise BadRequest("stream", f"must be a boolean, got {_short(stream)}")
        self._stream_options(body)
        ids = body.get("token_ids")
        if not isinstance(ids, list):
            raise BadRequest("token_ids", "must be a list of token ids")
        try:
            prompt = front.prompt_ids(ids)
        except BadRequest as exc:
            raise _renamed(exc, "token_ids") from None
        sampling = body.get("sampling_params") or {}
        if not isinstance(sampling, dict):
            raise BadRequest("sampling_params", "must be an object")
        try:
            check_keys(sampling, _GENERATE_SAMPLING_KEYS)
            spec, want_logprobs = front.group_spec(sampling, prompt)
        except BadRequest as exc:
            raise _renamed(exc, f"sampling_params.{exc.param}") from None
        salt = cache_salt(body)
        if salt is not None:
            spec.metadata[CACHE_SALT_KEY] = salt
        session = front.session_id(request, {})
        if session is not None:
            spec.metadata[SESSION_KEY] = session
        return body, prompt, spec, want_logprobs

    @staticmethod
    def _logprob_content(ids: list[int], logprobs: list[float], alternatives: int, tops: list | None) -> list[dict]:
        """vLLM's `GenerateLogProbsContent` per token: the sampled token and
        the first max(`logprobs`, 1) of the engine's candidates (the sampled
        one first, then the top ones by rank; the sampled one alone where
        the engine reported none). Each entry also carries the token as
        "token_id:<id>", what OpenAI-shaped readers parse."""
        def entry(t: int, lp: float) -> dict:
            return {"token": f"token_id:{t}", "token_id": t, "logprob": max(lp, -9999.0)}

        tops = tops or []
        content = []
        for i, (t, lp) in enumerate(zip(ids, logprobs)):
            top = (tops[i] if i < len(tops) and tops[i] else [(t, lp)])[:max(alternatives, 1)]
            content.append({**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in top]})
        return content

    def _choice(self, s: Sample, want_logprobs: bool, alternatives: int = 0, tops: list | None = None) -> dict:
        content = self._logprob_content(s.response_token_ids, s.logprobs, alternatives, tops) if want_logprobs else None
        return {
            "index": s.index,
            "finish_reason": FINISH_REASONS.get(s.finish_reason, "stop"),
            "stop_reason": None,
            "token_ids": s.response_token_ids,
            "logprobs": {"content": content} if content is not None else None,
            "weight_versions": self.weight_versions(s),
            "policy_versions": [{"version": v, "start": a, "length": n} for v, a, n in s.versions.segments],
        }
