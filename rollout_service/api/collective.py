"""rollout.v1's collective weight-transfer RPCs (core/collective.py does
the work): request validation and the event stream of a push."""
from __future__ import annotations

import asyncio
import json
import logging
import time

import grpc

from rollout_proto import rollout_pb2 as pb
from rollout_proto.devices import RankDevice
from rollout_proto.dtypes import DTYPE_SIZES
from rollout_service.api.validation import FieldError
from rollout_service.core.rollout import CoreError, RolloutCore
from rollout_service.engines.base import EngineError, WeightsRejected

log = logging.getLogger(__name__)

_CODES = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
}

MAX_TIMEOUT_S = 3600.0


def _plan_pb(plan) -> pb.WeightTransferPlan:
    return pb.WeightTransferPlan(backend=plan.backend, world_size=plan.world_size,
                                 engine_ids=[eid for eid, _, _ in plan.members],
                                 first_ranks=[first for _, first, _ in plan.members], stager_rank=plan.stager_rank)


def _backend(core: RolloutCore, backend: str) -> str:
    if backend:
        return backend
    for engine in core.fleet.live():
        choose = getattr(engine, "transfer_backend", None)
        return choose() if callable(choose) else "gloo"
    return "gloo"


async def _abort(context, exc: Exception):
    if isinstance(exc, (FieldError, WeightsRejected)):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, CoreError):
        await context.abort(_CODES.get(exc.code, grpc.StatusCode.FAILED_PRECONDITION), str(exc))
    await context.abort(grpc.StatusCode.UNAVAILABLE,
                        f"the collective push failed ({type(exc).__name__}: {exc}); the previous version serves")


def _trainer_device(request) -> RankDevice | None:
    if not request.HasField("trainer_device"):
        return None
    d = request.trainer_device
    return RankDevice(d.host, d.device or "cpu", d.uuid, d.pci_bus_id)


async def get_plan(core: RolloutCore, request: pb.WeightTransferPlanRequest, context) -> pb.WeightTransferPlan:
    """The group's shape; refused if two of its ranks would share a GPU
    (checked here too, so a trainer learns it before it opens any group)."""
    try:
        plan = core.collective.plan(_backend(core, request.backend))
        await core.collective.check_devices(plan, _trainer_device(request))
        return _plan_pb(plan)
    except CoreError as exc:
        log.warning("collective transfer group refused: %s", exc)
        await _abort(context, exc)


def _options(text: str) -> dict:
    if not text:
        return {}
    try:
        options = json.loads(text)
    except ValueError as exc:
        raise FieldError("options_json", f"not JSON: {exc}") from None
    if not isinstance(options, dict):
        raise FieldError("options_json", "must be a JSON object")
    return options


async def init(core: RolloutCore, request: pb.InitWeightTransferRequest, context) -> pb.WeightTransferPlan:
    try:
        if not request.master_address:
            raise FieldError("master_address", "required (the trainer's rendezvous address)")
        if not 0 < request.master_port < 65536:
            raise FieldError("master_port", f"must be a TCP port, got {request.master_port}")
        if request.world_size < 2:
            raise FieldError("world_size", f"must be at least 2, got {request.world_size}")
        if not 0 <= request.timeout_s <= MAX_TIMEOUT_S:
            raise FieldError("timeout_s", f"must be in [0, {MAX_TIMEOUT_S:g}], got {request.timeout_s}")
        options = _options(request.options_json)
        mode = options.get("mode", "chain")
        if mode not in ("chain", "broadcast"):
            raise FieldError("options_json", f"mode must be 'chain' or 'broadcast', got {mode!r}")
        plan = await core.collective.init(_backend(core, request.backend), request.master_address,
                                          request.master_port, request.world_size, request.timeout_s or 60.0, options,
                                          _trainer_device(request))
    except (FieldError, CoreError, EngineError) as exc:
        log.warning("collective transfer group refused: %s", exc)
        await _abort(context, exc)
    return _plan_pb(plan)


def _manifest(request: pb.CollectiveUpdateRequest) -> list[tuple[str, str, tuple[int, ...]]]:
    if request.version <= 0:
        raise FieldError("version", f"must be positive, got {request.version}")
    if not request.tensors:
        raise FieldError("tensors", "the manifest is empty")
    out, seen = [], set()
    for i, t in enumerate(request.tensors):
        if not t.name:
            raise FieldError(f"tensors[{i}].name", "required")
        if t.name in seen:
            raise FieldError(f"tensors[{i}].name", f"{t.name!r} appears twice")
        seen.add(t.name)
        if t.dtype not in DTYPE_SIZES:
            raise FieldError(f"tensors[{i}].dtype", f"{t.name!r}: unknown dtype {t.dtype!r}")
        if any(d < 0 for d in t.shape):
            raise FieldError(f"tensors[{i}].shape", f"{t.name!r}: negative dimension in {list(t.shape)}")
        out.append((t.name, t.dtype, tuple(int(d) for d in t.shape)))
    return out


async def update(core: RolloutCore, request: pb.CollectiveUpdateRequest, context):
    """The event stream of one push. The push runs in its own task: a
    trainer that hangs up does not cut it short (the group's timeout ends a
    transfer that stalls, and the previous weights are put back)."""
    t0 = time.perf_counter()
    try:
        manifest = _manifest(request)
    except FieldError as exc:
        await _abort(context, exc)
    events: asyncio.Queue = asyncio.Queue()

    async def accepted() -> None:
        events.put_nowait(pb.CollectiveUpdateEvent.ACCEPTED)

    async def received() -> None:
        events.put_nowait(pb.CollectiveUpdateEvent.RECEIVED)

    task = asyncio.ensure_future(core.push_collective(request.version, manifest, accepted, received))
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved even if the trainer left
    while True:
        getter = asyncio.ensure_future(events.get())
        done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
        if getter in done:
            yield pb.CollectiveUpdateEvent(phase=getter.result(), seconds=time.perf_counter() - t0)
            continue
        getter.cancel()
        break
    while not events.empty():
        yield pb.CollectiveUpdateEvent(phase=events.get_nowait(), seconds=time.perf_counter() - t0)
    try:
        version = task.result()
    except Exception as exc:  # every failure leaves the previous version serving
        log.warning("collective push of version %d failed: %s", request.version, exc)
        await _abort(context, exc)
    yield pb.CollectiveUpdateEvent(phase=pb.CollectiveUpdateEvent.LIVE, applied_version=version,
                                   seconds=time.perf_counter() - t0)


async def close(core: RolloutCore, request, context) -> pb.CloseWeightTransferResponse:
    if core.collective.pushing is not None:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "a collective push is being applied")
    await core.collective.close()
    return pb.CloseWeightTransferResponse()
