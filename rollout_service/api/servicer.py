"""The gRPC servicer: thin. It validates, translates, and calls the core;
it never decides where anything runs."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import grpc

from rollout_proto import rollout_pb2 as pb
from rollout_proto import rollout_pb2_grpc as pb_grpc
from rollout_service.api import convert, validation
from rollout_service.api.validation import FieldError, ModelLimits, TooLarge
from rollout_service.core.rollout import CoreError, RolloutCore
from rollout_service.engines.weights import (
    ManifestError,
    StagedWeights,
    TensorSpec,
    check_manifest,
    read_safetensors,
    split_and_verify,
)
from rollout_service.engines.base import EngineError, WeightsRejected

if TYPE_CHECKING:
    from rollout_service.drafter.runtime import SpecRuntime

log = logging.getLogger(__name__)

_CORE_CODES = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION,
}


async def _fail(context: grpc.aio.ServicerContext, exc: Exception):
    if isinstance(exc, (FieldError, ManifestError, WeightsRejected)):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, TooLarge):
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    if isinstance(exc, CoreError):
        await context.abort(_CORE_CODES[exc.code], str(exc))
    raise exc


class RolloutServicer(pb_grpc.RolloutServiceServicer):
    def __init__(
        self,
        core: RolloutCore,
        limits: ModelLimits,
        tokenizer: validation.Tokenizer | None,
        model_name: str,
        max_weights_bytes: int,
        push_idle_timeout_s: float = 30.0,
        spec_runtime: "SpecRuntime | None" = None,
    ) -> None:
        self.core = core
        self.limits = limits
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_weights_bytes = max_weights_bytes
        self.push_idle_timeout_s = push_idle_timeout_s
        self.spec_runtime = spec_runtime

    async def Submit(self, request: pb.SubmitRequest, context) -> pb.SubmitResponse:
        try:
            specs = validation.submit_request(request, self.limits, self.tokenizer)
            results = self.core.submit(specs)
        except (FieldError, TooLarge, CoreError) as exc:
            await _fail(context, exc)
        return pb.SubmitResponse(group_ids=[g for g, _ in results], created=[c for _, c in results])

    async def StreamSamples(self, request: pb.StreamSamplesRequest, context):
        try:
            consumer = validation.consumer_id("consumer_id", request.consumer_id)
        except FieldError as exc:
            await _fail(context, exc)
        async for entry in self.core.delivery.stream(consumer, request.from_cursor):
            yield pb.SampleEvent(
                cursor=entry.cursor,
                sample=convert.sample_to_pb(entry.sample),
                group_complete=entry.group_complete,
            )

    async def Ack(self, request: pb.AckRequest, context) -> pb.AckResponse:
        try:
            consumer = validation.consumer_id("consumer_id", request.consumer_id)
        except FieldError as exc:
            await _fail(context, exc)
        return pb.AckResponse(acked_cursor=self.core.delivery.ack(consumer, request.cursor))

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        try:
            validation.abort_request(request)
            n, partials = await self.core.abort(
                list(request.group_ids), request.batch_id, request.all, request.keep_partial
            )
        except (FieldError, CoreError) as exc:
            await _fail(context, exc)
        return pb.AbortResponse(aborted_groups=n, partial_samples=[convert.sample_to_pb(s) for s in partials])

    async def GetStatus(self, request: pb.StatusRequest, context) -> pb.StatusResponse:
        spec = self.spec_runtime.status() if self.spec_runtime is not None else None
        return convert.status_to_pb(self.core.status(), self.model_name, spec)

    async def PushWeights(self, request_iterator, context) -> pb.PushWeightsResponse:
        t0 = time.perf_counter()
        received = 0
        try:
            first = await anext(aiter(request_iterator), None)
            if first is None or first.WhichOneof("kind") != "header":
                raise FieldError("header", "the first message of PushWeights must be a WeightsHeader")
            header = first.header
            if header.target not in ("", "policy", "draft"):
                raise FieldError("header.target", f"must be 'policy' or 'draft', got {header.target!r}")
            draft = header.target == "draft"
            if draft and self.spec_runtime is None:
                raise FieldError("header.target", "'draft': the engines do not speculate (engine.spec is off)")
            check = self.spec_runtime.check_draft_weights if draft else self.core.check_weights
            if header.file_path:
                specs, buffer = await asyncio.to_thread(read_safetensors, header.file_path)
                if header.tensors:
                    specs = _match_file_manifest(convert.tensor_specs(header), specs)
                check_manifest(specs, self.max_weights_bytes)
                check(header.version, {s.name: (s.dtype, s.shape) for s in specs})
                received = len(buffer)
            else:
                specs = convert.tensor_specs(header)
                total = check_manifest(specs, self.max_weights_bytes)
                check(header.version, {s.name: (s.dtype, s.shape) for s in specs})
                buffer = bytearray(total)
                async for msg in _with_idle_timeout(request_iterator, self.push_idle_timeout_s):
                    if msg.WhichOneof("kind") != "data":
                        raise FieldError("header", "only one WeightsHeader may be sent, at the start")
                    n = len(msg.data)
                    if received + n > total:
                        raise FieldError("data", f"the stream carries more than the manifest's {total} bytes")
                    buffer[received : received + n] = msg.data
                    received += n
                if received != total:
                    raise FieldError("data", f"the stream ended after {received} of the manifest's {total} bytes")
                buffer = memoryview(buffer)
            tensors = await asyncio.to_thread(split_and_verify, specs, buffer)
            staged = StagedWeights(tensors, source_path=header.file_path or None)
            if draft:
                version = await self.spec_runtime.push_draft_weights(header.version, staged)
            else:
                version = await self.core.update_weights(header.version, staged)
        except EngineError as exc:
            log.warning("draft weight push failed on an engine: %s", exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except PushStalled as exc:
            log.warning("weight push abandoned: %s", exc)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        except (FieldError, ManifestError, WeightsRejected, CoreError, OSError) as exc:
            if isinstance(exc, OSError):
                exc = FieldError("header.file_path", f"cannot read {exc.filename!r}: {exc.strerror}")
            log.warning("weight push rejected: %s", exc)
            await _fail(context, exc)
        return pb.PushWeightsResponse(applied_version=version, bytes_received=received, seconds=time.perf_counter() - t0)


class PushStalled(Exception):
    pass


async def _with_idle_timeout(iterator, timeout_s: float):
    """The stream's messages; PushStalled when the sender goes quiet for
    longer than `timeout_s` (a stalled trainer must not hold a push forever)."""
    it = aiter(iterator)
    while True:
        try:
            msg = await asyncio.wait_for(anext(it), timeout_s)
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            raise PushStalled(f"no data for {timeout_s:g} s: push abandoned, the serving version is unchanged") from None
        yield msg


def _match_file_manifest(sent: list[TensorSpec], found: list[TensorSpec]) -> list[TensorSpec]:
    """Check a sent manifest against a file's; returns the file's specs (in
    file order) carrying the sent checksums."""
    by_name = {s.name: s for s in found}
    for i, s in enumerate(sent):
        f = by_name.get(s.name)
        if f is None:
            raise ManifestError(f"header.tensors[{i}].name", f"{s.name!r} is not in the file")
        if (f.dtype, f.shape) != (s.dtype, s.shape):
            raise ManifestError(f"header.tensors[{i}].shape", f"{s.name!r} is {f.dtype}{list(f.shape)} in the file")
    if len(sent) != len(found):
        raise ManifestError("header.tensors", f"the file holds {len(found)} tensors, the manifest lists {len(sent)}")
    sums = {s.name: s.sha256 for s in sent}
    return [TensorSpec(f.name, f.dtype, f.shape, f.byte_length, sums[f.name]) for f in found]
