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
them), as engine hosts send them (`ray_host.DeltaRun`); or a token relay, one
function for all its streams that an engine calls once per step with the
tokens of every stream that shares it (`push_tokens_many`): one call a step,
not one a sequence.
"""
from __future__ import annotations

import asyncio
from collections import deque
from typing import Callable, Sequence

from rollout_service.engines.types import TokenDelta

Sink = Callable[[TokenDelta], None]
TokenSink = Callable[[list[int], list[float], int], None]  # (token ids, logprobs, version)
OnError = Callable[[BaseException], None]
# (streams, token ids of each, logprobs of each, version): one step's tokens
# for streams that share the relay; each stream's `target` is the reader's.
TokenRelay = Callable[[Sequence["DeltaStream"], Sequence[list[int]], Sequence[list[float]], int], None]


class DeltaStream:
    """An async iterator of one request's `TokenDelta`s, ending after the
    delta with a finish reason; or, once `attach`ed, a push to a sink."""

    __slots__ = ("_buffer", "_waiter", "_sink", "_token_sink", "_relay", "_on_error", "_error", "_ended", "target")

    def __init__(self) -> None:
        self._buffer: deque[TokenDelta] = deque()
        self._waiter: asyncio.Future | None = None
        self._sink: Sink | None = None
        self._token_sink: TokenSink | None = None
        self._relay: TokenRelay | None = None
        self.target: object = None  # the reader's own object for this stream, for its relay
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
                self._detach()(exc)
            return
        self._buffer.append(delta)
        self._wake()

    def push_tokens(self, token_ids: list[int], logprobs: list[float], version: int) -> None:
        """`push` of a delta of tokens and nothing else (no finish, no
        drafts, no alternatives): to the token sink if one is attached."""
        if self._relay is not None:
            push_tokens_many((self,), (token_ids,), (logprobs,), version)
            return
        token_sink = self._token_sink
        if token_sink is None:
            self.push(TokenDelta(token_ids, logprobs, version))
            return
        try:
            token_sink(token_ids, logprobs, version)
        except Exception as exc:
            self._detach()(exc)

    def fail(self, exc: BaseException) -> None:
        """End the stream with an error (the engine failed this request)."""
        if self._sink is not None:
            self._detach()(exc)
            return
        self._error = exc
        self._wake()

    def _detach(self) -> OnError:
        """Drop the sinks; returns the error callback to call once."""
        on_error = self._on_error
        self._sink = self._token_sink = self._relay = self.target = None
        return on_error

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the reader's side ---------------------------------------------------------

    def attach(self, sink: Sink, on_error: OnError, token_sink: TokenSink | None = None,
               relay: TokenRelay | None = None, target: object = None) -> None:
        """From now on call `sink(delta)` with every delta as it is pushed
        (those buffered first), in the engine's step, and `token_sink` (if
        given) with every `push_tokens`, or `relay` (if given) with this
        stream among those of a step (`push_tokens_many`; `target` is kept
        as the stream's `target` for it); an engine failure (or an exception
        from a sink) calls `on_error(exc)` once. The sinks must be cheap and
        must not call back into the engine."""
        self._sink, self._on_error, self._token_sink, self._relay = sink, on_error, token_sink, relay
        self.target = target
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


def push_tokens_many(streams: Sequence[DeltaStream], token_ids: Sequence[list[int]], logprobs: Sequence[list[float]],
                     version: int) -> None:
    """`push_tokens` for each of `streams` (one step's deltas of tokens only,
    all of `version`): one call of their relay when they share one, else
    stream by stream. A relay that raises fails the streams it was given."""
    relay = streams[0]._relay if streams else None
    if relay is None or not all(s._relay is relay for s in streams):
        for stream, ids, lps in zip(streams, token_ids, logprobs):
            stream.push_tokens(ids, lps, version)
        return
    try:
        relay(streams, token_ids, logprobs, version)
    except Exception as exc:
        for stream in streams:
            if stream._relay is relay:
                stream._detach()(exc)
