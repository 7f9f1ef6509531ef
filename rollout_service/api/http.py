"""The aiohttp side server: health, readiness, Prometheus metrics, status JSON."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from rollout_service.api.errors import http_errors
from rollout_service.api.metrics import metrics_registry
from rollout_service.api.openai_http import MAX_BODY_BYTES, OpenAIFrontEnd
from rollout_service.api.vllm_compat import VllmCompat
from rollout_service.api.vllm_control import VllmControl
from rollout_service.api.vllm_weights import VllmWeightTransfer
from rollout_service.core.rollout import RolloutCore
from rollout_service.core.status import CoreStatus

if TYPE_CHECKING:
    from rollout_service.drafter.runtime import SpecRuntime


def readiness(st: CoreStatus) -> dict:
    """/readyz's body: ready when every engine is up (ready or updating
    weights), the last dispatch to an engine did not fail and state_dir's
    journal can be written. Open to callers without a token: states and
    counts only, no error text (the last placement error and the journal's
    are in /v1/status)."""
    states = [e.load.state for e in st.engines]
    engines_up = bool(states) and all(s in ("ready", "updating") for s in states)
    return {"ready": engines_up and not st.placement_error and not st.journal_error, "engines": states,
            "placement_errors": st.placement_errors, "journal_failed": bool(st.journal_error)}


def make_app(core: RolloutCore, openai: "OpenAIFrontEnd | None" = None,
             spec_runtime: "SpecRuntime | None" = None) -> web.Application:
    async def healthz(_):
        return web.json_response({"status": "ok"})

    registry = metrics_registry(core, spec_runtime)

    async def readyz(_):
        body = readiness(core.status())
        return web.json_response(body, status=200 if body["ready"] else 503)

    async def metrics(_):
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def status(_):
        snapshot = core.status()
        st = dataclasses.asdict(snapshot)
        st["engines"] = [
            {"engine_id": e.load.engine_id, "kind": e.load.kind, "state": e.load.state, "running": e.load.running,
             "waiting": e.load.waiting, "kv_usage": e.load.kv_usage, "tokens_per_s": e.load.tokens_per_s,
             "assigned": e.assigned, "prefix_cache_queried_tokens": e.load.prefix_cache_queried_tokens,
             "prefix_cache_hit_tokens": e.load.prefix_cache_hit_tokens}
            for e in snapshot.engines
        ]
        st["prefix_cache_queried_tokens"] = snapshot.prefix_cache_queried_tokens
        st["prefix_cache_hit_tokens"] = snapshot.prefix_cache_hit_tokens
        if spec_runtime is not None:
            st["spec"] = spec_runtime.status().to_dict()
        return web.json_response(st)

    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[http_errors])  # the outermost one
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/health", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/status", status)
    if openai is not None:
        openai.routes(app)
        VllmCompat(openai).routes(app)  # the rest of `vllm serve`'s surface
        VllmControl(openai).routes(app)  # and its RL control routes
        VllmWeightTransfer(openai).routes(app)  # and weight transfer, onto the collective push
    return app
