"""vLLM's RL control routes (`vllm/entrypoints/rl/online/api_router.py`),
for the whole fleet; they need the weights token (api/auth.py).

- `POST /pause?mode=abort|wait|keep&clear_cache=`: `{"status": "paused"}`
  once the fleet is paused (core/pause.py): `keep` holds what runs and
  resumes it under the weights serving at `/resume`, every token tagged
  with the version that sampled it; `abort` ends every open group with what
  it generated; `wait` returns once the engines have drained (at most
  `http_request_timeout_s`, else 504, the fleet still paused). `clear_cache`
  is accepted and has nothing to clear: prefix caches are partitioned by
  policy version.
- `POST /resume`: `{"status": "resumed"}`; `GET /is_paused`: `{"is_paused": bool}`.
  The pause in force is GetStatus's `paused`; with state_dir it is journaled
  before either answers, and a restarted service is still paused.
- `POST /abort_requests {"request_ids": [...]}`: aborts those requests of
  the HTTP front ends (the ids their answers carry, or a generate request's
  own `request_id`); each answers at once with what it generated. Without
  ids, every open group, as rollout.v1's `Abort(all)`. `{"status":
  "aborted", "aborted": n}`. `POST /inference/v1/abort_requests` (vLLM's
  tokens-in/tokens-out router; the submit token): the named requests only.
- The weight-transfer routes are in api/vllm_weights.py.
"""
from __future__ import annotations

import contextlib
import json

from aiohttp import web

from rollout_service.api.openai_http import (BadRequest, OpenAIFrontEnd, _short, error_response, query_flag,
                                             read_body)
from rollout_service.core.rollout import CoreError, RolloutCore

class VllmControl:
    """vLLM's pause, resume and abort routes over the core's fleet."""

    def __init__(self, front: OpenAIFrontEnd) -> None:
        self.front = front
        self.core: RolloutCore = front.core

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/pause", self.pause)
        app.router.add_post("/resume", self.resume)
        app.router.add_get("/is_paused", self.is_paused)
        app.router.add_post("/abort_requests", self.abort_requests)
        app.router.add_post("/inference/v1/abort_requests", self.abort_generate)

    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        try:
            query_flag(request, "clear_cache", True)  # nothing to clear (see the module docstring)
        except BadRequest as exc:
            return error_response(400, str(exc), exc.param)
        try:
            await self.core.pausing.pause(mode, self.front.request_timeout_s)
        except CoreError as exc:
            status = 504 if exc.code == "deadline" else 400
            return error_response(status, str(exc), "mode", kind="invalid_request_error" if status == 400 else "timeout")
        await self._recorded()
        return web.json_response({"status": "paused"})

    async def resume(self, _request: web.Request) -> web.Response:
        self.core.pausing.resume()
        await self._recorded()
        return web.json_response({"status": "resumed"})

    async def _recorded(self) -> None:
        """With state_dir, answer once the pause or resume is journaled (a
        restart keeps it). The change holds in any case: a journal that
        cannot be written shows in /health and GetStatus."""
        with contextlib.suppress(CoreError):
            await self.core.commit()

    async def is_paused(self, _request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.core.pausing.paused})

    async def abort_requests(self, request: web.Request) -> web.Response:
        try:
            ids = self._request_ids(await read_body(request))
        except BadRequest as exc:
            return error_response(400, str(exc), exc.param)
        if not ids:
            count, _ = await self.core.abort(all_groups=True)
            return web.json_response({"status": "aborted", "aborted": count})
        await self._abort_named(ids)
        return web.json_response({"status": "aborted", "aborted": len(ids)})

    async def abort_generate(self, request: web.Request) -> web.Response:
        """vLLM's tokens-in/tokens-out abort: the named requests only (the
        submit token suffices, as for generating); an empty 200."""
        try:
            raw = await read_body(request)
            if b"request_ids" not in raw:
                raise BadRequest("request_ids", "Missing 'request_ids' in request body")
            ids = self._request_ids(raw)
        except BadRequest as exc:
            return error_response(400, str(exc), exc.param)
        await self._abort_named(ids)
        return web.Response(status=200)

    async def _abort_named(self, ids: list[str]) -> None:
        groups = {g for rid in ids for g in self.front.inflight.get(rid, ())}
        live = [g for g in groups if g in self.core.groups]
        if live:
            await self.core.abort(live)

    @staticmethod
    def _request_ids(raw: bytes) -> list[str]:
        """The body's `request_ids` (none: all); BadRequest naming what is wrong."""
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            raise BadRequest("body", "Invalid JSON format") from None
        if not isinstance(body, dict):
            raise BadRequest("body", "Request body must be a JSON object")
        ids = body.get("request_ids") or []
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise BadRequest("request_ids", f"must be a list of request ids, got {_short(ids)}")
        return ids
