"""Per-step and per-run metrics, and the lower bound of a step's makespan.

The lower bound comes from the same cost model as the simulated engine
(`SimParams`: one engine step costs `decode_base_s + decode_per_seq_s * running
+ decode_per_ctx_token_s * context + prefill_per_token_s * prefilled`; write
b, s, c, p). Every sample makes one token per engine step it is in; a step
holds at most `max_seqs` sequences (M) and, on a simulated engine, at most
`kv_capacity_tokens` (K) of context (each sequence's context plus the token
it writes; the engine's admission can overshoot by fewer than M tokens for one
step, so K + M is used). The bound is the largest of four:

- longest request: a response of L tokens after a P-token prompt needs L
  engine steps one after another; at batch 1 (the cheapest a step can be)
  that is `p * P + L * (b + s) + c * (L * P + L * (L - 1) / 2)`; in an open
  loop it cannot start before its group arrives;
- total work: the N engines together are busy at most N * makespan, and
  that busy time is at least `b * steps + s * tokens + c * contexts + p *
  prompts`, where the number of engine steps is at least `tokens / M` and at
  least `Q / (K + M)` (Q: each token's context, summed over the step's
  tokens, each capped at K + M): the KV cache bounds the tokens a step can
  carry, so a fleet whose caches are too small for the step's responses
  needs more steps than its batch size alone says;
- shared steps: the a longest responses (set A, W_A tokens) cannot all run
  alone. Each of them lasts at most the makespan T, and each of its steps
  costs at least `b + s * j` (j: how many of A are in that step), so
  `a * T >= b * W_A + s * sum(j^2) + (their own prefill and context terms)`;
  with X engine steps holding any of A, `sum(j^2) >= max(W_A, W_A^2 / X)`
  (Cauchy-Schwarz) and the total-work inequality above holds with `steps >=
  X`. Few steps (A packed together) make A's steps slow, many steps make the
  fleet's work large; the bound is the least makespan over X that satisfies
  both, maximised over a (a = 1 is the longest request). It holds whatever
  the placement, with migrations (a response's steps never overlap in time,
  wherever they run) and preemptions (they add steps and prefill);
- batch sizes: every response must end by T, so its steps cannot be too
  full, and emptier steps cost the fleet more engine time per token. Split
  each step's cost `b + s * j` evenly over its j sequences: a token made in
  a step of j costs `b / j + s` of engine time and `b + s * j` of its own
  response's time. A response of L tokens (own prefill and context terms
  o, arriving at offset t0) thus makes its tokens at a token-weighted mean
  batch of at most `J = min(M, (T - t0 - o - L * b) / (s * L))`, and since
  `b / j` is convex its engine time is at least `L * (b / J + s)`
  (Jensen): `L / J` engine steps' worth of `b`. Summed over the responses
  (and no fewer steps than the total-work term's), plus their own terms,
  it must fit in N * T; the bound is the least T where it does.

With speculative decoding on in the simulated engine, the decode terms are
divided by the best tokens per verify step (every draft at the deepest
depth accepted at the up-to-date drafter's rate, drafts free), the
architecture's "sequential decode time / speculative acceptance length".

A simulated step can never beat any of them (each term is what the engine
charges at its best), so `makespan / lower_bound >= 1`; the ratio is how far
a policy is from the limit on that fleet. It is a bound for a scheduler that
knows every response's length in advance: an online policy also pays for not
knowing which responses are long. For real engines the bound uses the
calibrated cost model (`research/calibrate.py`), without a KV term, and is
an estimate.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from rollout_service.bench.driver import StepRecord
from rollout_service.aio import cancel_and_wait
from rollout_service.scheduling.search import least_feasible

# Virtual time adds step times one float at a time; the closed form may differ by rounding.
_ROUNDING = 1e-9


@dataclass(slots=True, frozen=True)
class CostModel:
    """The simulated engine's cost model (seconds) and batch cap."""

    decode_base_s: float
    decode_per_seq_s: float
    decode_per_ctx_token_s: float
    prefill_per_token_s: float
    max_seqs: int
    # Tokens per verify step at best (1 without speculation): decode costs are divided by it.
    spec_speedup: float = 1.0
    # KV cache per engine (tokens) when the engines enforce it (simulated ones); 0: no KV term.
    kv_tokens: int = 0

    @classmethod
    def of(cls, params, kv_tokens: int = 0) -> "CostModel":
        """From a `SimParams` (or anything with its fields). With speculative
        decoding on, the best case: every verify step at the deepest draft and
        the acceptance of an up-to-date drafter, drafting for free.
        `kv_tokens`: the engines' KV capacity, for engines that enforce the
        cost model's (simulated ones)."""
        speedup = 1.0
        if getattr(params, "spec_method", "off") != "off":
            depths = [params.spec_max_k] + [int(e[2]) for e in getattr(params, "spec_schedule", [])]
            speedup = max(1.0 + sum(params.acceptance_profile(k, 0)) for k in depths)
        return cls(params.decode_base_s, params.decode_per_seq_s, params.decode_per_ctx_token_s,
                   params.prefill_per_token_s, params.max_seqs, speedup, int(kv_tokens))

    def alone_s(self, prompt: np.ndarray, length: np.ndarray) -> np.ndarray:
        """Each request's sequential time at batch 1 (seconds)."""
        P, L = prompt.astype(float), length.astype(float)
        decode = L * (self.decode_base_s + self.decode_per_seq_s) + self.decode_per_ctx_token_s * (L * P + L * (L - 1) / 2)
        return self.prefill_per_token_s * P + decode / self.spec_speedup

    def work_s(self, prompt: np.ndarray, length: np.ndarray) -> np.ndarray:
        """Each request's share of engine time at the best per-token cost."""
        P, L = prompt.astype(float), length.astype(float)
        decode = (L * (self.decode_base_s / self.max_seqs + self.decode_per_seq_s)
                  + self.decode_per_ctx_token_s * (L * P + L * (L - 1) / 2))
        return self.prefill_per_token_s * P + decode / self.spec_speedup


@dataclass(slots=True)
class Bound:
    lower_bound_s: float
    work_s: float  # total work / fleet throughput (batch size and KV cache)
    longest_s: float  # the longest request alone (after its arrival)
    shared_s: float = 0.0  # the longest requests cannot all run alone (module docstring)
    batch_s: float = 0.0  # each response's steps cannot be too full (module docstring)


def kv_load(prompt: np.ndarray, length: np.ndarray, cap: float) -> np.ndarray:
    """Per request, the sum over its tokens of the context each token's step
    holds for it (prompt + tokens so far + the new one), each capped at `cap`."""
    P, L = prompt.astype(float), length.astype(float)
    m = np.clip(cap - P, 0.0, L)  # tokens whose context stays within the cap
    return m * P + m * (m + 1) / 2 + (L - m) * cap


def lower_bound(record: StepRecord, cost: CostModel, engines: int) -> Bound:
    """The bound of a record's makespan from the samples it delivered."""
    if not record.samples:
        return Bound(0.0, 0.0, 0.0)
    P = np.array([c.prompt_len for c in record.samples], dtype=float)
    L = np.array([c.response_len for c in record.samples], dtype=float)
    offset = np.array([record.group_submitted_at.get(c.group_id, record.submitted_at) - record.submitted_at
                       for c in record.samples])
    sp = cost.spec_speedup
    b, s = cost.decode_base_s / sp, cost.decode_per_seq_s / sp
    # Each request's own prefill and context terms, paid in steps it is in.
    own = cost.prefill_per_token_s * P + cost.decode_per_ctx_token_s / sp * (L * P + L * (L - 1) / 2)
    W = float(L.sum())
    steps = W / cost.max_seqs  # engine steps the fleet needs at least
    if cost.kv_tokens > 0:
        cap = float(cost.kv_tokens + cost.max_seqs)
        steps = max(steps, float(kv_load(P, L, cap).sum()) / cap)
    fixed = s * W + float(own.sum())
    work = (b * steps + fixed) / engines
    longest = float((offset + cost.alone_s(P, L)).max())
    shared = _shared_steps(L, offset + own, b, s, steps, fixed, engines)
    batch = _batch_sizes(L, offset + own, float(own.sum()), b, s, cost.max_seqs, steps, engines, longest)
    lb = max(work, longest, shared, batch) * (1 - _ROUNDING)
    return Bound(lb, work, longest, shared, batch)


def _batch_sizes(L: np.ndarray, fixed_time: np.ndarray, own_total: float, b: float, s: float, max_seqs: int,
                 steps: float, engines: int, longest: float) -> float:
    """The batch-size bound (module docstring): the least T with
    b * max(sum(L / J(T)), steps) + s * sum(L) + own_total <= engines * T,
    where J(T) = min(max_seqs, (T - fixed_time - L * b) / (s * L)) per
    response (`fixed_time`: its arrival offset plus its own prefill and
    context terms; sum(L / J) counts engine steps, shared evenly by their
    sequences, and `steps` is the fleet's least number of steps from its
    batch size and KV cache, as in the total-work term)."""
    L = L.astype(float)
    keep = L > 0
    L, fixed_time = L[keep], fixed_time[keep]
    if not len(L) or s <= 0:
        return 0.0

    def fits(T: float) -> bool:
        J = np.minimum(max_seqs, (T - fixed_time - L * b) / (s * L))
        if (J < 1).any():
            return False  # some response cannot end by T even alone
        return b * max(float((L / J).sum()), steps) + s * float(L.sum()) + own_total <= engines * T

    lo, hi = longest, max(longest, 1e-9) * 2
    while not fits(hi):
        lo, hi = hi, hi * 2
    return least_feasible(lambda T: True if fits(T) else None, lo, hi, rounds=60)[0]


def _shared_steps(L: np.ndarray, own: np.ndarray, b: float, s: float, steps: float, fixed: float,
                  engines: int) -> float:
    """The shared-steps bound (module docstring), for every a at once: the
    least T over X in [longest of A, W_A] with
    a*T >= sum(own, A) + b*W_A + s*W_A^2/X  and  N*T >= b*max(X, steps) + fixed."""
    order = np.argsort(-L, kind="stable")
    Ls = L[order]
    a = np.arange(1, len(Ls) + 1, dtype=float)
    WA = np.cumsum(Ls)
    base = np.cumsum(own[order])
    lo, hi = np.full_like(WA, Ls[0]), WA.copy()

    def f(X):  # the set's own inequality, decreasing in X
        return (base + b * WA + s * WA * WA / X) / a

    def g(X):  # the fleet's, increasing in X
        return (b * np.maximum(X, steps) + fixed) / engines

    for _ in range(60):
        mid = (lo + hi) / 2
        above = f(mid) > g(mid)
        lo = np.where(above, mid, lo)
        hi = np.where(above, hi, mid)
    # hi: the least X where the fleet's inequality binds (or W_A); lo: where A's still does.
    best = np.minimum(np.maximum(f(hi), g(hi)), np.maximum(f(lo), g(lo)))
    return float(best.max())


class FleetProbe:
    """Samples every engine's running batch at a fixed interval (for the
    timeline plot and for busy fractions of engines that keep no counters)."""

    def __init__(self, engines: dict, now, interval_s: float, tools=None) -> None:
        self.engines = engines
        self.now = now
        self.interval_s = interval_s
        self.times: list[float] = []
        self.running: list[list[int]] = []
        self.tools_fn = tools  # multi-turn: tool calls in flight now
        self.tools: list[int] = []
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="fleet-probe")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    def sample(self) -> None:
        self.times.append(self.now())
        self.running.append([e.load().running for e in self.engines.values()])
        if self.tools_fn is not None:
            self.tools.append(int(self.tools_fn()))

    async def _loop(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval_s)

    def window(self, t0: float, t1: float) -> np.ndarray:
        """Running counts (samples x engines) within [t0, t1]."""
        t = np.array(self.times)
        if not len(t):
            return np.zeros((0, len(self.engines)))
        mask = (t >= t0) & (t <= t1)
        return np.array(self.running, dtype=float)[mask]


@dataclass(slots=True)
class Counters:
    """Engine and core counters at one instant."""

    busy_s: list[float] | None  # per engine; None when the engines keep no such counter
    slot_s: list[float] | None
    migrations: int
    tokens_reprefilled: int
    prefix_queried: int = 0  # engines' prefix-cache lookups (tokens), summed
    prefix_hits: int = 0
    continued_queried: int = 0  # of those, requests continuing a response (simulated engines)
    continued_hits: int = 0
    prefilled: int = 0  # tokens prefilled (simulated engines)
    observation_tokens: int = 0  # multi-turn: observation tokens appended by the core

    @classmethod
    def read(cls, fleet) -> "Counters":
        engines = list(fleet.engines.values())
        busy = [getattr(e, "busy_s", None) for e in engines]
        slot = [getattr(e, "slot_s", None) for e in engines]
        counters = fleet.core.counters
        return cls(
            busy if all(b is not None for b in busy) else None,
            slot if all(s is not None for s in slot) else None,
            int(counters.get("migrations", 0)),
            int(counters.get("tokens_reprefilled", 0)),
            sum(e.load().prefix_cache_queried_tokens for e in engines),
            sum(e.load().prefix_cache_hit_tokens for e in engines),
            sum(getattr(e, "continued_queried_tokens", 0) for e in engines),
            sum(getattr(e, "continued_hit_tokens", 0) for e in engines),
            sum(getattr(e, "prefill_tokens", 0) for e in engines),
            int(counters.get("observation_tokens", 0)),
        )


def host_cpu() -> list[int] | None:
    """The host's CPU time so far, in clock ticks summed over its CPUs, from
    /proc/stat: user, nice, system, idle, iowait, irq, softirq, steal
    (None where there is no /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]
    return ticks + [0] * (8 - len(ticks))


def host_cpu_share(start: list[int] | None, end: list[int] | None) -> dict | None:
    """Between two `host_cpu` readings: the fractions of the CPUs' time that
    went to work (`busy`), was left idle, and was stolen by the hypervisor
    for other guests (`steal`: a virtual machine whose speed drifts often
    shows it here)."""
    if start is None or end is None:
        return None
    d = [b - a for a, b in zip(start, end)]
    total = sum(d)
    if total <= 0:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = d[:8]
    return {"busy": (user + nice + system + irq + softirq) / total, "idle": (idle + iowait) / total,
            "steal": steal / total}


def _fraction(x: float) -> float:
    # Rounding in the virtual clock can put a fully busy engine a hair above 1.
    return 1.0 if 1.0 < x < 1.0 + 1e-9 else x


def step_metrics(record: StepRecord, start: Counters, end: Counters, probe: FleetProbe | None,
                 cost: CostModel, engines: int) -> dict:
    """Everything reported for one step (seconds, tokens, fractions)."""
    span = record.makespan_s
    bound = lower_bound(record, cost, engines)
    tokens = sum(c.response_len for c in record.samples)
    if start.busy_s is not None and end.busy_s is not None and span > 0:
        busy = [_fraction((b1 - b0) / span) for b0, b1 in zip(start.busy_s, end.busy_s)]
        slots = sum(s1 - s0 for s0, s1 in zip(start.slot_s, end.slot_s)) / (engines * cost.max_seqs * span)
        source = "engine counters"
    else:
        window = probe.window(record.submitted_at, record.done_at) if probe else np.zeros((0, engines))
        busy = (window > 0).mean(axis=0).tolist() if len(window) else [0.0] * engines
        slots = float(window.mean() / cost.max_seqs) if len(window) else 0.0
        source = "sampled"
    latency = [c.finished_at - c.queued_at for c in record.samples]
    return {
        "step": record.step,
        "makespan_s": span,
        "lower_bound_s": bound.lower_bound_s,
        "bound_work_s": bound.work_s,
        "bound_longest_s": bound.longest_s,
        "bound_shared_s": bound.shared_s,
        "bound_batch_s": bound.batch_s,
        "ratio_to_bound": span / bound.lower_bound_s if bound.lower_bound_s > 0 else None,
        "weight_sync_s": 0.0,  # filled in by `summarise` once the push returned
        "samples_submitted": record.samples_submitted,
        "samples_delivered": len(record.samples),
        "groups_needed": record.needed_groups,
        "groups_complete": record.groups_complete,
        "tokens": tokens,
        "longest_response": max((c.response_len for c in record.samples), default=0),
        "busy_fraction": busy,
        "busy_source": source,
        "slot_utilisation": slots,
        "latency_p50_s": float(np.percentile(latency, 50)) if latency else 0.0,
        "latency_p99_s": float(np.percentile(latency, 99)) if latency else 0.0,
        "migrations": end.migrations - start.migrations,
        "tokens_reprefilled": end.tokens_reprefilled - start.tokens_reprefilled,
    }


def summarise(steps: list[dict], records: list[StepRecord], engines: int) -> dict:
    """Run-level figures from the per-step ones (time-weighted where it matters)."""
    for s, r in zip(steps, records):
        s["train_s"] = r.trained_at - r.done_at if r.trained_at else 0.0
        s["weight_sync_s"] = r.weights_at - (r.trained_at or r.done_at)
    spans = np.array([s["makespan_s"] for s in steps])
    total = float(spans.sum())
    busy = np.array([s["busy_fraction"] for s in steps])  # steps x engines
    busy_mean = float((busy.mean(axis=1) * spans).sum() / total) if total > 0 else 0.0
    per_engine = ((busy * spans[:, None]).sum(axis=0) / total).tolist() if total > 0 else [0.0] * engines
    latency = [c.finished_at - c.queued_at for r in records for c in r.samples]
    lbs = np.array([s["lower_bound_s"] for s in steps])
    return {
        "steps": len(steps),
        "makespan_s": float(spans.mean()),
        "lower_bound_s": float(lbs.mean()),
        "ratio_to_bound": float(total / lbs.sum()) if lbs.sum() > 0 else None,
        "tokens_per_s": sum(s["tokens"] for s in steps) / total if total > 0 else 0.0,
        "groups_per_s": sum(r.groups_complete for r in records) / total if total > 0 else 0.0,
        "slot_utilisation": float(sum(s["slot_utilisation"] * s["makespan_s"] for s in steps) / total) if total > 0 else 0.0,
        "busy_fraction": busy_mean,
        "busy_fraction_per_engine": per_engine,
        "bubble_ratio": 1.0 - busy_mean,
        "latency_p50_s": float(np.percentile(latency, 50)) if latency else 0.0,
        "latency_p99_s": float(np.percentile(latency, 99)) if latency else 0.0,
        "weight_sync_s": float(np.mean([s["weight_sync_s"] for s in steps])),
        # The whole RL step (samples, the trainer stand-in, the push): what a trainer's loop sees.
        "step_time_s": float(np.mean([r.cycle_s for r in records])) if records else 0.0,
        "groups_per_s_with_trainer": (sum(r.groups_complete for r in records) / sum(r.cycle_s for r in records)
                                      if records and sum(r.cycle_s for r in records) > 0 else 0.0),
        "samples_submitted": sum(s["samples_submitted"] for s in steps),
        "samples_delivered": sum(len(r.samples) for r in records),
        "tokens": sum(s["tokens"] for s in steps),
        "migrations": sum(s["migrations"] for s in steps),
        "tokens_reprefilled": sum(s["tokens_reprefilled"] for s in steps),
    }
