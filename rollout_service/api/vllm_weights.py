"""vLLM's weight-transfer routes, mapped onto the service's collective push
(core/collective.py): one trainer-side group over every engine's workers,
the trainer at rank 0 and each engine at its own rank offset, so the
trainer sends each byte once whatever the number of engines. They need
the weights token (api/auth.py).

- `POST /init_weight_transfer_engine {"init_info": {...}}`: `master_address`,
  `master_port`, `world_size` (= 1 + `/get_world_size`), `rank_offset` 1,
  optional `timeout_s`, and the backend's own keys (gloo: `chunk_bytes`,
  `mode`; NCCL: `packed`, ...), passed to every engine. Forms the group
  (no stager rank: an engine that restarts serves the model's own weights,
  tagged version 0, until the next push).
- `POST /start_weight_update`: opens a push (409 while another is open).
- `POST /update_weights {"update_info": {"names", "dtype_names", "shapes", ...}}`:
  the manifest is checked against the served model before a byte moves,
  then every engine receives; answers once all have received.
- `POST /finish_weight_update {"weight_version": label?}`: the version
  (the serving one + 1) goes live on every engine at once; `weight_version`
  labels it in `/weight_info` and in `weight_versions` spans. A push not
  finished within the group's timeout is abandoned: the previous weights
  serve again.
- `POST /update_weight_version {"new_version": label}`: relabels the serving
  version; `POST /shutdown_weight_transfer_engine`: leaves the group.
- `POST /start_draft_weight_update`: 501 (draft weights go through
  `PushWeights` with target "draft").
"""
from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web

from rollout_service.api.collective import MAX_TIMEOUT_S, _backend
from rollout_service.api.openai_http import BadRequest, OpenAIFrontEnd, _short, error_response, read_body
from rollout_service.core.rollout import CoreError, RolloutCore
from rollout_proto.dtypes import DTYPE_SIZES

log = logging.getLogger(__name__)

_STATUS = {"invalid": 400, "not_found": 404, "failed_precondition": 409, "unavailable": 503, "exhausted": 429}
_GROUP_KEYS = ("master_address", "master_port", "world_size", "rank_offset", "timeout_s")
DEFAULT_TIMEOUT_S = 60.0  # a push's group timeout when `init_info` names none (seconds)


class _Push:
    """One push between /start_weight_update and /finish_weight_update."""

    def __init__(self) -> None:
        self.task: asyncio.Task | None = None
        self.received = asyncio.Event()
        self.finish = asyncio.Event()


class VllmWeightTransfer:
    """The weight-transfer routes over `core.collective`."""

    def __init__(self, front: OpenAIFrontEnd) -> None:
        self.front = front
        self.core: RolloutCore = front.core
        self.timeout_s = DEFAULT_TIMEOUT_S
        self._push: _Push | None = None

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/init_weight_transfer_engine", self.init)
        app.router.add_post("/shutdown_weight_transfer_engine", self.shutdown)
        app.router.add_post("/start_weight_update", self.start)
        app.router.add_post("/update_weights", self.update)
        app.router.add_post("/finish_weight_update", self.finish)
        app.router.add_post("/update_weight_version", self.relabel)
        app.router.add_post("/start_draft_weight_update", self.draft)

    @staticmethod
    async def _body(request: web.Request, key: str | None, required: bool = True) -> dict:
        """The JSON body (`{}` when empty), or its `key` object; BadRequest naming what is wrong."""
        raw = await read_body(request)
        try:
            body = json.loads(raw) if raw.strip() else {}
        except (ValueError, RecursionError):
            raise BadRequest("body", "must be a JSON object") from None
        if not isinstance(body, dict):
            raise BadRequest("body", "must be a JSON object")
        if key is None:
            return body
        value = body.get(key)
        if value is None and not required:
            return {}
        if value is None and key == "update_info" and "weight_dir" in body:
            raise BadRequest("weight_dir", "a directory to load weights from is prime-rl's own /update_weights, not "
                                           "vLLM's: send update_info (vLLM's weight transfer), or push the weights "
                                           "with the trainer client")
        if not isinstance(value, dict):
            raise BadRequest(key, f"must be an object, got {_short(value)}")
        return value

    def _error(self, exc: Exception) -> web.Response:
        if isinstance(exc, BadRequest):
            return error_response(400, str(exc), exc.param)
        if isinstance(exc, CoreError):
            status = _STATUS.get(exc.code, 409)
            return error_response(status, str(exc), kind="invalid_request_error" if status < 500 else "server_error")
        return error_response(503, f"the weight push failed ({type(exc).__name__}: {exc}); the previous version "
                                   "serves", kind="server_error")

    async def init(self, request: web.Request) -> web.Response:
        try:
            info = await self._body(request, "init_info")
            address, port = info.get("master_address"), info.get("master_port")
            if not isinstance(address, str) or not address:
                raise BadRequest("init_info.master_address", f"must be the trainer's address, got {_short(address)}")
            if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
                raise BadRequest("init_info.master_port", f"must be a TCP port, got {_short(port)}")
            world = info.get("world_size")
            if not isinstance(world, int) or isinstance(world, bool) or world < 2:
                raise BadRequest("init_info.world_size", f"must be an integer of at least 2, got {_short(world)}")
            if info.get("rank_offset", 1) != 1:
                raise BadRequest("init_info.rank_offset", "the fleet's ranks start at 1 (the trainer is rank 0), got "
                                 f"{_short(info.get('rank_offset'))}")
            timeout = info.get("timeout_s", DEFAULT_TIMEOUT_S)
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_TIMEOUT_S:
                raise BadRequest("init_info.timeout_s", f"must be in (0, {MAX_TIMEOUT_S:g}], got {_short(timeout)}")
            if self._push is not None:
                raise CoreError("failed_precondition", "a weight update is open: finish it first")
            options = {k: v for k, v in info.items() if k not in _GROUP_KEYS}
            plan = await self.core.collective.init(_backend(self.core, ""), address, port, world, float(timeout),
                                                   options, stage=False)
        except (BadRequest, CoreError) as exc:
            if isinstance(exc, CoreError) and exc.code == "invalid" and "world_size" in str(exc):
                return error_response(400, str(exc), "init_info.world_size")
            return self._error(exc)
        except Exception as exc:
            log.warning("weight transfer group refused: %s", exc)
            return self._error(exc)
        self.timeout_s = float(timeout)
        log.info("weight transfer group over HTTP: %s, %d ranks", plan.backend, plan.world_size)
        return web.json_response({"message": "Weight transfer initialized"})

    async def shutdown(self, _request: web.Request) -> web.Response:
        if self._push is not None:
            return error_response(409, "a weight update is open: finish it first")
        await self.core.collective.close()
        return web.json_response({"message": "Weight transfer shut down"})

    async def start(self, _request: web.Request) -> web.Response:
        if self._push is not None:
            return error_response(409, "a weight update is already open: finish it first")
        if self.core.collective.plan_in_force is None:
            return error_response(409, "no weight transfer group: call /init_weight_transfer_engine first")
        self._push = _Push()
        return web.json_response({"message": "Weight update started"})

    async def update(self, request: web.Request) -> web.Response:
        push = self._push
        try:
            info = await self._body(request, "update_info")
            manifest = _manifest(info)
            if push is None or push.task is not None:
                raise CoreError("failed_precondition", "no weight update is open: call /start_weight_update first")
        except (BadRequest, CoreError) as exc:
            if isinstance(exc, BadRequest) and push is not None and push.task is None and self._push is push:
                self._push = None  # the open update's manifest is refused: that update is over
            return self._error(exc)
        version = self.core.policy_version + 1
        timeout = self.timeout_s

        async def accepted() -> None:
            pass

        async def received() -> None:
            push.received.set()
            # Live at /finish_weight_update, on every engine at once; a
            # trainer that never calls it gets the push abandoned.
            await asyncio.wait_for(push.finish.wait(), timeout)

        def ended(task: asyncio.Task) -> None:
            # Failed or abandoned (no finish in time): the next push may start.
            if self._push is push and (task.cancelled() or task.exception() is not None):
                self._push = None

        push.task = asyncio.ensure_future(self.core.push_collective(version, manifest, accepted, received))
        push.task.add_done_callback(ended)
        waiter = asyncio.ensure_future(push.received.wait())
        await asyncio.wait({waiter, push.task}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if push.task.done() and push.task.exception() is not None:
            self._push = None
            return self._error(push.task.exception())
        return web.json_response({"message": "Weights updated"})

    async def finish(self, request: web.Request) -> web.Response:
        push = self._push
        try:
            body = await self._body(request, None)
            label = body.get("weight_version")
            if label is not None and not (isinstance(label, str) and label):
                raise BadRequest("weight_version", f"must be a non-empty string, got {_short(label)}")
        except BadRequest as exc:
            return self._error(exc)
        if push is None:
            return error_response(409, "no weight update is open: call /start_weight_update first")
        self._push = None
        if push.task is None:  # opened, nothing sent: nothing changes
            return web.json_response({"message": "Weight update finished"})
        push.finish.set()
        try:
            version = await asyncio.wait_for(asyncio.shield(push.task), self.timeout_s * 2 + 60)
        except Exception as exc:
            return self._error(exc)
        if label is not None:
            self.front.version_labels[version] = label
        return web.json_response({"message": "Weight update finished"})

    async def relabel(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request, None)
            label = body.get("new_version")
            if not isinstance(label, str) or not label:
                raise BadRequest("new_version", f"must be a non-empty string, got {_short(label)}")
        except BadRequest as exc:
            return self._error(exc)
        self.front.version_labels[self.core.policy_version] = label
        return web.json_response({"success": True, "new_version": label})

    async def draft(self, request: web.Request) -> web.Response:
        return error_response(501, f"{request.path}: draft weights reach this service through gRPC PushWeights "
                                   "with target \"draft\" (trainer_client.RolloutClient.push_weights)",
                              kind="not_implemented")


def _manifest(info: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) per tensor of vLLM's update info; BadRequest naming the field."""
    names, dtypes, shapes = info.get("names"), info.get("dtype_names"), info.get("shapes")
    for key, value in (("names", names), ("dtype_names", dtypes), ("shapes", shapes)):
        if not isinstance(value, list) or not value:
            raise BadRequest(f"update_info.{key}", f"must be a non-empty list, got {_short(value)}")
    if not len(names) == len(dtypes) == len(shapes):
        raise BadRequest("update_info.names", f"names, dtype_names and shapes differ in length "
                                              f"({len(names)}, {len(dtypes)}, {len(shapes)})")
    out, seen = [], set()
    for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes)):
        if not isinstance(name, str) or not name or name in seen:
            raise BadRequest(f"update_info.names[{i}]", f"must be a new tensor name, got {_short(name)}")
        seen.add(name)
        dtype = dtype.removeprefix("torch.") if isinstance(dtype, str) else dtype
        if dtype not in DTYPE_SIZES:
            raise BadRequest(f"update_info.dtype_names[{i}]", f"{name!r}: unknown dtype {_short(dtype)}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise BadRequest(f"update_info.shapes[{i}]", f"{name!r}: must be a list of dimensions, got {_short(shape)}")
        out.append((name, dtype, tuple(shape)))
    return out
