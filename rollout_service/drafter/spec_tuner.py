"""Speculative depth per running-batch size, chosen from measured throughput.

Whether K drafted tokens per step pay depends on the batch size (verifying
K+1 tokens per sequence is nearly free for one sequence and not for 64), on
how often drafts are accepted (which moves as the policy trains), and on
what a draft step costs next to a target step (a one-layer drafter of a 32B
target on a GPU: a few percent; two tiny models on a CPU: nearly as much).
None of these is known in advance, so the tuner measures.

Per batch-size bucket it runs an epsilon-greedy bandit over the depths
0..max_k (TLT, arXiv 2511.16665): the reward of an arm is the tokens per
second per running sequence over a sliding window of the steps taken with
it; every `interval_s` each bucket takes its best arm, or with probability
`epsilon` a random one. Arms never tried are tried first once the bucket is
seen. The policy is pure (observations in, schedule out); `TunerLoop`
drives one tuner per engine.
"""
from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from rollout_service.aio import cancel_and_wait
from rollout_service.engines.base import Engine
from rollout_service.engines.spec_monitor import StepObservation
from rollout_service.engines.spec_status import DepthBucket, TunerState
from rollout_service.engines.tables import from_table
from rollout_service.engines.types import EngineState

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, 1 << 16))


@dataclass(slots=True)
class TunerConfig:
    """`[engine.spec.tuner]`."""

    buckets: list[list[int]] = field(default_factory=lambda: [list(b) for b in DEFAULT_BUCKETS])
    depths: list[int] = field(default_factory=list)  # candidate K; empty means 0..max_k
    epsilon: float = 0.1
    window: int = 32  # observations kept per (bucket, K) arm
    min_observations: int = 3  # before an arm's mean competes
    interval_s: float = 0.5  # seconds between decisions
    outlier_factor: float = 8.0  # steps slower than this x the arm's median are dropped (pauses)
    seed: int = 0

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> "TunerConfig":
        cfg = from_table(cls, values, "engine.spec.tuner")
        if not 0.0 <= cfg.epsilon <= 1.0:
            raise ValueError(f"engine.spec.tuner.epsilon must be in [0, 1], got {cfg.epsilon}")
        if cfg.window < 1 or cfg.min_observations < 1 or cfg.interval_s <= 0:
            raise ValueError("engine.spec.tuner: window, min_observations and interval_s must be positive")
        return cfg


@dataclass(slots=True)
class _Arm:
    obs: deque  # (tokens, seconds, batch)

    def reward(self) -> float:
        """Tokens per second per running sequence over the window."""
        seq_seconds = sum(o[1] * o[2] for o in self.obs)
        tokens = sum(o[0] for o in self.obs)
        return tokens / seq_seconds if seq_seconds > 0 else 0.0


class DepthTuner:
    """Epsilon-greedy choice of K per batch-size bucket for one engine."""

    def __init__(self, cfg: TunerConfig, max_k: int, max_seqs: int,
                 initial: Sequence[Sequence[int]] = (), graph_depths: Mapping[int, int] | None = None) -> None:
        """`graph_depths` ({K: largest batch with a captured CUDA graph at
        depth K}, `spec_config.graph_depths`): a bucket chooses only among
        the depths captured for its whole range (a graph engine's step at
        any other depth would run eagerly); None: any depth."""
        self.cfg = cfg
        self.max_seqs = max_seqs
        self.depths = sorted({min(int(k), max_k) for k in cfg.depths} if cfg.depths else set(range(max_k + 1)))
        self.buckets = [(lo, min(hi, max_seqs)) for lo, hi in cfg.buckets if lo <= max_seqs]
        if not self.buckets or self.buckets[0][0] != 1:
            raise ValueError("engine.spec.tuner.buckets must start at batch size 1")
        self._rng = random.Random(cfg.seed)
        self.choice = [self._initial_k(lo, initial, self.depths) for lo, _ in self.buckets]
        arms = [self.depths] * len(self.buckets)
        if graph_depths is not None:
            arms = [[k for k in self.depths if graph_depths.get(k, 0) >= hi] or [self.choice[b]]
                    for b, (_, hi) in enumerate(self.buckets)]
            self.choice = [self._initial_k(lo, initial, ks) for (lo, _), ks in zip(self.buckets, arms)]
        self.arms = [{k: _Arm(deque(maxlen=cfg.window)) for k in ks} for ks in arms]
        self.seen = [0] * len(self.buckets)  # observations since the last decision
        self.decisions = 0
        self.explorations = 0

    @staticmethod
    def _initial_k(batch: int, schedule: Sequence[Sequence[int]], depths: Sequence[int]) -> int:
        k = 0
        for lo, hi, depth in schedule:
            if lo <= batch:
                k = depth
        return min(depths, key=lambda d: abs(d - k))

    def bucket_of(self, batch: int) -> int:
        for i, (lo, hi) in enumerate(self.buckets):
            if lo <= batch <= hi:
                return i
        return len(self.buckets) - 1

    def observe(self, observations: Iterable[StepObservation]) -> None:
        for o in observations:
            if o.seconds <= 0 or o.batch <= 0:
                continue
            b = self.bucket_of(o.batch)
            arm = self.arms[b].get(o.k)
            if arm is None:
                continue  # a depth the tuner does not choose among (e.g. capped)
            if len(arm.obs) >= self.cfg.min_observations:
                median = sorted(x[1] / max(x[0], 1) for x in arm.obs)[len(arm.obs) // 2]
                if o.seconds / max(o.tokens, 1) > self.cfg.outlier_factor * median:
                    continue  # a pause (weight update, preemption), not the arm's speed
            arm.obs.append((o.tokens, o.seconds, o.batch))
            self.seen[b] += 1

    def choose(self) -> list[tuple[int, int, int]]:
        """Decide K for every bucket seen since the last decision; returns
        the schedule [(first, last, K), ...]."""
        self.decisions += 1
        for b, arms in enumerate(self.arms):
            if not self.seen[b]:
                continue  # nothing new: keep the choice
            self.seen[b] = 0
            untried = [k for k, arm in arms.items() if len(arm.obs) < self.cfg.min_observations]
            if arms[self.choice[b]].obs and len(arms[self.choice[b]].obs) < self.cfg.min_observations:
                continue  # let the arm in force collect its observations
            if untried:
                self.choice[b] = untried[0]
            elif self._rng.random() < self.cfg.epsilon:
                self.choice[b] = self._rng.choice(list(arms))
                self.explorations += 1
            else:
                self.choice[b] = max(arms, key=lambda k: arms[k].reward())
        return self.schedule()

    def schedule(self) -> list[tuple[int, int, int]]:
        return [(lo, hi, k) for (lo, hi), k in zip(self.buckets, self.choice)]

    def best(self) -> list[int]:
        """The greedy K per bucket (no exploration), for reporting."""
        out = []
        for b, arms in enumerate(self.arms):
            ready = [k for k, arm in arms.items() if len(arm.obs) >= self.cfg.min_observations]
            out.append(max(ready, key=lambda k: arms[k].reward()) if ready else self.choice[b])
        return out

    def state(self) -> TunerState:
        """Per bucket the K in force, the greedy K and each arm's measured
        tokens/s per sequence and observation count."""
        best = self.best()
        return TunerState(
            decisions=self.decisions,
            explorations=self.explorations,
            buckets=[
                DepthBucket(
                    min_batch=lo, max_batch=hi, k=self.choice[b], best_k=best[b],
                    tokens_per_s_per_seq={k: round(arm.reward(), 2) for k, arm in self.arms[b].items() if arm.obs},
                    observations={k: len(arm.obs) for k, arm in self.arms[b].items() if arm.obs},
                )
                for b, (lo, hi) in enumerate(self.buckets)
            ],
        )


class TunerLoop:
    """Drives one `DepthTuner` per speculating engine: every `interval_s`
    it drains the engine's step observations, decides, and pushes a changed
    schedule with `engine.speculation.set_schedule`. Runs on the event loop;
    the work per tick is a few hundred additions."""

    def __init__(self, engines: Iterable[Engine], cfg: TunerConfig) -> None:
        self.cfg = cfg
        self.tuners: dict[str, tuple[Engine, DepthTuner]] = {}
        for engine in engines:
            if engine.speculation is None:
                continue
            monitor = engine.speculation.monitor
            tuner = DepthTuner(cfg, monitor.cfg.num_speculative_tokens, monitor.max_seqs, monitor.schedule,
                               monitor.graph_depths)
            self.tuners[engine.engine_id] = (engine, tuner)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.tuners and self._task is None:
            self._task = asyncio.create_task(self._run(), name="spec-tuner")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def tick(self) -> None:
        """One decision round (also callable directly, e.g. from tests)."""
        for engine, tuner in self.tuners.values():
            speculation = engine.speculation
            monitor = speculation.monitor
            tuner.observe(monitor.drain())
            schedule = tuner.choose()
            if engine.load().state not in (EngineState.READY, EngineState.UPDATING):
                continue
            if [tuple(e) for e in monitor.schedule] != schedule:
                try:
                    await speculation.set_schedule(schedule)
                except Exception as exc:  # an engine restarting: try next tick
                    log.debug("spec schedule for %s not applied: %s", engine.engine_id, exc)
            monitor.tuner_state = tuner.state()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            try:
                await self.tick()
            except Exception:  # a tuner bug must not stop the service
                log.exception("spec tuner failed")
