"""The asyncio client of the rollout service (speaks only rollout.v1)."""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
import uuid
from typing import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence, Union

import grpc

from rollout_proto import rollout_pb2 as pb
from rollout_proto import rollout_pb2_grpc as pb_grpc
from trainer_client import weights as _weights
from trainer_client.types import CompletedSample, PromptGroup, PushResult, ServiceStatus

#: What a trajectory's `respond` returns for a turn event: the observation
#: as token ids or as text (tokenized by the service), or None to end it.
Observation = Union[Sequence[int], str, None]
Respond = Callable[[CompletedSample], Union[Observation, Awaitable[Observation]]]

log = logging.getLogger(__name__)

INCARNATION_KEY = "rollout-incarnation"  # the stream's initial metadata
RECONNECT_BACKOFF_MS = (250, 2000)  # first and longest wait between attempts to connect


class ServiceRestarted(Exception):
    """The service restarted without its state (no `state_dir`, or it was
    lost): its cursors start again and what it had not delivered is gone.
    `group_ids` are the groups this client submitted and has not received
    completely; submit them again (same ids) to have them generated.
    Raised by the streams (and by `submit`) of a client created without
    `resubmit_on_restart`."""

    def __init__(self, address: str, old: str, new: str, group_ids: list[str]) -> None:
        self.address, self.old_incarnation, self.new_incarnation = address, old, new
        self.group_ids = group_ids
        shown = ", ".join(group_ids[:10]) + (f", ... ({len(group_ids)} in all)" if len(group_ids) > 10 else "")
        super().__init__(
            f"the rollout service at {address} restarted without its state (incarnation {old} -> {new}): "
            f"{len(group_ids)} group(s) submitted here were not received completely: [{shown}]; submit them "
            f"again, or create the client with resubmit_on_restart=True")


def _forget_cursors(pending: dict[str, list[CompletedSample]]) -> None:
    """Zero the cursors of samples received before a restart (cursors of
    another incarnation), so that no acknowledgement is computed from them."""
    for samples in pending.values():
        for s in samples:
            s.cursor = 0


class _Open:
    """A group this client submitted and has not received completely."""

    __slots__ = ("group", "batch_id", "received")

    def __init__(self, group: pb.PromptGroup, batch_id: str) -> None:
        self.group, self.batch_id = group, batch_id
        self.received: set[int] = set()  # indices of the final samples yielded


_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED}


def _group_pb(g: PromptGroup) -> pb.PromptGroup:
    sampling = pb.SamplingParams(max_tokens=g.max_tokens, stop_token_ids=g.stop_token_ids, stop=g.stop)
    if g.temperature is not None:
        sampling.temperature = g.temperature
    if g.top_p is not None:
        sampling.top_p = g.top_p
    if g.top_k is not None:
        sampling.top_k = g.top_k
    if g.seed is not None:
        sampling.seed = g.seed
    if g.min_tokens:
        sampling.min_tokens = g.min_tokens
    group = pb.PromptGroup(
        group_id=g.group_id,
        prompt_token_ids=g.prompt_token_ids or [],
        prompt_text=g.prompt_text,
        num_samples=g.num_samples,
        sampling=sampling,
        prompt_id=g.prompt_id,
        metadata=g.metadata,
    )
    if g.multi_turn is not None:
        mt = g.multi_turn
        group.multi_turn.CopyFrom(pb.MultiTurn(max_turns=mt.max_turns, max_total_tokens=mt.max_total_tokens,
                                               environment=mt.environment))
    return group


class RolloutClient:
    """Submit GRPO groups, stream completed samples, push weights.

    Usage::

        async with RolloutClient("localhost:50051", consumer_id="trainer-0") as client:
            await client.submit([PromptGroup(prompt_token_ids=ids, num_samples=8, max_tokens=512)])
            async for group in client.groups():      # complete GRPO groups
                train_on(group)                       # acknowledged when you ask for the next
                await client.push_weights(model.state_dict(), version=step + 1)

    Streams acknowledge what the caller has consumed and, after a broken
    connection, reconnect and resume after the last sample received, so a
    consumer sees every sample once. A service that restarted with its
    `state_dir` is the same incarnation: the stream simply resumes. One that
    lost its state is a new incarnation: the stream raises
    `ServiceRestarted` naming the groups submitted here and not received
    completely, or, with `resubmit_on_restart`, submits them again (same
    ids) and goes on, never yielding a (group, index) it yielded before.

    Args:
        address: the service's gRPC "host:port".
        consumer_id: names this consumer's acknowledgement cursor on the
            service; reuse it to resume after a restart (default: a fresh one).
        max_message_mb: largest gRPC message sent or received, in MiB.
        reconnect_timeout_s: how long a broken sample stream keeps
            reconnecting before the error is raised, in seconds.
        token: bearer token for a service with `[auth]` tokens (never logged).
        tls_ca_file: PEM file of the CA that signed the service's
            certificate; TLS is used when it is set.
        resubmit_on_restart: on a restart that lost the service's state,
            submit this client's unfinished groups again instead of raising
            `ServiceRestarted` (their samples already received are kept).
    """

    def __init__(
        self,
        address: str = "localhost:50051",
        consumer_id: str | None = None,
        max_message_mb: int = 64,
        reconnect_timeout_s: float = 60.0,
        token: str | None = None,
        tls_ca_file: str | None = None,
        resubmit_on_restart: bool = False,
    ) -> None:
        self.address = address
        self.consumer_id = consumer_id or f"consumer-{uuid.uuid4().hex[:8]}"
        self.reconnect_timeout_s = reconnect_timeout_s
        max_msg = max_message_mb * 1024 * 1024
        options = [("grpc.max_receive_message_length", max_msg), ("grpc.max_send_message_length", max_msg),
                   # A service starting or restarting is tried again every 2 s at most: gRPC's default
                   # backoff grows to 2 min, so a client could find a service back long after it was.
                   ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
                   ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1])]
        if tls_ca_file:
            with open(tls_ca_file, "rb") as f:
                creds = grpc.ssl_channel_credentials(root_certificates=f.read())
            self._channel = grpc.aio.secure_channel(address, creds, options=options)
        else:
            self._channel = grpc.aio.insecure_channel(address, options=options)
        # Sent with every call; the server never logs it.
        self._md = (("authorization", f"Bearer {token}"),) if token else None
        self._stub = pb_grpc.RolloutServiceStub(self._channel)
        # PushWeights with chunks serialized straight from the tensors' bytes.
        self._push = self._channel.stream_unary(
            "/rollout.v1.RolloutService/PushWeights", request_serializer=_weights.serialize_chunk,
            response_deserializer=pb.PushWeightsResponse.FromString)
        self._collective = None  # the collective transfer group joined (push_weights_collective)
        self.last_cursor = 0  # highest cursor received
        self.acked_cursor = 0
        self.resubmit_on_restart = resubmit_on_restart
        self.incarnation = ""  # of the service this client's cursors belong to
        self._open: dict[str, _Open] = {}  # groups submitted here, not received completely
        self._epoch = 0  # bumped when the service restarted and cursors started over

    async def __aenter__(self) -> "RolloutClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection (the service keeps this consumer's cursor)."""
        if self._collective is not None:
            self._collective.close()
            self._collective = None
        await self._channel.close()

    async def wait_ready(self, timeout: float = 60.0) -> None:
        """Wait until the server accepts connections (`asyncio.TimeoutError`
        after `timeout` seconds)."""
        await asyncio.wait_for(self._channel.channel_ready(), timeout)

    # -- generation ------------------------------------------------------------

    async def submit(self, groups: Iterable[PromptGroup], batch_id: str = "") -> list[str]:
        """Enqueue groups; returns their ids (server-assigned where empty).
        Retrying with the same group ids never creates a group twice.

        Args:
            groups: the prompt groups (one prompt, `num_samples` completions each).
            batch_id: a label for these groups; `abort(batch_id=...)` stops them together.
        """
        return [gid for gid, _ in await self.submit_detailed(groups, batch_id)]

    async def submit_detailed(self, groups: Iterable[PromptGroup], batch_id: str = "") -> list[tuple[str, bool]]:
        """Like `submit`, with whether each group was created (False: it
        existed already): a list of (group_id, created).

        Args:
            groups: the prompt groups.
            batch_id: a label for these groups (see `submit`).
        """
        request = pb.SubmitRequest(groups=[_group_pb(g) for g in groups], batch_id=batch_id)
        reply = await self._stub.Submit(request, metadata=self._md)
        if reply.incarnation and self.incarnation and reply.incarnation != self.incarnation:
            await self._restarted(reply.incarnation)
        self.incarnation = self.incarnation or reply.incarnation
        for group, gid in zip(request.groups, reply.group_ids):
            if gid not in self._open:
                group.group_id = gid
                self._open[gid] = _Open(group, batch_id)
        return list(zip(reply.group_ids, reply.created))

    async def _restarted(self, incarnation: str) -> None:
        """The service is a new incarnation: raise ServiceRestarted, or
        submit the unfinished groups again; cursors start over."""
        old, lost = self.incarnation, list(self._open)
        if not self.resubmit_on_restart:
            raise ServiceRestarted(self.address, old, incarnation, lost)
        log.warning("the service at %s restarted without its state (incarnation %s -> %s); submitting %d "
                    "unfinished group(s) again", self.address, old, incarnation, len(lost))
        batches: dict[str, list[pb.PromptGroup]] = {}
        for entry in self._open.values():
            batches.setdefault(entry.batch_id, []).append(entry.group)
        for batch_id, groups in batches.items():
            await self._stub.Submit(pb.SubmitRequest(groups=groups, batch_id=batch_id), metadata=self._md)
        self.incarnation = incarnation
        self.last_cursor = self.acked_cursor = 0
        self._epoch += 1

    def _received(self, event: pb.SampleEvent) -> bool | None:
        """Account a final sample of a group submitted here: None if it was
        yielded before (a group submitted again), else whether its group is
        now complete. Samples of other groups keep the service's marker."""
        entry = self._open.get(event.sample.group_id)
        if entry is None or event.awaiting_observation:
            return event.group_complete
        index = event.sample.index
        if index in entry.received:
            return None
        entry.received.add(index)
        if len(entry.received) >= entry.group.num_samples:
            del self._open[event.sample.group_id]
            return True
        return False

    async def stream(self, ack_every: int = 64, from_cursor: int | None = None) -> AsyncIterator[CompletedSample]:
        """Every completed sample, as it completes, in cursor order (and,
        for trainer-driven multi-turn groups, their turn events: samples with
        `awaiting_observation`, see `trajectory_groups`).

        A sample counts as consumed when the caller asks for the next one;
        consumed samples are acknowledged every `ack_every` (and by `ack()`),
        in the background: the stream goes on while the service makes the
        ack durable (one ack in flight at a time; awaited when the stream
        ends or reconnects, and its error, if any, raised by the stream).
        On a broken connection it reconnects and resumes after the last
        cursor received.

        Args:
            ack_every: acknowledge after this many samples consumed.
            from_cursor: start after this cursor (default: after the last
                sample this client received; 0 replays what is retained).
        """
        cursor = self.last_cursor if from_cursor is None else from_cursor
        deadline = None
        acking: asyncio.Task | None = None  # the ack in flight

        async def settle() -> None:
            nonlocal acking
            if acking is not None:
                task, acking = acking, None
                await task

        while True:
            call = self._stub.StreamSamples(
                pb.StreamSamplesRequest(consumer_id=self.consumer_id, from_cursor=cursor), metadata=self._md
            )
            try:
                incarnation = dict(await call.initial_metadata() or ()).get(INCARNATION_KEY, "")
                if incarnation and self.incarnation and incarnation != self.incarnation:
                    await settle()
                    await self._restarted(incarnation)  # raises, or submits again: cursors start over
                    cursor = 0
                    continue
                self.incarnation = self.incarnation or incarnation
                async for event in call:
                    deadline = None
                    if event.cursor <= cursor:
                        continue  # already seen (re-delivery after a reconnect)
                    cursor = self.last_cursor = event.cursor
                    complete = self._received(event)
                    if complete is None:
                        continue  # yielded before the service restarted
                    yield CompletedSample.from_pb(event.sample, event.cursor, complete,
                                                  event.awaiting_observation)
                    if acking is not None and acking.done():
                        await settle()  # raises what it raised
                    if acking is None and cursor - self.acked_cursor >= ack_every:
                        acking = asyncio.ensure_future(self.ack(cursor))
                await settle()
                return
            except grpc.aio.AioRpcError as exc:
                await settle()
                if exc.code() not in _RETRYABLE:
                    raise
                loop = asyncio.get_running_loop()
                deadline = deadline or loop.time() + self.reconnect_timeout_s
                if loop.time() > deadline:
                    raise
                log.warning("sample stream broke (%s); reconnecting after cursor %d", exc.code().name, cursor)
                await asyncio.sleep(0.5)
            finally:
                call.cancel()
                if acking is not None:  # the caller stopped asking, or the stream raised: the ack lands first
                    try:
                        await settle()
                    except grpc.aio.AioRpcError as exc:
                        log.warning("ack of cursor %d failed as the stream ended: %s", cursor, exc.code().name)

    async def groups(self, ack: bool = True) -> AsyncIterator[list[CompletedSample]]:
        """Complete GRPO groups (samples ordered by index), as they complete.
        A group is acknowledged once the caller asks for the next one.
        Turn events of trainer-driven multi-turn groups are skipped: answer
        them with `trajectory_groups`.

        Args:
            ack: acknowledge consumed groups (False: the caller calls `ack()`).
        """
        pending: dict[str, list[CompletedSample]] = {}
        epoch = self._epoch
        async for sample in self.stream(ack_every=1 << 62):
            if epoch != self._epoch:  # cursors of a service that restarted: they acknowledge nothing now
                _forget_cursors(pending)
                epoch = self._epoch
            if sample.awaiting_observation:
                continue
            pending.setdefault(sample.group_id, []).append(sample)
            if not sample.group_complete:
                continue
            group = sorted(pending.pop(sample.group_id), key=lambda s: s.index)
            yield group
            if ack:
                # Everything below the oldest sample still buffered is consumed.
                oldest = min((s[0].cursor for s in pending.values()), default=sample.cursor + 1)
                await self.ack(oldest - 1)

    async def trajectory_groups(self, respond: Respond | None = None,
                                ack: bool = True) -> AsyncIterator[list[CompletedSample]]:
        """Complete multi-turn groups (samples ordered by index), as they
        complete, answering the turn events of trainer-driven trajectories
        on the way. Each sample's response holds its generated turns and the
        observations between them; `loss_mask()` is 1 on generated and 0 on
        observation tokens, `token_versions()` is -1 on observations,
        `turns` gives the spans. Single-turn groups come through as well.

        `respond(sample)` is called (awaited if it is a coroutine function;
        a plain function runs in a worker thread) for every turn event: the
        trajectory so far, whose last turn is
        `sample.response_token_ids[sample.turns[-1].start:]`. It returns the
        observation to append, as token ids or text, or None to end the
        trajectory. Turn events are answered concurrently, so slow tools
        overlap each other and the generation of other trajectories. An
        observation too long for the trajectory ends it (as the service does
        for an environment's); an answer to a trajectory that moved on (its
        group aborted, restarted by a weight update) is dropped. What
        `respond` raises is raised here.

        A turn event is acknowledged once its answer is in and a group once
        the caller asks for the next one, so after a reconnect or a restart
        with the same consumer_id unanswered turns are delivered again, and
        an answer sent twice changes nothing.

        Args:
            respond: answers turn events; None when every multi-turn group
                is environment-driven (turn events are then skipped, logged).
            ack: acknowledge consumed groups and answered turn events.
        """
        pending: dict[str, list[CompletedSample]] = {}
        answering: dict[int, asyncio.Task] = {}  # cursor of a turn event -> its answer
        failure: asyncio.Future = asyncio.get_running_loop().create_future()

        async def answer(event: CompletedSample) -> None:
            try:
                if inspect.iscoroutinefunction(respond):
                    obs = await respond(event)
                else:
                    obs = await asyncio.to_thread(respond, event)
                    if inspect.isawaitable(obs):
                        obs = await obs
                await self._answer(event, obs)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # raised from the iterator
                if not failure.done():
                    failure.set_exception(exc)

        epoch = self._epoch

        def held() -> int:
            """The highest cursor below everything still needed here."""
            nonlocal epoch
            if epoch != self._epoch:  # cursors of a service that restarted acknowledge nothing now
                _forget_cursors(pending)
                for cursor in [c for c in answering if c > 0]:
                    answering[-cursor] = answering.pop(cursor)
                epoch = self._epoch
            cursors = [s[0].cursor for s in pending.values()] + [c for c, t in answering.items() if not t.done()]
            return min(cursors, default=self.last_cursor + 1) - 1

        stream = self.stream(ack_every=1 << 62)
        following: asyncio.Future | None = None
        try:
            while True:
                following = asyncio.ensure_future(stream.__anext__())
                await asyncio.wait({following, failure}, return_when=asyncio.FIRST_COMPLETED)
                if failure.done():
                    failure.result()  # raises what respond raised
                try:
                    sample = following.result()
                except StopAsyncIteration:
                    return
                following = None
                for cursor in [c for c, t in answering.items() if t.done()]:
                    answering.pop(cursor)
                if sample.awaiting_observation:
                    if respond is None:
                        log.warning("turn event of %s not answered: its group is trainer-driven (no environment) "
                                    "and trajectory_groups got no respond=", sample.sample_id)
                        continue
                    answering[sample.cursor] = asyncio.create_task(answer(sample), name=f"respond-{sample.sample_id}")
                    continue
                pending.setdefault(sample.group_id, []).append(sample)
                if sample.group_complete:
                    group = sorted(pending.pop(sample.group_id), key=lambda s: s.index)
                    yield group
                if ack:
                    await self.ack(held())
        finally:
            if following is not None:
                following.cancel()
                await asyncio.gather(following, return_exceptions=True)
            for task in answering.values():
                task.cancel()
            await asyncio.gather(*answering.values(), return_exceptions=True)
            await stream.aclose()
            if failure.done():
                failure.exception()  # retrieved: not logged as never retrieved

    async def _answer(self, event: CompletedSample, obs: Observation) -> None:
        """Send `respond`'s answer to a turn event (see `trajectory_groups`)."""
        turn = event.turn_index
        try:
            if obs is None:
                await self.continue_trajectory(event.sample_id, turn, done=True)
            elif isinstance(obs, str):
                await self.continue_trajectory(event.sample_id, turn, observation_text=obs)
            else:
                await self.continue_trajectory(event.sample_id, turn, observation_token_ids=list(obs))
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                log.info("answer to %s turn %d dropped: %s", event.sample_id, turn, exc.details())
                return
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "do not fit" in (exc.details() or ""):
                log.warning("observation for %s turn %d does not fit; the trajectory ends: %s",
                            event.sample_id, turn, exc.details())
                await self.continue_trajectory(event.sample_id, turn, done=True)
                return
            raise

    async def continue_trajectory(self, sample_id: str, turn: int, observation_token_ids: Sequence[int] | None = None,
                                  observation_text: str = "", done: bool = False) -> bool:
        """Answer a turn event of a trainer-driven trajectory: append an
        observation and let its next turn be generated, or end it. Returns
        False when this answer repeats one already applied (nothing changed).
        Raises NOT_FOUND for an unknown or finished trajectory,
        FAILED_PRECONDITION when it is not waiting for an answer to `turn`,
        INVALID_ARGUMENT for an observation that does not fit (the status
        names the field).

        Args:
            sample_id: the turn event's sample_id.
            turn: the turn answered, the event's `turn_index`.
            observation_token_ids: the observation as token ids.
            observation_text: or as text, tokenized by the service.
            done: end the trajectory (no observation with it).
        """
        request = pb.ContinueRequest(sample_id=sample_id, turn=turn, observation_token_ids=list(observation_token_ids or ()),
                                     observation_text=observation_text, done=done)
        reply = await self._stub.Continue(request, metadata=self._md)
        return reply.applied

    async def ack(self, cursor: int | None = None) -> int:
        """Acknowledge every sample up to `cursor` (default: all received);
        returns the cursor acknowledged. The service may then forget them.
        While the service is unreachable (restarting) the ack is skipped,
        logged, and covered by the next one: what it would have acknowledged
        is re-delivered and skipped by the streams.

        Args:
            cursor: the highest cursor consumed.
        """
        cursor = self.last_cursor if cursor is None else cursor
        if cursor <= self.acked_cursor:
            return self.acked_cursor
        try:
            reply = await self._stub.Ack(pb.AckRequest(consumer_id=self.consumer_id, cursor=cursor),
                                         metadata=self._md)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in _RETRYABLE:
                raise
            log.warning("ack of cursor %d not delivered (%s); the next ack covers it", cursor, exc.code().name)
            return self.acked_cursor
        self.acked_cursor = max(self.acked_cursor, reply.acked_cursor)
        return self.acked_cursor

    async def abort(
        self, group_ids: Iterable[str] = (), batch_id: str = "", all: bool = False, keep_partial: bool = False
    ) -> tuple[int, list[CompletedSample]]:
        """Stop groups; returns (groups aborted, partial samples). With
        keep_partial, the partial samples are the unfinished ones with the
        tokens generated so far (finish_reason "aborted").

        Args:
            group_ids: the groups to stop.
            batch_id: stop every group submitted with this batch_id.
            all: stop every group.
            keep_partial: return the unfinished samples instead of dropping them.
        """
        request = pb.AbortRequest(group_ids=list(group_ids), batch_id=batch_id, all=all, keep_partial=keep_partial)
        reply = await self._stub.Abort(request, metadata=self._md)
        for gid in [g for g, e in self._open.items() if all or g in request.group_ids or
                    (batch_id and e.batch_id == batch_id)]:
            del self._open[gid]
        return reply.aborted_groups, [CompletedSample.from_pb(s) for s in reply.partial_samples]

    # -- weights -------------------------------------------------------------------

    async def push_weights(
        self, state_dict: Mapping[str, object], version: int, chunk_mb: float = 2.0,
        checksums: bool | str = "xxh3", target: str = "policy", checksum_trailer: bool = True,
    ) -> PushResult:
        """Stream a state dict to the service; returns when `version` serves
        on every engine. If an engine fails or times out applying it, the
        call raises (UNAVAILABLE or DEADLINE_EXCEEDED) and the previous
        version keeps serving.

        Args:
            state_dict: tensor name -> torch tensor or NumPy array.
            version: the new policy version; must exceed the serving one.
            chunk_mb: size of each streamed message, in MiB (1-2 stream
                best on loopback; 4 and more fall into a slow mode of
                gRPC's sender at times; max_message_mb bounds it).
            checksums: a checksum per tensor, verified by the service as
                the bytes arrive: "xxh3" (the default, xxHash XXH3-128,
                ~8 GB/s; catches corruption, not tampering), "xxh3_64",
                "sha256" (~1 GB/s; what services before the choice verify),
                or False (none). True means "xxh3".
            target: "policy", or "draft" for draft-model weights for
                speculative decoding (versioned separately; lossless
                whatever they are).
            checksum_trailer: hash while streaming, and send the digests
                after the data (the default; services from the release
                that added WeightsTrailer on: an older one never accepts
                the header, and the push ends with DEADLINE_EXCEEDED after
                its idle timeout). False: hash everything first and send
                the digests in the header, as every service version
                accepts.
        """
        tensors = await asyncio.to_thread(_weights.flatten, state_dict)
        algo = _weights.checksum_algo(checksums)
        chunk_bytes = max(1, int(chunk_mb * 1024 * 1024))
        if not (algo and checksum_trailer):
            specs = await asyncio.to_thread(_weights.manifest, tensors, checksums)
            header = pb.WeightsHeader(version=version, tensors=specs, target=target,
                                      checksum_algo="" if algo == "sha256" else algo)
            chunks = _weights.chunks(header, tensors, chunk_bytes)
            return PushResult.from_pb(await self._push(chunks, metadata=self._md), target)
        header = pb.WeightsHeader(version=version, tensors=_weights.manifest(tensors, False), target=target,
                                  checksum_algo=algo)
        stop = threading.Event()
        hashing = asyncio.ensure_future(asyncio.to_thread(_weights.digests, tensors, algo, stop))

        async def messages():
            it = _weights.chunks(header, tensors, chunk_bytes)
            yield next(it)
            # The service accepts the header (in its initial metadata) before
            # the data is sent: a refusal then comes back as its status, not
            # as a write failing on a call the service has already ended.
            if ("rollout-push-accepted", "1") not in tuple(await call.initial_metadata() or ()):
                return
            for chunk in it:
                yield chunk
            yield pb.WeightsChunk(trailer=pb.WeightsTrailer(digests=await hashing))

        call = self._push(messages(), metadata=self._md)
        try:
            return PushResult.from_pb(await call, target)
        finally:
            stop.set()  # the push failed early: stop hashing
            with contextlib.suppress(Exception):
                await hashing

    async def push_weights_collective(
        self, state_dict: Mapping[str, object], version: int, *, backend: str = "",
        master_address: str = "127.0.0.1", master_port: int = 0, timeout_s: float = 60.0,
        chunk_mb: float = 32.0, mode: str = "chain",
    ) -> PushResult:
        """Push a state dict of torch tensors over a collective group: the
        trainer (rank 0) sends each byte once to every engine's workers
        (gloo on CPUs, NCCL on GPUs; docs/collective.md). Returns when
        `version` serves on every engine; the group is formed on the first
        call and kept. A push that fails (refused manifest: INVALID_ARGUMENT
        naming the tensor; another push applying: FAILED_PRECONDITION; a
        transfer that fails or stalls past `timeout_s`) raises, the previous
        version keeps serving, and the next call forms the group again.

        Args:
            backend: "gloo", "nccl", or "" for the engines' default.
            master_address, master_port: this trainer's rendezvous address,
                reachable from the service's engines (port 0: a free one).
            timeout_s: bound on every wait of the group, on both sides.
            chunk_mb: gloo's transfer unit, in MiB.
            mode: gloo's "chain" (sent once, forwarded engine to engine) or
                "broadcast".
        """
        from trainer_client.collective import CollectiveGroup

        options = (backend, master_address, master_port, timeout_s, int(chunk_mb * 1024 * 1024), mode)
        group = self._collective
        if group is not None and group.options != options:
            group.close()
            group = None
        for attempt in range(2):
            if group is None:
                group = CollectiveGroup(self._stub, self._md, *options)
                group.options = options
            self._collective = group
            try:
                applied, seconds, sent = await group.push(state_dict, version)
                return PushResult(applied_version=applied, bytes_received=sent, seconds=seconds)
            except grpc.aio.AioRpcError as exc:
                group.close()
                self._collective = group = None
                # The service's group changed (an engine restarted): form it again, once.
                if attempt or exc.code() != grpc.StatusCode.FAILED_PRECONDITION or "InitWeightTransfer" not in (
                        exc.details() or ""):
                    raise
            except BaseException:
                group.close()
                self._collective = None
                raise
        raise AssertionError("unreachable")

    async def close_collective(self) -> None:
        """Leave the collective transfer group (the service's side too)."""
        group, self._collective = self._collective, None
        if group is not None:
            group.close()
            await self._stub.CloseWeightTransfer(pb.CloseWeightTransferRequest(), metadata=self._md)

    async def push_weights_file(self, path: str, version: int, target: str = "policy") -> PushResult:
        """Same-host fast path: the service reads a safetensors file itself;
        returns when `version` serves on every engine (as `push_weights`).

        Args:
            path: the file's path on the service's host, under a directory
                its configuration lists in `weights_file_dirs` (a regular
                file; symlinks are resolved).
            version: the new version; must exceed the serving one.
            target: "policy" or "draft" (see `push_weights`).
        """
        header = pb.WeightsHeader(version=version, file_path=path, target=target)
        reply = await self._stub.PushWeights(iter([pb.WeightsChunk(header=header)]), metadata=self._md)
        return PushResult.from_pb(reply, target)

    # -- status ----------------------------------------------------------------------

    async def status(self) -> ServiceStatus:
        """A snapshot of the service: serving policy version, engines,
        queues, counters and speculative decoding state."""
        return ServiceStatus.from_pb(await self._stub.GetStatus(pb.StatusRequest(), metadata=self._md))
