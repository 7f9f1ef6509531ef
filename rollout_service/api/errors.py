"""The last line of error handling, for gRPC and HTTP alike.

Every expected failure is turned into a status naming the field or resource
where it happens (the servicer, the validation, the front ends). What still
escapes a handler (a failure inside the service) reaches the client as a
status naming the call and the kind of failure, never as gRPC UNKNOWN or
HTTP 500 and never with a traceback or a path; the traceback is logged here:

    TimeoutError      -> DEADLINE_EXCEEDED  (HTTP 504)
    MemoryError       -> RESOURCE_EXHAUSTED (HTTP 503)
    any other failure -> UNAVAILABLE        (HTTP 503)
"""
from __future__ import annotations

import asyncio
import inspect
import logging

import grpc
from aiohttp import web

log = logging.getLogger(__name__)


def _describe(exc: BaseException) -> tuple[grpc.StatusCode, int, str]:
    """(gRPC code, HTTP status, message) for an unexpected failure: the
    exception's kind and, for an OSError, its error text without the file
    name (no path reaches a client)."""
    name = type(exc).__name__
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, 504, f"timed out inside the service ({name})"
    if isinstance(exc, MemoryError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, 503, "out of memory inside the service"
    if isinstance(exc, OSError) and exc.strerror:
        return grpc.StatusCode.UNAVAILABLE, 503, f"failed inside the service ({name}: {exc.strerror})"
    return grpc.StatusCode.UNAVAILABLE, 503, f"failed inside the service ({name}); the error is logged there"


async def _abort(context, method: str, exc: Exception) -> None:
    code, _, message = _describe(exc)
    log.error("%s failed", method, exc_info=exc)
    await context.abort(code, f"{method.rsplit('/', 1)[-1]}: {message}")


def _wrap_unary(fn, method: str):
    async def wrapped(request, context):
        try:
            return await fn(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, method, exc)
    return wrapped


def _wrap_stream(fn, method: str):
    async def wrapped(request, context):
        try:
            async for item in fn(request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, method, exc)
    return wrapped


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every method handler of the server (see the module docstring)."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            fn = getattr(handler, kind)
            if fn is None:
                continue
            wrap = _wrap_stream if inspect.isasyncgenfunction(fn) else _wrap_unary
            return handler._replace(**{kind: wrap(fn, method)})
        return handler


def error_json(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> web.Response:
    """vLLM's (OpenAI-shaped) JSON error: `param` names the offending field,
    `code` is the HTTP status."""
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": status}},
                             status=status)


@web.middleware
async def http_errors(request: web.Request, handler):
    """aiohttp's own refusals (404, 405, 413) as JSON errors naming the
    route; an unexpected failure as 503/504 (see the module docstring)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_json(exc.status, f"{request.method} {request.path}: {exc.reason}", kind="invalid_request_error")
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        if request.transport is None or request.transport.is_closing():
            raise  # the client went away: nothing to answer
        _, status, message = _describe(exc)
        log.error("%s %s failed", request.method, request.path, exc_info=exc)
        return error_json(status, f"{request.method} {request.path}: {message}", kind="server_error")
