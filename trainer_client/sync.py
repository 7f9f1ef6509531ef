"""A synchronous face over RolloutClient, for trainers that are not asyncio."""
from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from typing import Iterator

from trainer_client.client import RolloutClient


def _blocking(method):
    """`method` of RolloutClient as a blocking call: same signature, same
    docstring, run on the client's event-loop thread."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        return self._call(method(self._client, *args, **kwargs))

    return call


def _blocking_iter(method):
    """An async-iterator method of RolloutClient as a plain iterator: same
    parameters and docstring; returns `Iterator[...]` instead of
    `AsyncIterator[...]`."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        return self._iterate(method(self._client, *args, **kwargs))

    sig = inspect.signature(method)
    returns = sig.return_annotation
    if isinstance(returns, str):  # postponed annotations (from __future__ import annotations)
        returns = returns.replace("AsyncIterator", "Iterator")
    call.__signature__ = sig.replace(return_annotation=returns)
    return call


class SyncRolloutClient:
    """Blocking wrapper: the async client runs on a private event-loop thread.
    Every method has `RolloutClient`'s signature and docstring, and returns
    the same values (iterators instead of async iterators).

    Usage::

        client = SyncRolloutClient("localhost:50051", consumer_id="trainer-0")
        client.submit([PromptGroup(prompt_text="...", num_samples=8, max_tokens=256)])
        for group in client.groups():
            ...
            client.push_weights(model.state_dict(), version=step + 1)
        client.close()
    """

    @functools.wraps(RolloutClient.__init__)
    def __init__(self, *args, **kwargs) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-client", daemon=True)
        self._thread.start()
        self._client: RolloutClient = self._call(self._make(*args, **kwargs))

    @staticmethod
    async def _make(*args, **kwargs) -> RolloutClient:
        return RolloutClient(*args, **kwargs)  # the channel binds to the running (private) loop

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _iterate(self, agen) -> Iterator:
        try:
            while True:
                try:
                    yield self._call(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._call(agen.aclose())

    def __enter__(self) -> "SyncRolloutClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def consumer_id(self) -> str:
        return self._client.consumer_id

    @property
    def last_cursor(self) -> int:
        """Highest cursor received."""
        return self._client.last_cursor

    @property
    def acked_cursor(self) -> int:
        """Highest cursor acknowledged."""
        return self._client.acked_cursor

    wait_ready = _blocking(RolloutClient.wait_ready)
    submit = _blocking(RolloutClient.submit)
    submit_detailed = _blocking(RolloutClient.submit_detailed)
    stream = _blocking_iter(RolloutClient.stream)
    groups = _blocking_iter(RolloutClient.groups)
    trajectory_groups = _blocking_iter(RolloutClient.trajectory_groups)
    continue_trajectory = _blocking(RolloutClient.continue_trajectory)
    ack = _blocking(RolloutClient.ack)
    abort = _blocking(RolloutClient.abort)
    push_weights = _blocking(RolloutClient.push_weights)
    push_weights_file = _blocking(RolloutClient.push_weights_file)
    push_weights_collective = _blocking(RolloutClient.push_weights_collective)
    close_collective = _blocking(RolloutClient.close_collective)
    status = _blocking(RolloutClient.status)

    def close(self) -> None:
        """Close the connection and stop the client's event-loop thread."""
        self._call(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
