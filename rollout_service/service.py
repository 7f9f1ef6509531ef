"""The composition root: configuration -> engines -> core -> gRPC + HTTP."""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rollout_proto import rollout_pb2
from rollout_service.api import convert
from rollout_service.api.auth import AuthInterceptor, TokenAuth, http_middleware
from rollout_service.api.errors import ErrorInterceptor
from rollout_service.api.http import make_app
from rollout_service.api.openai_http import OpenAIFrontEnd
from rollout_service.api.servicer import RolloutServicer, add_servicer
from rollout_service.api.validation import ModelLimits
from rollout_service.config import ServiceConfig, check_exposure
from rollout_service.engines.weights import drop_spare, set_staging_dir
from rollout_service.core.clock import Clock
from rollout_service.core.rollout import CoreLimits, RolloutCore
from rollout_service.drafter.runtime import SpecRuntime
from rollout_service.environments import Environments
from rollout_service.factory import ModelInfo, fleet_plan, load_tokenizer, make_engines, model_info
from rollout_service.scheduling import make_placement

log = logging.getLogger("rollout_service")
# At stop, HTTP handlers still running after this long are cancelled (the
# requests' groups are aborted before, so they normally answer at once).
HTTP_SHUTDOWN_S = 2.0
SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name


class RolloutService:
    """A running service. `await start()`, then `grpc_port`/`http_port` are
    bound (pass port 0 in the config to pick free ones); `await stop()`."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.core: RolloutCore | None = None
        self.spec_runtime: SpecRuntime | None = None
        self.environments = Environments({}, [])
        self.grpc_port = 0
        self.http_port = 0
        self._grpc: grpc.aio.Server | None = None
        self._http: web.AppRunner | None = None
        self._servicer: RolloutServicer | None = None
        self._health = health.aio.HealthServicer()
        self.model_name = ""

    async def start(self) -> None:
        """Build the engines and the core, then serve gRPC and HTTP. The
        ports are bound when it returns (`grpc_port`, `http_port`)."""
        cfg = self.config
        check_exposure(cfg)  # before anything starts
        info = model_info(cfg.engine)
        tokenizer = await asyncio.to_thread(load_tokenizer, info)
        self.model_name = info.name
        await self._start_core(info, tokenizer)
        limits = ModelLimits(info.vocab_size, info.max_model_len, cfg.max_groups_per_submit,
                             text=cfg.engine.kind != "sim")
        auth = TokenAuth(cfg.auth.submit_tokens, cfg.auth.weights_tokens)
        tls = _tls(cfg)
        await self._start_grpc(limits, tokenizer, auth, tls)
        await self._start_http(limits, tokenizer, auth, tls)
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "serving %s on %d %s engine(s): gRPC %s:%d, HTTP %s:%d",
            info.name, len(self.core.engines), cfg.engine.kind, cfg.host, self.grpc_port, cfg.host, self.http_port,
        )

    async def _start_core(self, info: ModelInfo, tokenizer) -> None:
        """Engines -> core (resumed from `state_dir`'s journal if there is
        one), started; then the speculative decoding runtime if `[engine.spec]`
        asks for it."""
        cfg = self.config
        self.environments = Environments.build(cfg.environments)
        set_staging_dir(cfg.staging_dir)
        plan = fleet_plan(cfg.engine, info)  # refused (PlanError) before any engine starts
        log.info("device plan: %s", plan.describe())
        engines = make_engines(cfg.engine, info, plan)
        self.core = RolloutCore(
            engines,
            make_placement(cfg.placement),
            Clock(),
            CoreLimits(max_queued_samples=cfg.max_queued_samples, consumer_ttl_s=cfg.consumer_ttl_s,
                       max_unacked_samples=cfg.max_unacked_samples, unacked_wait_s=cfg.unacked_wait_s,
                       observation_timeout_s=cfg.observation_timeout_s),
            detokenizer=tokenizer,
            carry_over=cfg.carry_over,
            rebalance=cfg.rebalance if cfg.rebalance.enabled else None,
            environments=self.environments.by_name,
            affinity=cfg.session_affinity,
        )
        if plan.placement_backend != "local":
            from rollout_service.engines.hosted import bind_counters

            bind_counters(engines, self.core.counters)
        if cfg.state_dir and self.core.open_state(cfg.state_dir, cfg.journal_commit_ms / 1000, convert.WIRE_SAMPLES):
            log.info("resumed from the journal in %s: %d open groups, %d unacknowledged samples, version %d",
                     cfg.state_dir, len(self.core.groups), self.core.delivery.retained, self.core.policy_version)
        await self.core.start()
        spec = cfg.engine.spec
        if spec.enabled:  # depth tuner and online drafter trainer, per [engine.spec]
            self.spec_runtime = SpecRuntime(self.core, spec)
            await self.spec_runtime.start()

    async def _start_grpc(self, limits: ModelLimits, tokenizer, auth: TokenAuth, tls: "_Tls | None") -> None:
        """The RolloutService servicer, health and reflection on `grpc_port`."""
        cfg = self.config
        max_msg = cfg.max_message_mb * 1024 * 1024
        self._grpc = grpc.aio.server(
            interceptors=[ErrorInterceptor()] + ([AuthInterceptor(auth)] if auth.enabled else []),
            options=[
                ("grpc.max_receive_message_length", max_msg),
                ("grpc.max_send_message_length", max_msg),
                # A client that vanished (no FIN: a dead host, a cut network)
                # stops answering pings: its connection, and its streams, end.
                ("grpc.keepalive_time_ms", int(cfg.keepalive_s * 1000)),
                ("grpc.keepalive_timeout_ms", int(cfg.keepalive_timeout_s * 1000)),
                ("grpc.http2.ping_timeout_ms", int(cfg.keepalive_timeout_s * 1000)),  # (gRPC >= 1.6x reads this one)
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.max_pings_without_data", 0),
            ]
        )
        servicer = RolloutServicer(
            self.core,
            limits,
            tokenizer,
            self.model_name,
            int(cfg.max_weights_gb * 1024**3),
            cfg.push_idle_timeout_s,
            self.spec_runtime,
            cfg.weights_file_dirs,
            max_message_bytes=max_msg,
        )
        add_servicer(servicer, self._grpc)
        self._servicer = servicer
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self._grpc,
        )
        address = f"{cfg.host}:{cfg.grpc_port}"
        if tls is not None:
            self.grpc_port = self._grpc.add_secure_port(address, grpc.ssl_server_credentials([(tls.key, tls.cert)]))
        else:
            self.grpc_port = self._grpc.add_insecure_port(address)
        if self.grpc_port == 0:
            raise OSError(f"cannot bind gRPC to {cfg.host}:{cfg.grpc_port}")
        await self._grpc.start()

    async def _start_http(self, limits: ModelLimits, tokenizer, auth: TokenAuth, tls: "_Tls | None") -> None:
        """The side server (health, metrics, status, OpenAI and vLLM routes)
        on `http_port`, on a socket bound here so that port 0 resolves to
        one known port."""
        cfg = self.config
        openai = OpenAIFrontEnd(self.core, limits, tokenizer, self.model_name, cfg.http_request_timeout_s)
        app = make_app(self.core, openai, self.spec_runtime)
        if auth.enabled:
            app.middlewares.append(http_middleware(auth))
        # handler_cancellation: a client that disconnects cancels its handler,
        # which aborts its groups (aiohttp lets handlers run on otherwise).
        self._http = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=HTTP_SHUTDOWN_S)
        await self._http.setup()
        sock = _listen(cfg.host, cfg.http_port)
        self.http_port = sock.getsockname()[1]
        await web.SockSite(self._http, sock, ssl_context=tls.ssl_context() if tls is not None else None).start()

    async def stop(self, grace: float = 1.0) -> None:
        """Stop serving; with a `state_dir`, journal unfinished work's partial
        responses first. HTTP requests in flight are answered first, their
        groups aborted."""
        if self.core:
            private = [gid for gid, g in self.core.groups.items() if g.listener is not None]
            if private:
                await self.core.abort(private)
        if self._grpc:
            for name in ("", SERVICE_NAME):
                await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
            await self._grpc.stop(grace)
        if self.core:
            await self.core.checkpoint()
        if self._http:
            await self._http.cleanup()
        if self.spec_runtime:
            await self.spec_runtime.stop()
        if self.core:
            await self.core.stop()
            # The serving versions' staging files (policy, draft).
            draft = self._servicer.weights.last_draft if self._servicer else None
            for last in (self.core.weight_sync.last, draft):
                if last is not None:
                    last.cleanup()
        await self.environments.close()
        drop_spare()  # the staging file kept for the next weight push

    async def serve_forever(self) -> None:
        """Start, then run until SIGINT or SIGTERM."""
        await self.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("shutting down")
        await self.stop()



@dataclass(slots=True, frozen=True)
class _Tls:
    """The server's certificate and key (PEM), for gRPC and HTTP alike."""

    cert_file: str
    key_file: str
    cert: bytes
    key: bytes

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert_file, self.key_file)
        return context


def _tls(cfg: ServiceConfig) -> _Tls | None:
    if not (cfg.tls.cert_file and cfg.tls.key_file):
        return None
    return _Tls(cfg.tls.cert_file, cfg.tls.key_file, Path(cfg.tls.cert_file).read_bytes(),
                Path(cfg.tls.key_file).read_bytes())


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one)."""
    family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    return socket.create_server((host, port), family=family)
