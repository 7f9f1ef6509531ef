"""The targets a bench run drives, each a `driver.RolloutTarget`.

- `GrpcTarget`: this service's gRPC API (rollout.v1) through the real
  `trainer_client.RolloutClient`; one GRPO group per `Submit`, samples from
  `StreamSamples`. TTFT and inter-token latency come from the service's
  per-sample timestamps (queued, first token, finished).
- `HttpTarget`: any OpenAI-compatible server's `/v1/completions` (this
  service's side server, `vllm serve`, SGLang): one streamed request per
  sample, TTFT and inter-token gaps measured here from the server-sent events.

`connect_grpc` and `connect_http` check the target before a run and raise
`TargetError` naming it within `timeout_s` seconds.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
import uuid
from array import array
from typing import AsyncIterator

import numpy as np

from rollout_service.bench.driver import Completion, GroupRequest, observation_ids
from rollout_service.core.clock import Clock

FINISH = {1: "stop", 2: "length", 3: "aborted"}

# What a weight push carries in a load test: the service verifies and applies
# it like any other; simulated engines only take their update time.
DUMMY_STATE = {"load_test.dummy": np.zeros(16, dtype=np.float32)}


class TargetError(Exception):
    """The target cannot be used: unreachable, the wrong kind of server, or
    it refused the credentials. The message names the target and the flag."""


def _tokens_by_version(versions) -> dict[int, int]:
    """Generated tokens per policy version, from the core's tags or the
    client's (version, start, length) segments."""
    out: dict[int, int] = {}
    for version, _, length in getattr(versions, "segments", versions):
        if version >= 0:  # observations carry no version
            out[version] = out.get(version, 0) + length
    return out


def completion(sample, prompt_len: int, keep_tokens: bool) -> Completion:
    """A driver `Completion` from a sample of the core or of the client."""
    mask = getattr(sample, "loss_mask", None)  # the core's list (the client's Sample has a method of that name)
    mask = list(mask) if isinstance(mask, list) else []
    turns = list(getattr(sample, "turns", None) or [])
    return Completion(
        sample_id=sample.sample_id,
        group_id=sample.group_id,
        index=sample.index,
        prompt_len=prompt_len,
        response_len=len(sample.response_token_ids),
        finish_reason=sample.finish_reason if isinstance(sample.finish_reason, str) else FINISH.get(int(sample.finish_reason), "unspecified"),
        queued_at=sample.queued_at,
        first_token_at=sample.first_token_at,
        finished_at=sample.finished_at,
        engines=list(sample.engines),
        num_migrations=sample.num_migrations,
        response_token_ids=list(sample.response_token_ids) if keep_tokens else None,
        min_version=sample.versions.min_version if hasattr(sample.versions, "min_version") else sample.min_version,
        max_version=sample.versions.max_version if hasattr(sample.versions, "max_version") else sample.max_version,
        tokens_by_version=_tokens_by_version(sample.versions),
        generated_len=sum(mask) if mask else (sum(t.length for t in turns if t.kind == "generated") if turns else -1),
        turns=sum(1 for t in turns if t.kind == "generated"),
        # The core's Turn says tool_s, the client's tool_seconds.
        tool_s=sum(getattr(t, "tool_s", None) or getattr(t, "tool_seconds", 0.0) for t in turns
                   if t.kind == "observation"),
    )


def _error(group: GroupRequest, index: int, status: str, now: float) -> Completion:
    """A sample the target refused or lost: delivered as an error, so a step
    never waits for it."""
    return Completion(f"{group.group_id}-{index}", group.group_id, index, len(group.prompt_token_ids), 0,
                      f"error:{status}", now, 0.0, now, [], 0)


class GrpcTarget:
    """`RolloutTarget` over the gRPC client (loopback or remote).

    `exact_lengths`: each group asks for at least its shortest and at most
    its longest target length (`max_tokens`, and `min_tokens` one less: the
    end token may come as the shortest's last) and carries the
    per-sample lengths as the simulated engines' hint; a real engine ends
    each sample within those bounds. `push_bytes`: the size of the tensor a
    weight push sends (0: the load tests' 64-byte dummy). `hints`: send the
    per-sample lengths as the simulated engines' hint (off when the model
    decides the lengths).

    Multi-turn groups are trajectories this target drives as a trainer's
    environment would: at each turn event it waits the trace's tool latency,
    then answers with the traced number of observation tokens (ids in
    [3, `vocab_size`)), or ends the trajectory after its last traced turn."""

    streams_tokens = False  # TTFT and inter-token latency from the service's timestamps

    def __init__(self, client, weights_file: str | None = None, keep_tokens: bool = False,
                 exact_lengths: bool = False, push_bytes: int = 0, hints: bool = True,
                 from_cursor: int | None = None) -> None:
        self.client = client
        self.from_cursor = from_cursor  # skip what the service delivered before (None: the client's own cursor)
        self.hints = hints
        self.weights_file = weights_file  # real engines: push this checkpoint (same host) instead of the dummy
        self.keep_tokens = keep_tokens
        self.exact_lengths = exact_lengths
        self.push_state = {"bench.push": np.zeros(push_bytes, dtype=np.uint8)} if push_bytes else DUMMY_STATE
        self._clock = Clock()
        self._errors: asyncio.Queue[Completion] = asyncio.Queue()
        self.error_examples: dict[str, str] = {}  # status -> the first error's details
        self.vocab_size = 64  # observation ids of multi-turn replays come from [3, vocab_size)
        self._trajectories: dict[str, GroupRequest] = {}  # multi-turn group id -> its request
        self._open: dict[str, int] = {}  # multi-turn group id -> trajectories not ended
        self._tools: set[asyncio.Task] = set()  # tool calls being replayed

    async def submit(self, groups: list[GroupRequest]) -> None:
        import grpc

        from trainer_client import PromptGroup

        from trainer_client import MultiTurn

        pgs = []
        for g in groups:
            if g.trajectories:
                # A turn's budget; the per-turn lengths reach simulated engines as their hint.
                self._trajectories[g.group_id] = g
                self._open[g.group_id] = g.num_samples
                pgs.append(PromptGroup(prompt_token_ids=g.prompt_token_ids or None, prompt_text=g.prompt_text,
                                       num_samples=g.num_samples, max_tokens=g.max_tokens,
                                       temperature=g.temperature, group_id=g.group_id,
                                       multi_turn=MultiTurn(max_turns=g.max_turns),
                                       metadata=g.metadata() if self.hints else {}))
                continue
            lengths = g.target_lengths if self.exact_lengths and g.target_lengths else None
            pgs.append(PromptGroup(prompt_token_ids=g.prompt_token_ids or None, prompt_text=g.prompt_text,
                                   num_samples=g.num_samples, max_tokens=max(lengths) if lengths else g.max_tokens,
                                   min_tokens=max(0, min(lengths) - 1) if lengths else 0, temperature=g.temperature,
                                   group_id=g.group_id, metadata=g.metadata() if self.hints else {}))
        try:
            await self.client.submit(pgs)
        except grpc.aio.AioRpcError as exc:
            self.error_examples.setdefault(exc.code().name, (exc.details() or "")[:200])
            # Every sample of the refused groups is delivered as an error of that status.
            for g in groups:
                for i in range(g.num_samples):
                    self._errors.put_nowait(_error(g, i, exc.code().name, self.now()))

    async def completions(self) -> AsyncIterator[Completion]:
        stream = self.client.stream(ack_every=256, from_cursor=self.from_cursor)
        pending = asyncio.ensure_future(stream.__anext__())
        try:
            while True:
                while not self._errors.empty():
                    yield self._errors.get_nowait()
                error = asyncio.ensure_future(self._errors.get())
                done, _ = await asyncio.wait({pending, error}, return_when=asyncio.FIRST_COMPLETED)
                if error in done:
                    yield error.result()
                else:
                    error.cancel()
                if pending in done:
                    try:
                        s = pending.result()
                    except StopAsyncIteration:
                        return
                    pending = asyncio.ensure_future(stream.__anext__())
                    if s.awaiting_observation:
                        task = asyncio.ensure_future(self._tool(s))
                        self._tools.add(task)
                        task.add_done_callback(self._tools.discard)
                        continue
                    self._trajectory_ended(s.group_id)
                    yield completion(s, len(s.prompt_token_ids), self.keep_tokens)
        finally:
            for task in list(self._tools):
                task.cancel()
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
            await stream.aclose()

    def _trajectory_ended(self, group_id: str) -> None:
        if group_id in self._open:
            self._open[group_id] -= 1
            if not self._open[group_id]:
                del self._open[group_id], self._trajectories[group_id]

    async def _tool(self, event) -> None:
        """Answer a turn event as the trace's tool did: after its latency,
        its observation's length, or the end after the last traced turn. A
        refused answer shows on the trajectory's sample (it ends aborted)."""
        import grpc

        g = self._trajectories.get(event.group_id)
        turn = event.turn_index
        shape = g.trajectories[event.index] if g is not None and event.index < len(g.trajectories) else None
        try:
            if shape is None or turn >= len(shape.turn_lens) - 1:
                await self.client.continue_trajectory(event.sample_id, turn, done=True)
                return
            if turn < len(shape.tool_s) and shape.tool_s[turn] > 0:
                await asyncio.sleep(shape.tool_s[turn])
            n = shape.observation_lens[turn] if turn < len(shape.observation_lens) else 0
            await self.client.continue_trajectory(event.sample_id, turn,
                                                  observation_ids(event.sample_id, turn, n, self.vocab_size))
        except grpc.aio.AioRpcError as exc:
            self.error_examples.setdefault(exc.code().name, (exc.details() or "")[:200])

    async def push_weights(self, version: int) -> None:
        if self.weights_file:
            await self.client.push_weights_file(self.weights_file, version)
        else:
            await self.client.push_weights(self.push_state, version)

    def now(self) -> float:
        return self._clock.monotonic()


async def connect_grpc(address: str, token: str | None, tls_ca_file: str | None, timeout_s: float,
                       push_bytes: int = 0, exact_lengths: bool = True, hints: bool = True):
    """A `RolloutClient` on `address` ("host:port") that answered GetStatus,
    its status, and a `GrpcTarget` over it that streams only what completes
    from now on; `TargetError` naming the target otherwise."""
    import grpc

    from trainer_client import RolloutClient

    url = f"grpc://{address}"
    client = RolloutClient(address, consumer_id=f"bench-{uuid.uuid4().hex[:8]}", token=token,
                           tls_ca_file=tls_ca_file, reconnect_timeout_s=timeout_s)
    try:
        status = await asyncio.wait_for(client.status(), timeout_s)
    except asyncio.TimeoutError:
        await client.close()
        raise TargetError(f"--target {url}: no answer to GetStatus within {timeout_s:g} s") from None
    except grpc.aio.AioRpcError as exc:
        await client.close()
        code = exc.code()
        if code == grpc.StatusCode.UNAUTHENTICATED:
            why = "refused the token (--token)"
        elif code == grpc.StatusCode.UNIMPLEMENTED:
            why = "answers gRPC but is not a rollout service (rollout.v1)"
        elif "http1.x server" in (exc.details() or ""):
            why = "is an HTTP/1.1 server, not gRPC (an OpenAI-compatible server? give http://)"
        else:
            why = f"cannot be reached ({code.name}: {exc.details()})"
        raise TargetError(f"--target {url} {why}") from None
    return client, status, GrpcTarget(client, exact_lengths=exact_lengths, push_bytes=push_bytes, hints=hints,
                                      from_cursor=status.last_cursor)


class HttpTarget:
    """`RolloutTarget` over an OpenAI-compatible `/v1/completions`: one
    request per sample, at most `max_concurrency` in flight.

    `exact_lengths`: each sample asks for exactly its target length
    (`max_tokens` = `min_tokens` = the length, `ignore_eos`; servers that
    ignore `min_tokens`/`ignore_eos`, such as OpenAI's own, only cap it).
    `stream`: server-sent events, so TTFT and inter-token gaps are measured
    here (`ttft_s`, `itl_s`: seconds)."""

    def __init__(self, session, base_url: str, model: str, exact_lengths: bool = True, stream: bool = True,
                 max_concurrency: int = 512, request_timeout_s: float = 600.0,
                 weight_push: "HttpWeightPush | None" = None) -> None:
        self.session = session
        self.weight_push = weight_push
        self.url = base_url.rstrip("/") + "/v1/completions"
        self.model = model
        self.exact_lengths = exact_lengths
        self.streams_tokens = stream
        self.request_timeout_s = request_timeout_s
        self._slots = asyncio.Semaphore(max_concurrency)
        self._done: asyncio.Queue[Completion] = asyncio.Queue()
        self._tasks: set[asyncio.Task] = set()
        self._t0 = time.monotonic()
        self.ttft_s = array("d")
        self.itl_s = array("d")
        self.error_examples: dict[str, str] = {}  # status -> the first error body seen

    def now(self) -> float:
        return time.monotonic() - self._t0

    async def submit(self, groups: list[GroupRequest]) -> None:
        if any(g.trajectories for g in groups):
            raise ValueError("multi-turn workloads cannot replay over /v1/completions: the tool turns need the "
                             "service's trajectory API (give a single-turn --workload)")
        for g in groups:
            for i in range(g.num_samples):
                task = asyncio.create_task(self._one(g, i))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    def _body(self, g: GroupRequest, i: int) -> dict:
        body = {"model": self.model, "prompt": g.prompt_text or g.prompt_token_ids, "temperature": g.temperature,
                "max_tokens": g.max_tokens, "stream": self.streams_tokens}
        if self.streams_tokens:
            body["stream_options"] = {"include_usage": True}
        if self.exact_lengths and g.target_lengths:
            n = g.target_lengths[i]
            body.update(max_tokens=n, min_tokens=n, ignore_eos=True)
        return body

    async def _one(self, g: GroupRequest, i: int) -> None:
        import aiohttp

        async with self._slots:
            queued = self.now()
            try:
                result = await asyncio.wait_for(self._request(g, i, queued), self.request_timeout_s)
            except asyncio.TimeoutError:
                result = _error(g, i, "timeout", self.now())
            except aiohttp.ClientError as exc:
                self.error_examples.setdefault("connection", str(exc)[:200])
                result = _error(g, i, "connection", self.now())
            except (ValueError, KeyError, IndexError, TypeError) as exc:  # a body that is not what the API says
                self.error_examples.setdefault("bad-response", repr(exc)[:200])
                result = _error(g, i, "bad-response", self.now())
        self._done.put_nowait(result)

    async def _request(self, g: GroupRequest, i: int, queued: float) -> Completion:
        async with self.session.post(self.url, json=self._body(g, i)) as resp:
            if resp.status != 200:
                self.error_examples.setdefault(str(resp.status), (await resp.text())[:200])
                return _error(g, i, str(resp.status), self.now())
            if not self.streams_tokens:
                doc = await resp.json()
                choice = doc["choices"][0]
                tokens = int((doc.get("usage") or {}).get("completion_tokens", 0))
                end = self.now()
                return Completion(f"{g.group_id}-{i}", g.group_id, i, len(g.prompt_token_ids), tokens,
                                  choice.get("finish_reason") or "stop", queued, 0.0, end, [], 0)
            return await self._read_stream(resp, g, i, queued)

    async def _read_stream(self, resp, g: GroupRequest, i: int, queued: float) -> Completion:
        first = last = 0.0
        chunks, tokens, finish = 0, -1, "stop"
        async for line in resp.content:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            doc = json.loads(data)
            usage = doc.get("usage")
            if usage:
                tokens = int(usage.get("completion_tokens", tokens))
            for choice in doc.get("choices") or ():
                if choice.get("text") or choice.get("token_ids"):
                    t = self.now()
                    if chunks == 0:
                        first = t
                        self.ttft_s.append(t - queued)
                    else:
                        self.itl_s.append(t - last)
                    last = t
                    chunks += 1
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
        end = self.now()
        # Without usage, one token per chunk (vLLM's and this service's streams).
        return Completion(f"{g.group_id}-{i}", g.group_id, i, len(g.prompt_token_ids),
                          tokens if tokens >= 0 else chunks, finish, queued, first or end, end, [], 0)

    async def completions(self) -> AsyncIterator[Completion]:
        while True:
            yield await self._done.get()

    async def push_weights(self, version: int) -> None:
        if self.weight_push is None:
            raise ValueError("no --push-bytes: this run pushes no weights")
        await self.weight_push.push()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.weight_push is not None:
            await self.weight_push.close()


class HttpWeightPush:
    """`--push-bytes` over an http target: vLLM's weight-transfer routes
    (`/init_weight_transfer_engine` once, then `/start_weight_update`,
    `/update_weights`, `/finish_weight_update` per push), the bench as the
    trainer, rank 0 of the group, sending one uint8 tensor of `push_bytes`
    bytes. The target's `/server_info` names its backend: gloo is sent from
    here; nccl needs vLLM and a GPU in the bench's process. A served model
    takes only its own tensors, so made-up bytes fit a fleet of simulated
    engines, whose models have none; a refusal ends the run naming it."""

    TENSOR = "bench.push"

    def __init__(self, session, base_url: str, push_bytes: int, token: str | None, tls_ca_file: str | None,
                 address: str | None = None, timeout_s: float = 120.0) -> None:
        self.session = session
        self.base_url = base_url.rstrip("/")
        self.push_bytes = push_bytes
        self.token = token
        self.tls_ca_file = tls_ca_file
        self.address = address
        self.timeout_s = timeout_s
        self.engine = None
        self.control = None

    async def _get(self, path: str) -> dict:
        async with self.session.get(self.base_url + path) as resp:  # a read route: the session's --token
            text = await resp.text()
            if resp.status != 200:
                raise TargetError(f"--push-bytes: GET {path} answered HTTP {resp.status}: {text[:200]}")
            return json.loads(text)

    def _local_address(self) -> str:
        """This host's address as the target's host sees it (the route to it)."""
        import socket
        from urllib.parse import urlsplit

        host = urlsplit(self.base_url).hostname or "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((host, 9))  # no packet leaves: only the route is chosen
                return s.getsockname()[0]
            except OSError:
                return "127.0.0.1"

    async def prepare(self) -> None:
        """Form the weight-transfer group (once)."""
        if self.engine is not None:
            return
        try:
            import torch
        except ImportError:
            raise TargetError("--push-bytes over http sends through torch.distributed: install torch") from None
        from trainer_client.collective import HttpControl, StateDictSource, free_port, init_info_for, trainer_engine

        config = (await self._get("/server_info?config_format=json")).get("vllm_config") or {}
        transfer = config.get("weight_transfer_config") if isinstance(config, dict) else None
        backend = transfer.get("backend") if isinstance(transfer, dict) else None
        if backend not in ("gloo", "nccl"):
            raise TargetError(f"--push-bytes: the target has no weight transfer (/server_info vllm_config."
                              f"weight_transfer_config: {transfer!r}); vLLM serves one when started with "
                              "--weight-transfer-config")
        world = int((await self._get("/get_world_size"))["world_size"])
        address = self.address or self._local_address()
        source = StateDictSource()
        source.state_dict = {self.TENSOR: torch.zeros(self.push_bytes, dtype=torch.uint8)}
        init = init_info_for(backend, world + 1, address, free_port(address), self.timeout_s)
        self.control = HttpControl(self.base_url, self.token, self.timeout_s, self.tls_ca_file)
        try:
            self.engine = await asyncio.to_thread(trainer_engine, init, self.control, source)
        except (RuntimeError, ValueError, OSError) as exc:
            raise TargetError(f"--push-bytes: the weight transfer group of {self.base_url} did not form "
                              f"(this host as {address}; --push-address): {exc}") from None

    async def push(self) -> None:
        await self.prepare()
        try:
            await asyncio.to_thread(self.engine.send_weights)
        except RuntimeError as exc:
            raise TargetError(f"--push-bytes: {self.base_url} refused the push: {exc}") from None

    async def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(engine.shutdown)
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.control.shutdown_weight_transfer_engine)


HTTP_KEEPALIVE_S = 2.0


async def connect_http(base_url: str, token: str | None, tls_ca_file: str | None, timeout_s: float,
                       **target_kw) -> tuple[object, dict, HttpTarget]:
    """An aiohttp session on `base_url` whose `/v1/models` answered, the
    first model it lists, and an `HttpTarget` over it; `TargetError` naming
    the target otherwise. The caller closes the session."""
    import aiohttp

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    ssl_ctx = ssl.create_default_context(cafile=tls_ca_file) if tls_ca_file else None
    # An idle connection is dropped before the server's keep-alive ends
    # (uvicorn's, under vllm serve, is 5 s): a request sent on one the server
    # is closing fails "Server disconnected", a race of the bench, not an
    # error of the target.
    connector = aiohttp.TCPConnector(limit=0, ssl=ssl_ctx if ssl_ctx is not None else True,
                                     keepalive_timeout=HTTP_KEEPALIVE_S)
    session = aiohttp.ClientSession(headers=headers, connector=connector,
                                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeout_s))
    models_url = base_url.rstrip("/") + "/v1/models"
    try:
        async with asyncio.timeout(timeout_s):
            async with session.get(models_url) as resp:
                text = await resp.text()
                status = resp.status
    except aiohttp.ClientResponseError as exc:
        await session.close()
        raise TargetError(f"--target {base_url} does not speak HTTP/1.1 (a gRPC port? give grpc://): "
                          f"{str(exc)[:80]}") from None
    except (aiohttp.ClientError, OSError) as exc:
        await session.close()
        raise TargetError(f"--target {base_url} cannot be reached: {exc}") from None
    except TimeoutError:
        await session.close()
        raise TargetError(f"--target {base_url}: no answer on /v1/models within {timeout_s:g} s") from None
    if status in (401, 403):
        await session.close()
        raise TargetError(f"--target {base_url} refused the token (--token): HTTP {status} on /v1/models")
    try:
        models = json.loads(text)["data"] if status == 200 else None
        model = models[0]
        model_id = model["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        await session.close()
        raise TargetError(f"--target {base_url} is not an OpenAI-compatible server: GET /v1/models answered "
                          f"HTTP {status} {text[:120]!r}") from None
    return session, {"id": model_id, "max_model_len": int(model.get("max_model_len") or 0)}, \
        HttpTarget(session, base_url, model_id, **target_kw)
