"""Environments: where a multi-turn trajectory's tool calls go.

A group submitted with `multi_turn.environment = "NAME"` is driven by the
service: when one of its trajectories ends a turn, the service awaits the
environment configured under that name, in a task of its own (tool time
overlaps the other trajectories' generation), and appends the observation
it returns, or ends the trajectory when it says `done`.

    [environments.search]                # a Python entry point, in the service's process
    entry_point = "my_tools.search:step"  # async def step(req: EnvRequest) -> EnvReply
    timeout_s = 30

    [environments.sandbox]               # an environment in another process
    url = "http://127.0.0.1:9000/step"
    timeout_s = 30

An entry point is `module:attribute`: an `async` function, or a class whose
instances are awaitable callables (instantiated once, without arguments).
The HTTP variant POSTs the `EnvRequest` as JSON (`finish_reason` as "stop"
or "length") and reads `{"observation_token_ids": [...]}` or
`{"observation_text": "..."}` (tokenized by the service) and `"done"`.
An environment that raises, times out or answers a non-2xx status ends
that trajectory only: its sample is delivered with what it generated,
`finish_reason` ABORTED and a `drop_reason` saying why.
"""
from __future__ import annotations

import asyncio
import dataclasses
import importlib
import inspect
from typing import Any, Awaitable, Callable, Mapping

from rollout_service.lifecycle.types import EnvReply, EnvRequest

Environment = Callable[[EnvRequest], Awaitable[EnvReply]]
KEYS = ("entry_point", "url", "timeout_s")
DEFAULT_TIMEOUT_S = 60.0


def check_environments(table: Mapping[str, Any]) -> None:
    """ValueError naming the key of an `[environments.NAME]` table that is wrong."""
    for name, entry in table.items():
        where = f"environments.{name}"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where} must be a table with entry_point or url, got {entry!r}")
        unknown = sorted(set(entry) - set(KEYS))
        if unknown:
            raise ValueError(f"{where}.{unknown[0]}: unknown key; allowed: {list(KEYS)}")
        if bool(entry.get("entry_point")) == bool(entry.get("url")):
            raise ValueError(f"{where}: set exactly one of entry_point (module:attribute) or url (http://...)")
        point = entry.get("entry_point", "")
        if point and (":" not in point or not all(point.split(":", 1))):
            raise ValueError(f"{where}.entry_point: expected 'module:attribute', got {point!r}")
        url = entry.get("url", "")
        if url and not url.startswith(("http://", "https://")):
            raise ValueError(f"{where}.url: expected an http:// or https:// URL, got {url!r}")
        timeout = entry.get("timeout_s", DEFAULT_TIMEOUT_S)
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"{where}.timeout_s: must be a positive number of seconds, got {timeout!r}")


def load_entry_point(spec: str, where: str = "entry_point") -> Environment:
    """The environment a `module:attribute` names (imported now)."""
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{where}: cannot load {spec!r}: {exc}") from exc
    if inspect.isclass(obj):
        obj = obj()
    call = obj if inspect.iscoroutinefunction(obj) else getattr(obj, "__call__", None)
    if call is None or not inspect.iscoroutinefunction(call):
        raise ValueError(f"{where}: {spec!r} is not an async function (async def f(request) -> EnvReply)")
    return obj


class HttpEnvironment:
    """An environment behind an HTTP endpoint (one POST per turn)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._session = None

    async def __call__(self, request: EnvRequest) -> EnvReply:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession()
        body = dataclasses.asdict(request)
        body["finish_reason"] = request.finish_reason.name.lower()
        async with self._session.post(self.url, json=body) as resp:
            if resp.status // 100 != 2:
                text = (await resp.text())[:200]
                raise RuntimeError(f"{self.url} answered {resp.status}: {text}")
            data = await resp.json(content_type=None)
        if not isinstance(data, dict):
            raise RuntimeError(f"{self.url} answered {type(data).__name__}, expected a JSON object")
        return EnvReply(
            observation_token_ids=[int(t) for t in data.get("observation_token_ids") or []],
            observation_text=str(data.get("observation_text") or ""),
            done=bool(data.get("done", False)),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _bounded(env: Environment, name: str, timeout_s: float) -> Environment:
    async def call(request: EnvRequest) -> EnvReply:
        try:
            reply = await asyncio.wait_for(env(request), timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no answer in {timeout_s:g} s (environments.{name}.timeout_s)") from None
        if not isinstance(reply, EnvReply):
            raise TypeError(f"returned {type(reply).__name__}, expected EnvReply")
        return reply
    return call


@dataclasses.dataclass
class Environments:
    """The configured environments, by name, each bounded by its timeout."""

    by_name: dict[str, Environment]
    _http: list[HttpEnvironment]

    @classmethod
    def build(cls, table: Mapping[str, Mapping[str, Any]]) -> "Environments":
        check_environments(table)
        by_name, http = {}, []
        for name, entry in table.items():
            if entry.get("url"):
                env: Environment = HttpEnvironment(entry["url"])
                http.append(env)
            else:
                env = load_entry_point(entry["entry_point"], f"environments.{name}.entry_point")
            by_name[name] = _bounded(env, name, float(entry.get("timeout_s", DEFAULT_TIMEOUT_S)))
        return cls(by_name, http)

    async def close(self) -> None:
        for env in self._http:
            await env.close()
