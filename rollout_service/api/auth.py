"""Bearer-token authentication for gRPC and HTTP.

Two kinds of token: `submit` tokens may generate (Submit, StreamSamples,
Ack, Abort, GetStatus, the OpenAI endpoints); `weights` tokens may also push
weights and use vLLM's control routes (`WEIGHTS_HTTP`: pause, resume,
abort, weight transfer). With no token configured, authentication is off. Tokens are
compared in constant time and never logged.
"""
from __future__ import annotations

import hmac

import grpc
from aiohttp import web

_SERVICE_PREFIX = "/rollout.v1.RolloutService/"
_OPEN_HTTP = ("/healthz", "/health", "/readyz", "/metrics")
# HTTP routes that change what the fleet serves or stop others' requests
# (vLLM's RL control routes): the weights token, as PushWeights.
WEIGHTS_HTTP = frozenset({"/pause", "/resume", "/abort_requests", "/init_weight_transfer_engine",
                          "/shutdown_weight_transfer_engine", "/start_weight_update", "/start_draft_weight_update",
                          "/update_weights", "/finish_weight_update", "/update_weight_version"})


# RPCs that change the served weights (or the group that carries them).
WEIGHTS_METHODS = frozenset({"PushWeights", "InitWeightTransfer", "CollectiveUpdate", "CloseWeightTransfer"})


class TokenAuth:
    def __init__(self, submit_tokens: list[str], weights_tokens: list[str]) -> None:
        self._submit = [t.encode() for t in submit_tokens if t]
        self._weights = [t.encode() for t in weights_tokens if t]

    @property
    def enabled(self) -> bool:
        return bool(self._submit or self._weights)

    @staticmethod
    def _match(token: bytes, tokens: list[bytes]) -> bool:
        return any(hmac.compare_digest(token, t) for t in tokens)

    def check(self, header: str | None, need: str) -> tuple[grpc.StatusCode, str] | None:
        """None when `header` ("Bearer <token>") grants `need` ("submit" or
        "weights"); else the status to refuse with."""
        if not self.enabled:
            return None
        if not header or not header.startswith("Bearer "):
            return grpc.StatusCode.UNAUTHENTICATED, "authorization: a bearer token is required"
        token = header[len("Bearer "):].strip().encode()
        if self._match(token, self._weights):
            return None
        if self._match(token, self._submit):
            if need == "weights":
                return grpc.StatusCode.PERMISSION_DENIED, "authorization: this token may not push weights or pause the fleet"
            return None
        return grpc.StatusCode.UNAUTHENTICATED, "authorization: invalid token"


def _deny(handler, code: grpc.StatusCode, message: str):
    async def unary(request, context):
        await context.abort(code, message)

    async def streaming_response(request, context):
        await context.abort(code, message)
        yield  # pragma: no cover (makes this an async generator)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming_response)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming_response)
    return grpc.unary_unary_rpc_method_handler(unary)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses rollout.v1 calls without a valid token; health checks and
    reflection stay open."""

    def __init__(self, auth: TokenAuth) -> None:
        self.auth = auth

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(_SERVICE_PREFIX):
            return handler
        metadata = dict(details.invocation_metadata or ())
        need = "weights" if details.method.rsplit("/", 1)[-1] in WEIGHTS_METHODS else "submit"
        refusal = self.auth.check(metadata.get("authorization"), need)
        return handler if refusal is None else _deny(handler, *refusal)


def http_middleware(auth: TokenAuth):
    @web.middleware
    async def middleware(request: web.Request, handler):
        if request.path not in _OPEN_HTTP:
            need = "weights" if request.path in WEIGHTS_HTTP else "submit"
            refusal = auth.check(request.headers.get("Authorization"), need)
            if refusal is not None:
                code, message = refusal
                status = 401 if code == grpc.StatusCode.UNAUTHENTICATED else 403
                return web.json_response({"error": {"message": message, "type": "authentication_error",
                                                    "param": "authorization", "code": status}}, status=status)
        return await handler(request)

    return middleware
