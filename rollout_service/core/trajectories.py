"""Multi-turn trajectories: what happens between a group's turns.

A multi-turn group (`GroupSpec.multi_turn`) runs each sample as a
trajectory: generate a turn, wait for an observation, append it, generate
the next turn, until the trainer or the environment says done, the turn
limit is reached or the response budget is spent:

    turn ends (engine STOP/LENGTH)
      -> trainer-driven: a turn event (the trajectory so far) in the delivery
         log; the trainer answers with `continue_trajectory`
      -> environment-driven: the environment is awaited in a task of its own
         (tool time overlaps the other trajectories' generation)
    observation -> appended (logprob 0, no policy version, loss mask 0)
                -> the next turn queued at the head, preferring the engine
                   that holds the trajectory's prefix (`Request.affinity`)

`Trajectories` owns these steps; the core calls it where a request starts,
ends a turn or is given up, and it asks the core to queue, finish or
deliver through `TrajectoryOps`, nothing else. An answer carries the number
of the turn it answers, so a repeated answer is recognised and changes
nothing.
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

from rollout_service.core.clock import Clock
from rollout_service.core.tasks import TaskSet
from rollout_service.engines.base import Engine
from rollout_service.engines.types import EngineRequest, FinishReason
from rollout_service.lifecycle.types import CoreError, EnvRequest, Group, Request, Sample, Turn

if TYPE_CHECKING:
    from rollout_service.core.rollout import Detokenizer, Environment

log = logging.getLogger(__name__)


class TrajectoryOps(Protocol):
    """What trajectories read from and ask of the core (`RolloutCore`)."""

    @property
    def clock(self) -> Clock: ...
    @property
    def counters(self) -> Counter[str]: ...
    @property
    def detokenizer(self) -> "Detokenizer | None": ...
    @property
    def engines(self) -> Mapping[str, Engine]: ...
    @property
    def groups(self) -> Mapping[str, Group]: ...  # open groups by id

    def requeue(self, req: Request) -> None: ...
    def finish(self, req: Request, reason: FinishReason, drop_reason: str = "") -> None: ...
    def deliver(self, group: Group, sample: Sample) -> None: ...
    def record_progress(self, req: Request) -> None: ...  # journal its state (a turn boundary)
    def guarded(self, what: str, req: Request, fn: Callable[..., Any], *args: Any) -> Any: ...


class Trajectories:
    def __init__(self, core: TrajectoryOps, environments: Mapping[str, "Environment"],
                 observation_timeout_s: float = 3600.0) -> None:
        self.core = core
        self.environments = dict(environments)
        self.observation_timeout_s = observation_timeout_s
        # Trajectories waiting for an observation, oldest first (a weight push
        # that restarts one leaves its entry until it reaches the front).
        self._waiting: dict[str, Request] = {}
        self._calls = TaskSet()  # environment calls in flight
        self._max_model_len: int | None = None
        self.mean_turn = 0.0  # running mean of finished generated turns' lengths (0: none yet)
        self._turns_seen = 0

    # -- limits ------------------------------------------------------------------

    def context_limit(self) -> int:
        """Tokens of context an engine holds (prompt + response); 0 = unknown."""
        if self._max_model_len is None:
            lengths = [e.describe().max_model_len for e in self.core.engines.values()]
            known = [n for n in lengths if n > 0]
            self._max_model_len = min(known) if known else 0
        return self._max_model_len

    def check_spec(self, where: str, multi_turn) -> None:
        """CoreError naming the field of a multi-turn spec the service cannot run."""
        if multi_turn.max_turns < 1:
            raise CoreError("invalid", f"{where}.max_turns: must be >= 1, got {multi_turn.max_turns}")
        if multi_turn.max_total_tokens < 0:
            raise CoreError("invalid", f"{where}.max_total_tokens: must be >= 0, got {multi_turn.max_total_tokens}")
        if multi_turn.environment and multi_turn.environment not in self.environments:
            raise CoreError("invalid", f"{where}.environment: unknown environment {multi_turn.environment!r}; "
                            f"configured: {sorted(self.environments) or 'none'}")

    def clamp(self, request: EngineRequest) -> EngineRequest:
        """A trajectory's turn may not outgrow the engine's context."""
        limit = self.context_limit()
        if limit:
            room = limit - len(request.prompt_token_ids) - len(request.generated_token_ids)
            request.max_new_tokens = max(1, min(request.max_new_tokens, room))
        return request

    def _room(self, req: Request) -> int:
        """Tokens the response may still grow by (observations and turns)."""
        mt = req.group.spec.multi_turn
        room = 1 << 62
        if mt.max_total_tokens:
            room = mt.max_total_tokens - len(req.token_ids)
        limit = self.context_limit()
        if limit:
            room = min(room, limit - len(req.group.spec.prompt_token_ids) - len(req.token_ids))
        return room

    def turn_remaining(self, req: Request) -> float | None:
        """Predicted tokens left in the turn `req` is generating (None: not
        a trajectory, or none finished yet to learn from): the mean finished
        turn less what this one has; past the mean, as much again (a
        heavy tail, as the length predictor assumes)."""
        if req.group.spec.multi_turn is None or not self._turns_seen:
            return None
        done = len(req.token_ids) - req.turn_start
        return self.mean_turn - done if done < self.mean_turn else float(done)

    # -- the core's hooks ----------------------------------------------------------

    def starting(self, req: Request, engine_id: str) -> bool:
        """A request starts on an engine: open its turn if it starts one.
        True when a trajectory's next turn lands on the engine holding its
        prefix (no re-prefill beyond what that engine's cache misses)."""
        if req.group.spec.multi_turn is None:
            return False
        turns = req.turns
        if turns and turns[-1].kind == "generated" and turns[-1].finish_reason is None:
            return False  # the same turn, continued (migrated or resumed)
        warm = req.affinity == engine_id
        if req.affinity is not None and not warm:
            self.core.counters["trajectory_moves"] += 1
        req.affinity = None
        turns.append(Turn("generated", len(req.token_ids), 0, engine_id=engine_id, started_at=self.core.clock.now()))
        return warm

    def close_turn(self, req: Request, reason: FinishReason) -> None:
        """End the turn being generated (if any) where the response ends now."""
        turns = req.turns
        if turns and turns[-1].kind == "generated" and turns[-1].finish_reason is None:
            turn = turns[-1]
            turn.length = len(req.token_ids) - turn.start
            turn.finish_reason = reason
            turn.finished_at = self.core.clock.now()

    def turn_ended(self, req: Request, finish: FinishReason, engine_id: str) -> None:
        """A trajectory's engine finished its turn: end the trajectory, or
        wait for an observation (from the environment or the trainer)."""
        core = self.core
        self.close_turn(req, finish)
        if req.turns and req.turns[-1].kind == "generated":
            # The mean over the last ~256 turns: it follows a policy whose turns grow.
            self._turns_seen += 1
            self.mean_turn += (req.turns[-1].length - self.mean_turn) / min(self._turns_seen, 256)
        req.turn_index += 1
        core.counters["turns_completed"] += 1
        mt = req.group.spec.multi_turn
        if req.turn_index >= mt.max_turns or self._room(req) < 2:
            core.finish(req, finish)
            return
        req.awaiting = True
        req.affinity = engine_id
        self._wait(req, core.clock.now())
        core.record_progress(req)
        if mt.environment:
            self._calls.spawn(self._call(req, req.epoch, req.turn_index - 1), name=f"env-{req.request_id}")
            return
        sample = Sample.from_request(req, finish)
        sample.awaiting_observation = True
        core.counters["turn_events"] += 1
        core.deliver(req.group, sample)

    def resume_restored(self) -> None:
        """After a restart: ask the environments again for the trajectories
        that were waiting on them (a trainer's turn events are re-delivered
        from the restored log)."""
        now = self.core.clock.now()
        for group in self.core.groups.values():
            mt = group.spec.multi_turn
            if mt is None:
                continue
            for req in group.requests:
                if req.awaiting and req.finish_reason is None:
                    self._wait(req, now)
                    if mt.environment:
                        self._calls.spawn(self._call(req, req.epoch, req.turn_index - 1), name=f"env-{req.request_id}")

    async def stop(self) -> None:
        await self._calls.cancel_all()

    # -- the observation deadline ----------------------------------------------------

    @property
    def waiting(self) -> int:
        """Trajectories waiting for an observation (they count against max_queued_samples)."""
        return len(self._waiting)

    def _wait(self, req: Request, now: float) -> None:
        req.awaiting_since = now
        self._waiting.pop(req.request_id, None)  # to the back: the newest wait
        self._waiting[req.request_id] = req

    def stop_waiting(self, req: Request) -> None:
        req.awaiting = False
        self._waiting.pop(req.request_id, None)

    def expire(self) -> int:
        """End the trajectories that have waited `observation_timeout_s` for
        an observation: finish ABORTED, `drop_reason` "observation_timeout:
        ..." (a sample delivered like any given up). Returns how many."""
        now, limit, ended = self.core.clock.now(), self.observation_timeout_s, 0
        while self._waiting:
            rid, req = next(iter(self._waiting.items()))
            if req.awaiting and req.finish_reason is None and not req.group.aborted:
                if now - req.awaiting_since < limit:
                    break
                ended += 1
                self.core.counters["observation_timeouts"] += 1
                self.core.finish(req, FinishReason.ABORTED, drop_reason=(
                    f"observation_timeout: no observation for turn {req.turn_index - 1} within "
                    f"observation_timeout_s={limit:g} s"))
            self._waiting.pop(rid, None)
        return ended

    async def expire_loop(self) -> None:
        """`expire` every second (or every `observation_timeout_s`, if shorter)."""
        while True:
            await asyncio.sleep(min(1.0, self.observation_timeout_s))
            self.expire()

    # -- answers -------------------------------------------------------------------

    def answer(self, sample_id: str, turn: int, observation: list[int], done: bool) -> bool:
        """The trainer's answer to turn `turn` (see RolloutCore.continue_trajectory)."""
        req = self._find(sample_id)
        mt = req.group.spec.multi_turn
        if mt.environment:
            raise CoreError("failed_precondition", f"sample_id: trajectory {sample_id!r} is driven by the "
                            f"environment {mt.environment!r}, not by Continue")
        if turn <= req.answered_turn:
            return False  # a repeat: already applied
        if req.finish_reason is not None:
            raise CoreError("not_found", f"sample_id: trajectory {sample_id!r} is finished")
        if not req.awaiting or turn != req.turn_index - 1:
            state = f"waiting for an answer to turn {req.turn_index - 1}" if req.awaiting else \
                f"generating turn {req.turn_index}"
            raise CoreError("failed_precondition", f"turn: trajectory {sample_id!r} is {state}, not waiting for "
                            f"an answer to turn {turn}")
        if not done:
            self._check_fits(req, len(observation))
        self._apply(req, observation, done, self.core.clock.now() - req.awaiting_since)
        return True

    def _find(self, sample_id: str) -> Request:
        group_id, _, index = sample_id.rpartition("/")
        group = self.core.groups.get(group_id)
        if group is None or not index.isdigit() or int(index) >= len(group.requests):
            raise CoreError("not_found", f"sample_id: unknown or finished trajectory {sample_id!r}")
        if group.spec.multi_turn is None:
            raise CoreError("failed_precondition", f"sample_id: {sample_id!r} is not a multi-turn sample")
        return group.requests[int(index)]

    def _check_fits(self, req: Request, n: int) -> None:
        room = self._room(req)
        if n + 1 > room:
            mt = req.group.spec.multi_turn
            limit = (f"max_total_tokens {mt.max_total_tokens}" if mt.max_total_tokens and
                     mt.max_total_tokens - len(req.token_ids) == room else f"the model's context of {self.context_limit()}")
            raise CoreError("invalid", f"observation_token_ids: {n} tokens do not fit trajectory {req.request_id!r}: "
                            f"{room} tokens left under {limit} (one must remain for the next turn)")

    def _apply(self, req: Request, observation: list[int], done: bool, tool_s: float) -> None:
        core = self.core
        req.answered_turn = req.turn_index - 1
        self.stop_waiting(req)
        if done:
            last = req.turns[-1].finish_reason if req.turns else FinishReason.STOP
            core.finish(req, last or FinishReason.STOP)
            return
        now = core.clock.now()
        req.append_observation(list(observation), tool_s, now)
        core.record_progress(req)
        core.counters["observations_appended"] += 1
        core.counters["observation_tokens"] += len(observation)
        core.requeue(req)  # at the head: warm trajectories first

    async def _call(self, req: Request, epoch: int, turn: int) -> None:
        """Ask the trajectory's environment for its next observation."""
        core = self.core
        name = req.group.spec.multi_turn.environment
        env = self.environments[name]
        spec = req.group.spec
        if self._stale(req, epoch, turn):
            return  # restarted (e.g. past max_version_lag at a push) before this call began
        last = req.turns[-1]
        text = ""
        if core.detokenizer is not None and spec.prompt_text:
            text = core.guarded("detokenizer", req, core.detokenizer.decode, req.token_ids[last.start:]) or ""
        request = EnvRequest(
            sample_id=req.request_id, group_id=spec.group_id, index=req.index, turn=turn,
            prompt_token_ids=list(spec.prompt_token_ids), response_token_ids=list(req.token_ids),
            turn_token_ids=list(req.token_ids[last.start:last.start + last.length]),
            finish_reason=last.finish_reason or FinishReason.STOP, metadata=dict(spec.metadata), turn_text=text,
        )
        t0 = core.clock.now()
        try:
            reply = await env(request)
            observation = list(reply.observation_token_ids)
            if not observation and reply.observation_text:
                if core.detokenizer is None:
                    raise ValueError("replied with observation_text, but the service has no tokenizer")
                observation = list(core.detokenizer.encode(reply.observation_text, add_special_tokens=False))
        except Exception as exc:  # the environment failed: the trajectory ends, reported
            if self._stale(req, epoch, turn):
                return
            core.counters["environment_errors"] += 1
            log.warning("environment %r failed on %s turn %d: %s", name, req.request_id, turn, exc)
            self.stop_waiting(req)
            core.finish(req, FinishReason.ABORTED, drop_reason=f"environment {name!r} failed: {exc}")
            return
        if self._stale(req, epoch, turn):
            return
        tool_s = core.clock.now() - t0
        if not reply.done and len(observation) + 1 > self._room(req):
            # It does not fit: the trajectory ends here, at its length limit.
            core.counters["observations_too_long"] += 1
            req.answered_turn = turn
            self.stop_waiting(req)
            core.finish(req, FinishReason.LENGTH)
            return
        self._apply(req, observation, reply.done, tool_s)

    def _stale(self, req: Request, epoch: int, turn: int) -> bool:
        """Did the trajectory move on (aborted, restarted) while its environment ran?"""
        return (req.epoch != epoch or not req.awaiting or req.finish_reason is not None
                or req.group.aborted or req.turn_index - 1 != turn)
