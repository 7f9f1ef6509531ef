"""One request's token deltas, from its engine to one reader.

An engine pushes a request's deltas as its steps complete. The reader either
iterates (`async for`: a task wake-up and a queue hand-off per delta) or
attaches a sink: a plain function the engine's step calls with each delta as
it is pushed, so a step's deltas reach the reader in one pass, with no task
switch per delta. An engine that steps every sequence every step hands its
reader one delta per sequence per step: with a fleet of such engines the
sink is what keeps the reader's (the core's) cost per token low. A reader
may also attach a token sink, for deltas of tokens and nothing else (no
finish, drafts or alternatives: `push_tokens`, no delta object is built for
them), as engine hosts send them (`ray_host.DeltaRun`).
"""
from __future__ import annotations

import asyncio
from collections import deque
from typing import Callable

from rollout_service.engines.types import TokenDelta

Sink = Callable[[TokenDelta], None]
TokenSink = Callable[[list[int], list[float], int], None]  # (token ids, logprobs, version)
OnError = Callable[[BaseException], None]


class DeltaStream:
    """An async iterator of one request's `TokenDelta`s, ending after the
    delta with a finish reason; or, once `attach`ed, a push to a sink."""

    __slots__ = ("_buffer", "_waiter", "_sink", "_token_sink", "_on_error", "_error", "_ended")

    def __init__(self) -> None:
        self._buffer: deque[TokenDelta] = deque()
        self._waiter: asyncio.Future | None = None
        self._sink: Sink | None = None
        self._token_sink: TokenSink | None = None
        self._on_error: OnError | None = None
        self._error: BaseException | None = None
        self._ended = False

    # -- the engine's side ---------------------------------------------------------

    def push(self, delta: TokenDelta) -> None:
        """Hand over a delta (never blocks, never raises: what the sink
        raises goes to its `on_error`, and the sink is detached)."""
        if self._sink is not None:
            try:
                self._sink(delta)
            except Exception as exc:
                on_error, self._sink, self._token_sink = self._on_error, None, None
                on_error(exc)
            return
        self._buffer.append(delta)
        self._wake()

    def push_tokens(self, token_ids: list[int], logprobs: list[float], version: int) -> None:
        """`push` of a delta of tokens and nothing else (no finish, no
        drafts, no alternatives): to the token sink if one is attached."""
        token_sink = self._token_sink
        if token_sink is None:
            self.push(TokenDelta(token_ids, logprobs, version))
            return
        try:
            token_sink(token_ids, logprobs, version)
        except Exception as exc:
            on_error, self._sink, self._token_sink = self._on_error, None, None
            on_error(exc)

    def fail(self, exc: BaseException) -> None:
        """End the stream with an error (the engine failed this request)."""
        if self._sink is not None:
            self._sink = self._token_sink = None
            self._on_error(exc)
            return
        self._error = exc
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the reader's side ---------------------------------------------------------

    def attach(self, sink: Sink, on_error: OnError, token_sink: TokenSink | None = None) -> None:
        """From now on call `sink(delta)` with every delta as it is pushed
        (those buffered first), in the engine's step, and `token_sink` (if
        given) with every `push_tokens`; an engine failure (or an exception
        from a sink) calls `on_error(exc)` once. The sinks must be cheap and
        must not call back into the engine."""
        self._sink, self._on_error, self._token_sink = sink, on_error, token_sink
        while self._buffer and self._sink is not None:
            self.push(self._buffer.popleft())
        if self._error is not None and self._sink is not None:
            self.fail(self._error)

    def __aiter__(self) -> "DeltaStream":
        return self

    async def __anext__(self) -> TokenDelta:
        while not self._buffer:
            if self._ended:
                raise StopAsyncIteration
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        if self._ended:
            raise StopAsyncIteration
        delta = self._buffer.popleft()
        if delta.finish_reason is not None:
            self._ended = True
        return delta
