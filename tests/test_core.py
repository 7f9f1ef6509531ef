"""Core behaviour: the simulated engine's batching, virtual time, bounded delivery memory."""
from __future__ import annotations

import asyncio
import time

from rollout_service.core.clock import Clock, run_virtual
from rollout_service.core.rollout import RolloutCore
from rollout_service.engines.types import SamplingParams
from rollout_service.lifecycle.types import GroupSpec
from rollout_service.lifecycle.versions import VersionTags
from rollout_service.engines.sim import SimEngine, SimParams
from rollout_service.scheduling import make_placement
from rollout_service.service import RolloutService
from trainer_client import PromptGroup, RolloutClient

from helpers import collect, sim_config


def _specs(n: int, samples: int, lengths: list[int] | None = None) -> list[GroupSpec]:
    out = []
    for i in range(n):
        meta = {"sim.target_lengths": ",".join(map(str, lengths))} if lengths else {}
        out.append(GroupSpec(f"g{i}", [1, 2, 3] * 10, samples, SamplingParams(max_tokens=100_000), metadata=meta))
    return out


async def _drive(core: RolloutCore, expected: int, watch=None) -> list:
    await core.start()
    got = []
    async for entry in core.delivery.stream("c"):
        got.append(entry)
        if watch:
            watch()
        if len(got) == expected:
            break
    await core.stop()
    return got


def test_sim_engine_respects_max_seqs_and_kv_capacity():
    params = SimParams(max_seqs=8, kv_capacity_tokens=2000, decode_base_s=0.01)
    engine = SimEngine("e0", params)
    peak = {"running": 0, "kv": 0}

    def watch():
        load = engine.load()
        peak["running"] = max(peak["running"], load.running)
        peak["kv"] = max(peak["kv"], load.kv_used_tokens)

    async def main():
        core = RolloutCore([engine], make_placement("least-assigned"), Clock())
        core.submit(_specs(8, 4, lengths=[50, 100, 200, 400]))
        return await _drive(core, 32, watch)

    got = run_virtual(main())
    assert len(got) == 32
    assert peak["running"] <= 8
    assert peak["kv"] <= 2000
    assert {len(e.sample.response_token_ids) for e in got} == {50, 100, 200, 400}


def test_sim_engine_streams_progress_at_least_every_max_run_steps():
    from rollout_service.engines.types import EngineRequest

    async def run(max_run_steps):
        engine = SimEngine("e0", SimParams(max_run_steps=max_run_steps))
        await engine.start()
        loop = asyncio.get_running_loop()
        t0, sizes = loop.time(), []
        async for delta in engine.add(EngineRequest("r", [3] * 20, [], SamplingParams(max_tokens=2000), 2000,
                                                    {"target_length": "1000"})):
            sizes.append(len(delta.token_ids))
        await engine.close()
        return loop.time() - t0, sizes

    coarse_s, coarse = run_virtual(run(10**9))
    fine_s, fine = run_virtual(run(128))
    assert coarse == [1000] and sum(fine) == 1000 and max(fine) <= 128
    assert abs(fine_s - coarse_s) < 1e-9  # same steps, same times: only the deltas are smaller


def test_a_delta_stream_is_iterated_or_pushed_to_a_sink_in_order():
    """A request's deltas reach its reader in order, through `async for` or,
    once a sink is attached, through the sink (what was buffered first);
    what the sink raises goes to `on_error` once, never to the engine."""
    from rollout_service.engines.stream import DeltaStream
    from rollout_service.engines.types import FinishReason, TokenDelta

    async def main():
        it = DeltaStream()
        it.push(TokenDelta([5], [-0.1], 0))
        it.push(TokenDelta([6], [-0.2], 0, FinishReason.STOP))
        assert [d.token_ids async for d in it] == [[5], [6]]

        pushed, errors = DeltaStream(), []
        pushed.push(TokenDelta([1], [-0.1], 0))
        got = []
        pushed.attach(lambda d: got.append(d.token_ids), errors.append)
        pushed.push(TokenDelta([2, 3], [-0.1, -0.2], 1))
        assert got == [[1], [2, 3]] and errors == []

        def broken(delta):
            raise ValueError("bad sink")

        failing = DeltaStream()
        failing.attach(broken, errors.append)
        failing.push(TokenDelta([1], [-0.1], 0))
        failing.push(TokenDelta([2], [-0.1], 0))  # the sink is detached: nothing raised
        assert [type(e) for e in errors] == [ValueError]

    asyncio.run(main())


def test_a_step_of_token_deltas_reaches_a_shared_relay_in_one_call():
    """`push_tokens_many`: the streams that share a relay reach it in one call
    with the step's tokens; any other stream gets its own, as `push_tokens`
    would give it; a relay that raises fails the streams it was given once
    (their error callback), and leaves the others alone."""
    from rollout_service.engines.stream import DeltaStream, push_tokens_many

    async def main():
        calls, errors, plain, buffered = [], [], [], DeltaStream()

        def relay(streams, token_ids, logprobs, version):
            calls.append(([s.target for s in streams], list(token_ids), version))

        shared = [DeltaStream() for _ in range(3)]
        for i, stream in enumerate(shared):
            stream.attach(lambda d: None, errors.append, relay=relay, target=f"t{i}")
        push_tokens_many(shared, [[1], [2], [3]], [[-0.1], [-0.2], [-0.3]], 4)
        assert calls == [(["t0", "t1", "t2"], [[1], [2], [3]], 4)]

        sinked = DeltaStream()
        sinked.attach(lambda d: plain.append(d.token_ids), errors.append)
        calls.clear()
        push_tokens_many([shared[0], sinked, buffered, shared[1]], [[5], [6], [7], [8]], [[-0.1]] * 4, 5)
        assert calls == [(["t0"], [[5]], 5), (["t1"], [[8]], 5)] and plain == [[6]]
        assert [d.token_ids async for d in _first(buffered)] == [[7]]

        def broken(streams, token_ids, logprobs, version):
            raise ValueError("bad relay")

        failing = [DeltaStream() for _ in range(2)]
        for stream in failing:
            stream.attach(lambda d: None, errors.append, relay=broken)
        push_tokens_many(failing, [[1], [2]], [[-0.1], [-0.1]], 0)
        push_tokens_many(failing, [[3], [4]], [[-0.1], [-0.1]], 0)  # detached: buffered, nothing raised
        assert [type(e) for e in errors] == [ValueError, ValueError]

    asyncio.run(main())


async def _first(stream):
    """The first delta a stream buffered."""
    async for delta in stream:
        yield delta
        return


def test_a_simulated_engine_keeps_its_step_times_while_its_event_loop_is_held_up():
    """As vLLM's engine core, which steps on while its front end is busy: a
    loop blocked for 0.15 s delays a 30-step request's tokens, not its finish
    (30 x 10 ms), where an engine that waited for the loop would take 0.45 s."""
    from rollout_service.engines.types import EngineRequest

    async def main():
        engine = SimEngine("e0", SimParams(decode_base_s=0.01, decode_per_seq_s=0.0, prefill_per_token_s=0.0,
                                           max_run_steps=1))
        await engine.start()
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, time.sleep, 0.15)  # the front end busy for 0.15 s
        t0, tokens = loop.time(), 0
        async for delta in engine.add(EngineRequest("r", [3] * 4, [], SamplingParams(max_tokens=100), 100,
                                                    {"target_length": "30"})):
            tokens += len(delta.token_ids)
        elapsed = loop.time() - t0
        await engine.close()
        return tokens, elapsed

    tokens, elapsed = asyncio.run(main())
    assert tokens == 30
    assert 0.3 <= elapsed < 0.42, elapsed


def test_virtual_time_simulates_hours_of_fleet_time_in_seconds():
    engines = [SimEngine(f"e{i}", SimParams(decode_base_s=0.08, seed=i)) for i in range(16)]

    async def main():
        core = RolloutCore(engines, make_placement("least-assigned"), Clock())
        core.submit(_specs(64, 8, lengths=[200, 400, 800, 1600, 3200, 400, 200, 100]))
        t0 = asyncio.get_running_loop().time()
        got = await _drive(core, 512)
        return got, asyncio.get_running_loop().time() - t0

    wall = time.perf_counter()
    got, virtual_s = run_virtual(main())
    wall = time.perf_counter() - wall
    fleet_s = virtual_s * len(engines)
    assert len(got) == 512
    assert fleet_s > 3600, fleet_s  # over an hour of engine time...
    assert wall < fleet_s / 50, (wall, fleet_s)  # ...in a small fraction of it


def test_work_in_another_thread_takes_no_virtual_time():
    """A core step handed to a thread (`asyncio.to_thread`, e.g. freeing a
    superseded push's file) must not let the virtual clock jump to the next
    timer while the thread works: otherwise a run's virtual times, and the
    figures of a simulated benchmark, depend on how busy the machine is."""
    async def main():
        loop = asyncio.get_running_loop()

        async def ticker():  # timers are pending throughout, as in a fleet
            while True:
                await asyncio.sleep(1.0)

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        t0 = loop.time()
        await asyncio.to_thread(time.sleep, 0.3)  # real seconds of work
        elapsed = loop.time() - t0
        await asyncio.sleep(2.5)
        after = loop.time() - t0
        tick.cancel()
        return elapsed, after

    elapsed, after = run_virtual(main())
    assert elapsed == 0.0
    assert after == 2.5  # timers still run in virtual time


def test_version_tags_run_length_encode_and_truncate():
    tags = VersionTags()
    tags.extend([3, 3, 3, 4, 4, 5])
    assert tags.segments == [[3, 0, 3], [4, 3, 2], [5, 5, 1]]
    assert tags.per_token() == [3, 3, 3, 4, 4, 5]
    assert tags.truncated(4).per_token() == [3, 3, 3, 4]
    assert (tags.min_version, tags.max_version) == (3, 5)


async def test_acknowledged_samples_are_freed():
    service = RolloutService(sim_config(num_engines=2))
    await service.start()
    try:
        async with RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id="only") as client:
            await client.submit([PromptGroup(prompt_token_ids=[1, 5], num_samples=8, max_tokens=64, group_id=f"m{i}")
                                 for i in range(20)])
            got = await collect(client, "m", 160)
            # The stream acknowledges consumed samples every 64; the rest are retained.
            assert client.acked_cursor == 128
            assert (await client.status()).retained_samples == 160 - 128
            await client.ack(got[-1].cursor)
            assert (await client.status()).retained_samples == 0
    finally:
        await service.stop()
