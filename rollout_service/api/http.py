"""The aiohttp side server: health, readiness, Prometheus metrics, status JSON."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from aiohttp import web

from rollout_service.api.openai_http import OpenAIFrontEnd
from rollout_service.api.vllm_compat import VllmCompat
from rollout_service.core.rollout import RolloutCore
from rollout_service.engines.spec import depth_buckets

if TYPE_CHECKING:
    from rollout_service.drafter.runtime import SpecRuntime


def _spec_metrics(spec: dict) -> list[str]:
    """Speculative decoding per engine: drafted/accepted tokens, acceptance
    length and by position, the depth in force and the tuner's measurements."""
    lines = []
    engines = {eid: e for eid, e in spec.get("engines", {}).items() if e.get("method", "off") != "off"}
    for name, key, kind in (("spec_draft_tokens_total", "draft_tokens", "counter"),
                            ("spec_accepted_tokens_total", "accepted_tokens", "counter"),
                            ("spec_mean_acceptance_length", "mean_acceptance_length", "gauge"),
                            ("spec_draft_version", "draft_version", "gauge")):
        lines.append(f"# TYPE rollout_{name} {kind}")
        lines += [f'rollout_{name}{{engine="{eid}"}} {e.get(key, 0)}' for eid, e in engines.items()]
    lines.append("# TYPE rollout_spec_acceptance_by_position gauge")
    for eid, e in engines.items():
        lines += [f'rollout_spec_acceptance_by_position{{engine="{eid}",position="{i + 1}"}} {v}'
                  for i, v in enumerate(e.get("acceptance_by_position", []))]
    lines.append("# TYPE rollout_spec_depth gauge")
    lines.append("# TYPE rollout_spec_tokens_per_s_per_seq gauge")
    for eid, e in engines.items():
        for b in depth_buckets(e):
            batch = f'{b["batch"][0]}-{b["batch"][1]}'
            lines.append(f'rollout_spec_depth{{engine="{eid}",batch="{batch}"}} {b["k"]}')
            lines += [f'rollout_spec_tokens_per_s_per_seq{{engine="{eid}",batch="{batch}",k="{k}"}} {v}'
                      for k, v in b["tokens_per_s_per_seq"].items()]
    return lines


def _metrics_text(core: RolloutCore, spec_runtime: "SpecRuntime | None" = None) -> str:
    st = core.status()
    lines = [
        "# TYPE rollout_policy_version gauge",
        f"rollout_policy_version {st.policy_version}",
        "# TYPE rollout_queued_requests gauge",
        f"rollout_queued_requests {st.queued_requests}",
        "# TYPE rollout_running_requests gauge",
        f"rollout_running_requests {st.running_requests}",
        "# TYPE rollout_retained_samples gauge",
        f"rollout_retained_samples {st.retained_samples}",
    ]
    counters = st.counters
    for name in sorted(n for n in counters if not n.startswith("samples_lag_")):
        lines += [f"# TYPE rollout_{name}_total counter", f"rollout_{name}_total {counters[name]}"]
    lines.append("# TYPE rollout_samples_by_lag_total counter")
    for name in sorted(n for n in counters if n.startswith("samples_lag_")):
        lines.append(f'rollout_samples_by_lag_total{{lag="{name.removeprefix("samples_lag_")}"}} {counters[name]}')
    for series in ("running", "waiting", "kv_usage", "tokens_per_s"):
        lines.append(f"# TYPE rollout_engine_{series} gauge")
        for e in st.engines:
            value = getattr(e.load, series)
            lines.append(f'rollout_engine_{series}{{engine="{e.load.engine_id}"}} {value}')
    for name, hist in core.histograms.items():
        lines.append(f"# TYPE rollout_{name} histogram")
        for le, count in hist.cumulative():
            lines.append(f'rollout_{name}_bucket{{le="{le}"}} {count}')
        lines += [f"rollout_{name}_sum {hist.sum}", f"rollout_{name}_count {hist.count}"]
    if spec_runtime is not None:
        lines += _spec_metrics(spec_runtime.status())
    return "\n".join(lines) + "\n"


def make_app(core: RolloutCore, openai: "OpenAIFrontEnd | None" = None,
             spec_runtime: "SpecRuntime | None" = None) -> web.Application:
    async def healthz(_):
        return web.json_response({"status": "ok"})

    async def readyz(_):
        states = [e.load().state for e in core.engines.values()]
        ready = bool(states) and all(s in ("ready", "updating") for s in states)
        return web.json_response({"ready": ready, "engines": states}, status=200 if ready else 503)

    async def metrics(_):
        return web.Response(text=_metrics_text(core, spec_runtime), content_type="text/plain", charset="utf-8")

    async def status(_):
        st = dataclasses.asdict(core.status())
        st["engines"] = [
            {"engine_id": e.load.engine_id, "kind": e.load.kind, "state": e.load.state, "running": e.load.running,
             "waiting": e.load.waiting, "kv_usage": e.load.kv_usage, "tokens_per_s": e.load.tokens_per_s,
             "assigned": e.assigned}
            for e in core.status().engines
        ]
        if spec_runtime is not None:
            st["spec"] = spec_runtime.status()
        return web.json_response(st)

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/health", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/status", status)
    if openai is not None:
        openai.routes(app)
        VllmCompat(openai).routes(app)  # the rest of `vllm serve`'s surface
    return app
