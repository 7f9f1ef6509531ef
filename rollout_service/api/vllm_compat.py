"""The rest of stock `vllm serve`'s HTTP surface, for clients written against it.

RL libraries that drive a `vllm serve` process (TRL's `VLLMClient`, among
others) find here what they ask for besides the OpenAI endpoints
(api/openai_http.py, which also accept vLLM's `return_token_ids` and
`return_tokens_as_token_ids` and batches of prompts):

- `GET /server_info?config_format=json`: `{"vllm_config": {...}}` with the
  parts clients read (`model_config.logprobs_mode`, `parallel_config`,
  `weight_transfer_config` = null), plus `rollout_service`: the serving
  policy version, how weights reach the service, and the checkpoint's tensor
  names, dtypes and shapes (what a weight push may carry).
- `GET /get_world_size`: the number of engines.
- `POST /inference/v1/generate`: token ids in, token ids out (one prompt,
  `sampling_params`, no multimodal features, no streaming); a key this
  server does not honour, at the top or in `sampling_params`, is a 400
  naming it.
- `POST /reset_prefix_cache`: nothing to do: the engines' prefix caches are
  partitioned by policy version (every request's `cache_salt`), so no
  request reuses KV computed by other weights; answers `{"success": true}`.
- `GET /weight_info`: the serving policy version.
- The NCCL weight-transfer endpoints (`/init_weight_transfer_engine`,
  `/start_weight_update`, `/update_weights`, `/finish_weight_update`, ...)
  answer 501 with a JSON error: weights reach this service through
  `PushWeights` (gRPC), e.g. `trainer_client.RolloutClient.push_weights`, or
  for TRL `trainer_client.trl` (docs/trl.md).

Generation runs through the same core and engines as every other front end
(`core.submit_private`), and every answer names the policy version(s) that
produced it.
"""
from __future__ import annotations

import time
import uuid

from aiohttp import web

from rollout_service.api.validation import MAX_ID_CHARS
from rollout_service.api.openai_http import FINISH_REASONS, BadRequest, OpenAIFrontEnd, check_keys, error_response
from rollout_service.core.rollout import CoreError, RolloutCore
from rollout_service.lifecycle.types import Sample

WEIGHT_TRANSFER_PATHS = (
    "/init_weight_transfer_engine",
    "/shutdown_weight_transfer_engine",
    "/start_weight_update",
    "/start_draft_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/update_weight_version",
)

NO_NCCL = (
    "this rollout-service side server has no NCCL weight-transfer engine: push weights over gRPC "
    "PushWeights instead (trainer_client.RolloutClient.push_weights, or for TRL the helpers in "
    "trainer_client.trl; see docs/trl.md)"
)


_GENERATE_KEYS = {"request_id", "model", "token_ids", "features", "content_parts", "sampling_params", "stream",
                  "return_token_ids"}
# vLLM SamplingParams keys honoured here (the text-only ones are moot: tokens out).
_GENERATE_SAMPLING_KEYS = {"n", "max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "stop",
                           "stop_token_ids", "include_stop_str_in_output", "min_tokens", "ignore_eos",
                           "output_kind", "detokenize", "skip_special_tokens", "spaces_between_special_tokens"}


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
        app.router.add_get("/get_world_size", self.world_size)
        app.router.add_get("/weight_info", self.weight_info)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.router.add_post("/inference/v1/generate", self.generate)
        for path in WEIGHT_TRANSFER_PATHS:
            app.router.add_post(path, self.weight_transfer)

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

    def _logprobs_mode(self) -> str:
        modes = {e.describe().logprobs_mode for e in self.core.engines.values()}
        return modes.pop() if len(modes) == 1 else "processed_logprobs"

    async def server_info(self, request: web.Request) -> web.Response:
        n = len(self.core.engines)
        config = {
            "model_config": {
                "model": self.front.model_name,
                "served_model_name": self.front.model_name,
                "max_model_len": self.front.limits.max_model_len,
                "logprobs_mode": self._logprobs_mode(),
            },
            "parallel_config": {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": n,
                                "world_size": 1, "world_size_across_dp": n},
            "weight_transfer_config": None,
        }
        if request.query.get("config_format", "text") != "json":
            config = str(config)
        return web.json_response({
            "vllm_config": config,
            "vllm_env": {},
            "system_env": {},
            "rollout_service": {
                "policy_version": self.core.policy_version,
                "engines": n,
                "weight_push": "gRPC rollout.v1.RolloutService/PushWeights",
                "checkpoint_tensors": self.checkpoint_tensors(),
            },
        })

    async def world_size(self, _request: web.Request) -> web.Response:
        return web.json_response({"world_size": len(self.core.engines)})

    async def weight_info(self, _request: web.Request) -> web.Response:
        return web.json_response({"weight_version": str(self.core.policy_version)})

    async def reset_prefix_cache(self, _request: web.Request) -> web.Response:
        # Prefix caches are partitioned by policy version (cache_salt): no
        # request reuses KV of other weights, so there is nothing to reset.
        return web.json_response({"success": True})

    async def weight_transfer(self, request: web.Request) -> web.Response:
        return error_response(501, f"{request.path}: {NO_NCCL}", kind="not_implemented")

    # -- tokens in, tokens out -------------------------------------------------------

    async def generate(self, request: web.Request) -> web.Response:
        front = self.front
        try:
            body, prompt, spec, want_logprobs = await front.off_loop(request, self._parse)
        except BadRequest as exc:
            return error_response(400, str(exc), exc.param)
        try:
            group = self.core.submit_private(spec)
        except CoreError as exc:
            return error_response(429 if exc.code == "exhausted" else 400, str(exc), kind="server_overloaded")
        try:
            tops: dict = {}
            samples = await front.collect(group, tops)
        finally:
            if group.group_id in self.core.groups:  # the client went away (cancelled): free the engines
                await self.core.abort([group.group_id])
        response = {
            "request_id": body.get("request_id") or f"gen-{uuid.uuid4().hex[:24]}",
            "model": front.model_name,
            "created": int(time.time()),
            "output_mode": "tokens",
            "choices": [self._choice(s, want_logprobs, spec.sampling.logprobs, tops.get(s.index)) for s in samples],
            "usage": {"prompt_tokens": len(prompt),
                      "completion_tokens": sum(len(s.response_token_ids) for s in samples)},
            "policy_version": max(s.versions.max_version for s in samples),
        }
        response["usage"]["total_tokens"] = response["usage"]["prompt_tokens"] + response["usage"]["completion_tokens"]
        if body.get("return_token_ids", True):
            response["prompt_token_ids"] = prompt
        return web.json_response(response)

    def _parse(self, raw: bytes):
        """The request's body, prompt ids, group spec and whether logprobs are
        wanted; BadRequest naming the field."""
        front = self.front
        body = front.parse_raw(raw)
        check_keys(body, _GENERATE_KEYS)
        rid = body.get("request_id")
        if rid is not None and not (isinstance(rid, str) and len(rid) <= MAX_ID_CHARS):
            raise BadRequest("request_id", f"must be a string of at most {MAX_ID_CHARS} characters")
        if body.get("features") is not None or body.get("content_parts") is not None:
            raise BadRequest("features", "multimodal inputs are not supported by this server")
        if body.get("stream"):
            raise BadRequest("stream", "only non-streaming requests are supported")
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
        return body, prompt, spec, want_logprobs

    @staticmethod
    def _choice(s: Sample, want_logprobs: bool, alternatives: int = 0, tops: list | None = None) -> dict:
        # Each logprob entry carries the token both as an id (vLLM's generate
        # protocol) and as "token_id:<id>" (what OpenAI-shaped readers parse);
        # its top_logprobs are the first `logprobs` + 1 of the sampled token
        # and its alternatives, in vLLM's order (the sampled token alone
        # where the engine reported none).
        def entry(t: int, lp: float) -> dict:
            return {"token": f"token_id:{t}", "token_id": t, "logprob": max(lp, -9999.0)}

        content = None
        if want_logprobs:
            content = []
            tops = tops or []
            for i, (t, lp) in enumerate(zip(s.response_token_ids, s.logprobs)):
                top = (tops[i] if i < len(tops) and tops[i] else [(t, lp)])[:alternatives + 1]
                content.append({**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in top]})
        return {
            "index": s.index,
            "finish_reason": FINISH_REASONS.get(s.finish_reason, "stop"),
            "token_ids": s.response_token_ids,
            "logprobs": {"content": content} if content is not None else None,
            "weight_versions": [{"version": str(v), "start": a, "end": a + n} for v, a, n in s.versions.segments],
            "policy_versions": [{"version": v, "start": a, "length": n} for v, a, n in s.versions.segments],
        }
