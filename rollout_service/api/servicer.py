"""The gRPC servicer: thin. It validates, translates, and calls the core;
it never decides where anything runs."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import grpc

from rollout_proto import rollout_pb2 as pb
from rollout_proto import rollout_pb2_grpc as pb_grpc
from rollout_service.api import collective, convert, validation
from rollout_service.api.validation import FieldError, ModelLimits, TooLarge
from rollout_service.core.rollout import CoreError, RolloutCore
from rollout_service.api.weights_receiver import PUSH_ACCEPTED, ApplyFailed, ApplyTimedOut, PushStalled, WeightsReceiver
from rollout_service.engines.base import WeightsRejected
from rollout_service.engines.types import FinishReason
from rollout_service.engines.weights import ManifestError
from rollout_service.lifecycle.types import Sample

if TYPE_CHECKING:
    from rollout_service.drafter.runtime import SpecRuntime

log = logging.getLogger(__name__)

INCARNATION_KEY = "rollout-incarnation"  # the stream's initial metadata: the service's incarnation

_CORE_CODES = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "permission_denied": grpc.StatusCode.PERMISSION_DENIED,
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
        weights_file_dirs: "list[str] | tuple[str, ...]" = (),
        max_message_bytes: int = 64 * 2**20,
    ) -> None:
        self.core = core
        self.limits = limits
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.spec_runtime = spec_runtime
        self.max_message_bytes = max_message_bytes
        self.weights = WeightsReceiver(core, max_weights_bytes, push_idle_timeout_s, spec_runtime, weights_file_dirs)

    async def Submit(self, request: pb.SubmitRequest, context) -> pb.SubmitResponse:
        try:
            specs = await validation.submit_request_off_loop(request, self.limits, self.tokenizer)
            results = self.core.submit(specs)
            await self.core.commit()  # with a state_dir: the groups are journaled before the reply
        except (FieldError, TooLarge, CoreError) as exc:
            await _fail(context, exc)
        return pb.SubmitResponse(group_ids=[g for g, _ in results], created=[c for _, c in results],
                                 incarnation=self.core.incarnation)

    async def StreamSamples(self, request: pb.StreamSamplesRequest, context):
        try:
            consumer = validation.consumer_id("consumer_id", request.consumer_id)
        except FieldError as exc:
            await _fail(context, exc)
        incarnation = self.core.incarnation
        # Before any event: a client that reconnects learns at once whether
        # this is the service its cursors belong to.
        await context.send_initial_metadata(((INCARNATION_KEY, incarnation),))
        try:
            # A consumer seen for the first time is durable before it gets a
            # sample: a restart keeps what it has not acknowledged.
            self.core.delivery.consumer(consumer)
            try:
                await self.core.commit()
            except CoreError:
                pass  # the journal stopped: the stream sends what was recorded, then ends saying why
            async for entry in self.core.delivery.stream(consumer, request.from_cursor):
                # The body (the journal's, when it made one), copied into the
                # event, then the group's fields added to that copy.
                event = pb.SampleEvent(
                    cursor=entry.cursor,
                    sample=entry.wire if entry.wire is not None else convert.WIRE_SAMPLES.body(entry.sample),
                    group_complete=entry.group_complete,
                    awaiting_observation=entry.sample.awaiting_observation,
                    incarnation=incarnation,
                )
                convert.WIRE_SAMPLES.complete(event.sample, entry.sample)
                yield event
        except CoreError as exc:  # fallen behind its acks, dropped as silent, or state_dir cannot be written
            await _fail(context, exc)

    async def Ack(self, request: pb.AckRequest, context) -> pb.AckResponse:
        try:
            consumer = validation.consumer_id("consumer_id", request.consumer_id)
        except FieldError as exc:
            await _fail(context, exc)
        acked = self.core.delivery.ack(consumer, request.cursor)
        try:
            await self.core.commit()  # with a state_dir: journaled before the reply
        except CoreError as exc:  # state_dir cannot be written
            await _fail(context, exc)
        return pb.AckResponse(acked_cursor=acked)

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        try:
            validation.abort_request(request)
            if request.keep_partial:
                self._check_partial_size(request)
            n, partials = await self.core.abort(
                list(request.group_ids), request.batch_id, request.all, request.keep_partial
            )
        except (FieldError, TooLarge, CoreError) as exc:
            await _fail(context, exc)
        return pb.AbortResponse(aborted_groups=n, partial_samples=[convert.sample_to_pb(s) for s in partials])

    # Room in a reply for each partial sample beyond its size now: the tokens
    # an engine may still hand back when it is stopped.
    _PARTIAL_SLACK_BYTES = 1024

    def _check_partial_size(self, request: pb.AbortRequest) -> None:
        """TooLarge (nothing aborted) when the partial samples `Abort(keep_partial)`
        would return do not fit in one reply (`max_message_mb`)."""
        targets = self.core.abort_targets(list(request.group_ids), request.batch_id, request.all)
        size = 16
        for group in targets:
            for req in group.requests:
                if req.finish_reason is None:
                    sample = Sample.from_request(req, FinishReason.ABORTED)
                    size += convert.sample_to_pb(sample).ByteSize() + self._PARTIAL_SLACK_BYTES
            if size > self.max_message_bytes:
                raise TooLarge(f"keep_partial: the partial samples of these {len(targets)} groups take more than "
                               f"the largest reply, max_message_mb={self.max_message_bytes // 2**20}; nothing was "
                               "aborted: abort fewer groups at a time (group_ids), or without keep_partial")

    async def Continue(self, request: pb.ContinueRequest, context) -> pb.ContinueResponse:
        """Answer a trainer-driven trajectory's turn event: append the
        observation and queue its next turn, or end it (`done`)."""
        try:
            answer = await validation.continue_request_off_loop(request, self.limits, self.tokenizer)
            applied = self.core.continue_trajectory(answer.sample_id, answer.turn, answer.observation_token_ids,
                                                    answer.done)
        except FieldError as exc:
            await _fail(context, exc)
        except CoreError as exc:
            if request.observation_text and str(exc).startswith("observation_token_ids"):
                # The text was tokenized here: name the field the caller set.
                exc = CoreError(exc.code, "observation_text (tokenized)" + str(exc)[len("observation_token_ids"):])
            await _fail(context, exc)
        return pb.ContinueResponse(applied=applied)

    async def GetStatus(self, request: pb.StatusRequest, context) -> pb.StatusResponse:
        spec = self.spec_runtime.status() if self.spec_runtime is not None else None
        reply = convert.status_to_pb(self.core.status(), self.model_name, spec)
        reply.incarnation = self.core.incarnation
        return reply

    async def PushWeights(self, request_iterator, context) -> pb.PushWeightsResponse:
        """Receive, verify and stage a push, then apply it (api/weights_receiver.py)."""
        t0 = time.perf_counter()
        try:
            weights = await self.weights.receive(
                request_iterator, accepted=lambda: context.send_initial_metadata(PUSH_ACCEPTED))
            version = await self.weights.apply(weights)
        except PushStalled as exc:
            log.warning("weight push abandoned: %s", exc)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        except ApplyTimedOut as exc:
            log.warning("weight push timed out on an engine: %s", exc)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        except ApplyFailed as exc:
            log.warning("weight push failed on an engine: %s", exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except (FieldError, ManifestError, WeightsRejected, CoreError) as exc:
            log.warning("weight push rejected: %s", exc)
            await _fail(context, exc)
        return pb.PushWeightsResponse(applied_version=version, bytes_received=weights.bytes_received,
                                      seconds=time.perf_counter() - t0)

    # Collective weight transfer (api/collective.py).
    async def GetWeightTransferPlan(self, request, context):
        return await collective.get_plan(self.core, request, context)

    async def InitWeightTransfer(self, request, context):
        return await collective.init(self.core, request, context)

    async def CollectiveUpdate(self, request, context):
        async for event in collective.update(self.core, request, context):
            yield event

    async def CloseWeightTransfer(self, request, context):
        return await collective.close(self.core, request, context)


SERVICE = "rollout.v1.RolloutService"


class _Handlers:
    """Stands in for a server to catch the generated method handlers."""

    def __init__(self) -> None:
        self.handlers: dict = {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.handlers = dict(handlers)


def add_servicer(servicer: RolloutServicer, server) -> None:
    """Register `servicer` on a grpc.aio server, as the generated
    `add_RolloutServiceServicer_to_server` does, except that PushWeights'
    data messages are deserialized without a copy (`parse_chunk`)."""
    from rollout_service.api.weights_receiver import parse_chunk

    caught = _Handlers()
    pb_grpc.add_RolloutServiceServicer_to_server(servicer, caught)
    handlers = caught.handlers
    push = handlers["PushWeights"]
    handlers["PushWeights"] = grpc.stream_unary_rpc_method_handler(
        push.stream_unary, request_deserializer=parse_chunk, response_serializer=push.response_serializer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
