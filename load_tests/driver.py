"""Load drivers: the trainer's side of a load test.

Written once against `RolloutTarget` (submit groups, iterate completed
samples, push weights, read the clock); `load_tests.targets` adapts it to the
in-process core (virtual or real time) and to the gRPC client, so the two
modes differ only in the network.

- `closed_loop`: the RL pattern. Each step submits its B groups, waits until
  the step has what it needs (all groups by default), pushes weights (a tiny
  dummy state dict: version + 1), then starts the next step.
- `open_loop`: groups arrive as a Poisson process at `rate` groups/s,
  whatever the service's progress; no weight pushes.
"""
from __future__ import annotations

import asyncio
import hashlib
import math
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Protocol

import numpy as np

from load_tests.workloads import GroupShape, Workload


@dataclass(slots=True)
class GroupRequest:
    """One group to submit. `target_lengths` is the simulated engine's hint
    (the response length of each sample, tokens); real engines ignore it."""

    group_id: str
    prompt_token_ids: list[int]
    num_samples: int
    max_tokens: int
    target_lengths: list[int] | None = None
    temperature: float = 1.0

    def metadata(self) -> dict[str, str]:
        if not self.target_lengths:
            return {}
        return {"sim.target_lengths": ",".join(map(str, self.target_lengths))}


@dataclass(slots=True)
class Completion:
    """A completed sample as the driver sees it (times: the service clock, s)."""

    sample_id: str
    group_id: str
    index: int
    prompt_len: int
    response_len: int
    finish_reason: str
    queued_at: float
    first_token_at: float
    finished_at: float
    engines: list[str]
    num_migrations: int
    response_token_ids: list[int] | None = None
    min_version: int = 0  # oldest policy version among its tokens
    max_version: int = 0


class RolloutTarget(Protocol):
    """What a driver needs of a rollout service."""

    async def submit(self, groups: list[GroupRequest]) -> None:
        """Enqueue groups (all or nothing)."""

    def completions(self) -> AsyncIterator[Completion]:
        """Every completed sample once, as it completes (one long-lived stream)."""

    async def push_weights(self, version: int) -> None:
        """Push a new policy version; returns when every engine serves it."""

    def now(self) -> float:
        """A monotonic clock of the driver's event loop (seconds; virtual
        time under `run_virtual`). Step times are differences of it; sample
        timestamps are the service's clock and are only compared with each other."""


@dataclass(slots=True)
class StepRecord:
    """What happened in one step (closed loop) or one whole run (open loop)."""

    step: int
    submitted_at: float  # the first group's submission
    done_at: float = 0.0  # the step had what it needed
    weights_at: float = 0.0  # the weight push returned (closed loop)
    group_submitted_at: dict[str, float] = field(default_factory=dict)
    samples: list[Completion] = field(default_factory=list)
    needed_groups: int = 0
    samples_submitted: int = 0
    groups_complete: int = 0

    @property
    def makespan_s(self) -> float:
        return self.done_at - self.submitted_at


def prompt_ids(shape: GroupShape, key: str, vocab_size: int) -> list[int]:
    """The group's real prompt ids, or `prompt_len` deterministic ids in
    [3, vocab_size) (the low ids are usually special tokens)."""
    if shape.prompt_token_ids is not None:
        return list(shape.prompt_token_ids)
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    span = max(1, vocab_size - 3)
    return [3 + (h + 7919 * i) % span for i in range(shape.prompt_len)]


def group_requests(workload: Workload, step: int, run_id: str, vocab_size: int) -> list[GroupRequest]:
    out = []
    for i, shape in enumerate(workload.steps[step]):
        gid = f"{run_id}-s{step}-g{i}"
        # A length at the cap was truncated: ask for one more so the budget stops it ("length").
        hints = [L + 1 if L >= workload.max_tokens else L for L in shape.output_lens]
        out.append(GroupRequest(gid, prompt_ids(shape, f"{step}/{i}", vocab_size), shape.num_samples,
                                workload.max_tokens, hints))
    return out


class _Collector:
    """Routes the single completion stream to the records the groups belong to."""

    def __init__(self, target: RolloutTarget) -> None:
        self.stream = target.completions()
        self.owner: dict[str, StepRecord] = {}
        self.remaining: dict[str, int] = {}  # group id -> samples not yet seen
        self.seen: set[str] = set()
        self.duplicates = 0

    def expect(self, record: StepRecord, groups: list[GroupRequest]) -> None:
        for g in groups:
            self.owner[g.group_id] = record
            self.remaining[g.group_id] = g.num_samples

    async def until(self, record: StepRecord, need_groups: int) -> None:
        """Consume completions until `need_groups` of the record's groups are complete."""
        while record.groups_complete < need_groups:
            c = await self.stream.__anext__()
            if c.sample_id in self.seen:
                self.duplicates += 1
                continue
            self.seen.add(c.sample_id)
            owner = self.owner.get(c.group_id)
            if owner is None:
                continue  # not ours (another consumer's group on a shared service)
            owner.samples.append(c)
            self.remaining[c.group_id] -= 1
            if self.remaining[c.group_id] == 0:
                owner.groups_complete += 1

    async def close(self) -> None:
        await self.stream.aclose()


async def closed_loop(
    target: RolloutTarget,
    workload: Workload,
    vocab_size: int,
    run_id: str = "run",
    need_groups: int | None = None,
    push_weights: bool = True,
    on_step_start: Callable[[int], None] | None = None,
    on_step_end: Callable[[StepRecord], None] | None = None,
) -> tuple[list[StepRecord], int]:
    """Run the workload step by step; returns the step records and the number
    of duplicate deliveries seen."""
    collector = _Collector(target)
    records: list[StepRecord] = []
    try:
        for step in range(len(workload.steps)):
            groups = group_requests(workload, step, run_id, vocab_size)
            if on_step_start:
                on_step_start(step)
            t0 = target.now()
            record = StepRecord(step, t0, group_submitted_at={g.group_id: t0 for g in groups},
                                needed_groups=min(need_groups or len(groups), len(groups)))
            record.samples_submitted = sum(g.num_samples for g in groups)
            collector.expect(record, groups)
            await target.submit(groups)
            await collector.until(record, record.needed_groups)
            record.done_at = target.now()
            if on_step_end:
                on_step_end(record)
            if push_weights:
                await target.push_weights(step + 1)
            record.weights_at = target.now()
            records.append(record)
    finally:
        await collector.close()
    return records, collector.duplicates


async def partial_loop(
    target: RolloutTarget,
    workload: Workload,
    vocab_size: int,
    over_provision: float,
    run_id: str = "run",
    on_step_start: Callable[[int], None] | None = None,
    on_step_end: Callable[[StepRecord], None] | None = None,
) -> tuple[list[StepRecord], int, dict]:
    """Closed loop with partial rollout: step k needs B_k complete groups (the
    trace step's size); ceil(B_k x over_provision) groups are kept in flight,
    the B_k oldest-submitted complete ones are handed over, the rest carry on
    into the next policy version. After the last step the groups still in
    flight are drained, so every submitted group is delivered.

    Returns the step records, duplicates, and the drain (seconds, groups) and
    per-step length bias (mean response length handed over vs submitted)."""
    pending = [g for step in range(len(workload.steps)) for g in group_requests(workload, step, run_id, vocab_size)]
    pending.reverse()  # pop() takes the next in trace order
    order: dict[str, int] = {}
    lengths: dict[str, float] = {}
    complete: dict[str, list[Completion]] = {}
    partial: dict[str, list[Completion]] = {}
    size: dict[str, int] = {}
    stream = target.completions()
    seen: set[str] = set()
    duplicates = 0
    records: list[StepRecord] = []
    bias: list[dict] = []
    submission = iter(range(1 << 62))  # submission order: oldest first

    def in_flight() -> int:
        return len(order) - len(complete)

    async def top_up(target_in_flight: int, record: StepRecord | None) -> list[GroupRequest]:
        batch = []
        # Complete groups not handed over yet count too: the pool stays at
        # ceil(B x over_provision), so finished work never piles up and ages.
        while pending and len(order) + len(batch) < target_in_flight:
            g = pending.pop()
            batch.append(g)
        for g in batch:
            order[g.group_id] = next(submission)
            size[g.group_id] = g.num_samples
            lengths[g.group_id] = float(np.mean(g.target_lengths)) if g.target_lengths else 0.0
            if record is not None:
                record.group_submitted_at[g.group_id] = target.now()
        if batch:
            await target.submit(batch)
        return batch

    async def pull() -> None:
        nonlocal duplicates
        c = await stream.__anext__()
        if c.sample_id in seen:
            duplicates += 1
            return
        seen.add(c.sample_id)
        if c.group_id not in size:
            return
        partial.setdefault(c.group_id, []).append(c)
        if len(partial[c.group_id]) == size[c.group_id]:
            complete[c.group_id] = partial.pop(c.group_id)

    try:
        for step, shapes in enumerate(workload.steps):
            need = len(shapes)
            if on_step_start:
                on_step_start(step)
            record = StepRecord(step, target.now(), needed_groups=need)
            submitted = await top_up(math.ceil(need * over_provision), record)
            record.samples_submitted = sum(g.num_samples for g in submitted)
            while len(complete) < need and (in_flight() > 0 or pending):
                await pull()
            chosen = sorted(complete, key=order.__getitem__)[:need]
            for gid in chosen:
                record.samples.extend(complete.pop(gid))
                del order[gid]
            record.groups_complete = len(chosen)
            record.done_at = target.now()
            bias.append({
                "step": step,
                "handed_over_mean_length": float(np.mean([c.response_len for c in record.samples])) if record.samples else 0.0,
                "submitted_mean_length": float(np.mean([lengths[g.group_id] for g in submitted])) if submitted else 0.0,
            })
            if on_step_end:
                on_step_end(record)
            await target.push_weights(step + 1)
            record.weights_at = target.now()
            records.append(record)
        t0 = target.now()
        drained = len(order)
        while len(complete) < len(order):
            await pull()
        drain = {"drain_s": target.now() - t0, "drained_groups": drained,
                 "drained_samples": [c for g in complete.values() for c in g]}
    finally:
        await stream.aclose()
    return records, duplicates, {"drain": drain, "length_bias": bias}


async def open_loop(
    target: RolloutTarget,
    workload: Workload,
    vocab_size: int,
    rate: float,
    seed: int = 0,
    run_id: str = "run",
    on_step_start: Callable[[int], None] | None = None,
    on_step_end: Callable[[StepRecord], None] | None = None,
) -> tuple[list[StepRecord], int]:
    """Submit every group of the workload at Poisson arrivals of `rate`
    groups/s; one record covers the whole run."""
    if rate <= 0:
        raise ValueError(f"open loop needs a rate > 0 groups/s, got {rate}")
    groups = [g for step in range(len(workload.steps)) for g in group_requests(workload, step, run_id, vocab_size)]
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=len(groups))
    gaps[0] = 0.0
    collector = _Collector(target)
    if on_step_start:
        on_step_start(0)
    record = StepRecord(0, target.now(), needed_groups=len(groups))
    record.samples_submitted = sum(g.num_samples for g in groups)
    collector.expect(record, groups)

    async def arrivals() -> None:
        for g, gap in zip(groups, gaps):
            if gap > 0:
                await asyncio.sleep(gap)
            record.group_submitted_at[g.group_id] = target.now()
            await target.submit([g])

    feeder = asyncio.create_task(arrivals())
    try:
        # Groups not submitted yet count as incomplete, so this waits for all of them.
        await collector.until(record, len(groups))
        await feeder
        record.done_at = record.weights_at = target.now()
        if on_step_end:
            on_step_end(record)
    finally:
        feeder.cancel()
        await collector.close()
    return [record], collector.duplicates
