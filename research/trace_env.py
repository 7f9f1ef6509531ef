"""The trace environment of multi-turn load tests: tool calls as traced.

A multi-turn workload's group carries, per trajectory, the tool latency and
the observation length after each turn (metadata `trace.tool_s` and
`trace.observation_lens`: per sample index ';'-separated, per turn
','-separated, as `sim.turn_lengths`). `TraceEnvironment` is the
environment hook the core calls between turns: it sleeps the traced
latency (`asyncio.sleep`, so virtual time in a virtual-clock run), returns
that many observation tokens (deterministic ids of the sample and turn) and
says `done` after the trajectory's last traced turn. It also counts the
tool calls in flight, for the load test's "engines idle while tools run".
"""
from __future__ import annotations

import asyncio

from rollout_service.bench.driver import observation_ids
from rollout_service.lifecycle.types import EnvReply, EnvRequest

NAME = "trace"


def per_turn(meta: dict[str, str], key: str, index: int, cast=float) -> list:
    """Sample `index`'s per-turn values of a ';'/','-encoded metadata field."""
    text = meta.get(key, "")
    if not text:
        return []
    samples = text.split(";")
    item = samples[index % len(samples)]
    return [cast(x) for x in item.split(",") if x.strip()]


class TraceEnvironment:
    """`async (EnvRequest) -> EnvReply` replaying the trace's tool calls."""

    def __init__(self, vocab_size: int = 64) -> None:
        self.vocab_size = vocab_size
        self.in_flight = 0  # tool calls being waited on now
        self.calls = 0
        self.tool_s = 0.0  # traced latency slept, summed

    async def __call__(self, req: EnvRequest) -> EnvReply:
        turns = per_turn(req.metadata, "sim.turn_lengths", req.index, int)
        if req.turn >= len(turns) - 1:
            return EnvReply(done=True)  # the trajectory's last traced turn
        latency = per_turn(req.metadata, "trace.tool_s", req.index)
        lengths = per_turn(req.metadata, "trace.observation_lens", req.index, int)
        wait = latency[req.turn] if req.turn < len(latency) else 0.0
        n = lengths[req.turn] if req.turn < len(lengths) else 0
        self.in_flight += 1
        self.calls += 1
        try:
            if wait > 0:
                await asyncio.sleep(wait)
            self.tool_s += wait
        finally:
            self.in_flight -= 1
        return EnvReply(observation_token_ids=observation_ids(req.sample_id, req.turn, n, self.vocab_size))
