"""A synchronous face over RolloutClient, for trainers that are not asyncio."""
from __future__ import annotations

import asyncio
import threading
from typing import Iterator

from trainer_client.client import RolloutClient


class SyncRolloutClient:
    """Blocking wrapper: the async client runs on a private event-loop thread.

    Usage::

        client = SyncRolloutClient("localhost:50051", consumer_id="trainer-0")
        client.submit([PromptGroup(prompt_text="...", num_samples=8, max_tokens=256)])
        for group in client.groups():
            ...
            client.push_weights(model.state_dict(), version=step + 1)
        client.close()
    """

    def __init__(self, *args, **kwargs) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-client", daemon=True)
        self._thread.start()
        self._client: RolloutClient = self._call(self._make(*args, **kwargs))

    @staticmethod
    async def _make(*args, **kwargs) -> RolloutClient:
        return RolloutClient(*args, **kwargs)

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

    @property
    def consumer_id(self) -> str:
        return self._client.consumer_id

    def wait_ready(self, timeout: float = 60.0) -> None:
        self._call(self._client.wait_ready(timeout))

    def submit(self, groups, batch_id: str = "") -> list[str]:
        return self._call(self._client.submit(groups, batch_id))

    def stream(self, **kwargs) -> Iterator:
        return self._iterate(self._client.stream(**kwargs))

    def groups(self, **kwargs) -> Iterator:
        return self._iterate(self._client.groups(**kwargs))

    def ack(self, cursor: int | None = None) -> int:
        return self._call(self._client.ack(cursor))

    def abort(self, *args, **kwargs):
        return self._call(self._client.abort(*args, **kwargs))

    def push_weights(self, state_dict, version: int, **kwargs):
        return self._call(self._client.push_weights(state_dict, version, **kwargs))

    def push_weights_file(self, path: str, version: int, target: str = "policy"):
        return self._call(self._client.push_weights_file(path, version, target))

    def status(self):
        return self._call(self._client.status())

    def close(self) -> None:
        self._call(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
