"""Multi-turn trajectories in the core, on simulated engines in virtual time:
turns and observations, loss masks, version tags across a weight push,
session affinity, the trainer's answers (idempotent, checked) and the
environment hook."""
from __future__ import annotations

import asyncio
from collections import deque

import pytest

from rollout_service.api.convert import WIRE_SAMPLES
from rollout_service.core.clock import Clock, run_virtual
from rollout_service.core.rollout import CoreLimits, RolloutCore
from rollout_service.engines.sim import SimEngine, SimParams
from rollout_service.engines.types import EngineLoad, FinishReason, SamplingParams
from rollout_service.engines.weights import StagedWeights
from rollout_service.lifecycle.types import CoreError, EnvReply, EnvRequest, Group, GroupSpec, MultiTurnSpec, Request
from rollout_service.lifecycle.versions import NO_VERSION
from rollout_service.partial.carry_over import CarryOverConfig
from rollout_service.scheduling import make_placement
from rollout_service.scheduling.affinity import place_affine, slot_waits
from rollout_service.scheduling.cost_model import CostModel

OBS = 7  # observation tokens per tool call


def _engines(n: int) -> list[SimEngine]:
    return [SimEngine(f"e{i}", SimParams(seed=i, decode_base_s=0.01)) for i in range(n)]


def _group(gid: str, samples: int, turn_lengths: list[list[int]], env: str = "", max_turns: int = 3,
           max_total: int = 0) -> GroupSpec:
    meta = {"sim.turn_lengths": ";".join(",".join(map(str, t)) for t in turn_lengths)}
    return GroupSpec(gid, [5, 6, 7] * 20, samples, SamplingParams(max_tokens=500), metadata=meta,
                     multi_turn=MultiTurnSpec(max_turns=max_turns, max_total_tokens=max_total, environment=env))


def _tool(calls: list[EnvRequest], latency_s: float = 0.5, last_turn: int = 2):
    async def tool(req: EnvRequest) -> EnvReply:
        calls.append(req)
        await asyncio.sleep(latency_s)  # virtual time: overlaps other trajectories' turns
        if req.turn >= last_turn:
            return EnvReply(done=True)
        return EnvReply(observation_token_ids=[900 + req.turn] * OBS)
    return tool


async def _samples(core: RolloutCore, n: int, consumer: str = "c") -> list:
    out = []
    async for entry in core.delivery.stream(consumer):
        if not entry.sample.awaiting_observation:
            out.append(entry.sample)
        if len(out) == n:
            return out


def test_environment_driven_trajectories_alternate_turns_and_observations_with_masks_and_tags():
    calls: list[EnvRequest] = []

    async def main():
        core = RolloutCore(_engines(2), make_placement("least-assigned"), Clock(), environments={"tool": _tool(calls)})
        core.submit([_group("g0", 2, [[20, 30, 40], [11, 12, 13]], env="tool", max_turns=5)])
        await core.start()
        got = await _samples(core, 2)
        await core.stop()
        return core, got

    core, got = run_virtual(main())
    by_index = {s.index: s for s in got}
    for index, lengths in ((0, [20, 30, 40]), (1, [11, 12, 13])):
        s = by_index[index]
        kinds = [t.kind for t in s.turns]
        assert kinds == ["generated", "observation", "generated", "observation", "generated"]
        assert [t.length for t in s.turns if t.kind == "generated"] == lengths
        assert len(s.response_token_ids) == sum(lengths) + 2 * OBS
        assert s.loss_mask == [1] * lengths[0] + [0] * OBS + [1] * lengths[1] + [0] * OBS + [1] * lengths[2]
        obs = [s.response_token_ids[t.start:t.start + t.length] for t in s.turns if t.kind == "observation"]
        assert obs == [[900] * OBS, [901] * OBS]
        # Observation tokens carry no policy version and a zero logprob.
        per_token = s.versions.per_token()
        assert all((v == NO_VERSION) == (m == 0) for v, m in zip(per_token, s.loss_mask))
        assert s.versions.min_version == s.versions.max_version == 0
        assert all(s.logprobs[i] == 0.0 for i, m in enumerate(s.loss_mask) if m == 0)
        assert all(t.tool_s == pytest.approx(0.5) for t in s.turns if t.kind == "observation")
        assert s.finish_reason == FinishReason.STOP and not s.drop_reason
    # The environment saw each turn's own tokens, and the trajectory so far.
    assert sorted(len(c.turn_token_ids) for c in calls) == sorted([20, 30, 40, 11, 12, 13])
    assert core.counters["turns_completed"] == 6 and core.counters["observations_appended"] == 4


def test_affinity_keeps_every_turn_of_a_trajectory_on_its_engine():
    def run(affinity: bool):
        calls: list[EnvRequest] = []

        async def main():
            core = RolloutCore(_engines(4), make_placement("least-assigned"), Clock(),
                               environments={"tool": _tool(calls, latency_s=0.3)}, affinity=affinity)
            lengths = [[10 + 7 * i, 50, 5 + 3 * i] for i in range(8)]
            core.submit([_group(f"g{j}", 8, lengths, env="tool") for j in range(4)])
            await core.start()
            got = await _samples(core, 32)
            await core.stop()
            return core, got
        return run_virtual(main())

    core, got = run(True)
    assert all(len(set(s.engines)) == 1 and len(s.engines) == 3 for s in got)
    assert core.counters["trajectory_moves"] == 0 and core.counters["tokens_reprefilled"] == 0
    plain, got = run(False)  # every turn placed anew by least-assigned
    assert sum(len(set(s.engines)) > 1 for s in got) > 0
    assert plain.counters["trajectory_moves"] > 0 and plain.counters["tokens_reprefilled"] > 0


def test_trainer_driven_turn_events_and_answers():
    async def main():
        core = RolloutCore(_engines(2), make_placement("least-assigned"), Clock())
        core.submit([_group("t", 2, [[15, 25, 35]], max_turns=3, max_total=200)])
        await core.start()
        stream = core.delivery.stream("c").__aiter__()
        events = [(await stream.__anext__()).sample for _ in range(2)]
        assert all(e.awaiting_observation for e in events)
        assert sorted(len(e.response_token_ids) for e in events) == [15, 15]
        first = events[0]
        sid = first.sample_id
        with pytest.raises(CoreError) as err:
            core.continue_trajectory("t/9", 0, [1])
        assert err.value.code == "not_found"
        with pytest.raises(CoreError) as err:
            core.continue_trajectory(sid, 1, [1])
        assert err.value.code == "failed_precondition" and "turn 0" in str(err.value)
        with pytest.raises(CoreError) as err:  # 15 + 190 > max_total_tokens 200
            core.continue_trajectory(sid, 0, [1] * 190)
        assert err.value.code == "invalid" and "max_total_tokens" in str(err.value)
        assert core.continue_trajectory(sid, 0, [3, 3, 3]) is True
        assert core.continue_trajectory(sid, 0, [3, 3, 3]) is False  # a repeat: nothing appended twice
        second = (await stream.__anext__()).sample
        assert second.sample_id == sid and second.awaiting_observation
        assert len(second.response_token_ids) == 15 + 3 + 25
        assert core.continue_trajectory(sid, 1, [], done=True) is True
        final = (await stream.__anext__()).sample
        assert final.sample_id == sid and not final.awaiting_observation
        assert [t.kind for t in final.turns] == ["generated", "observation", "generated"]
        assert final.loss_mask == [1] * 15 + [0] * 3 + [1] * 25
        # The other trajectory still waits, untouched by the errors above.
        other = events[1].sample_id
        assert core.groups["t"].requests[int(other.rsplit("/", 1)[1])].awaiting
        assert core.continue_trajectory(other, 0, [], done=True)
        last = (await stream.__anext__())
        assert last.group_complete and last.sample.sample_id == other
        with pytest.raises(CoreError) as err:
            core.continue_trajectory(other, 1, [1])
        assert err.value.code == "not_found"  # the group is complete and forgotten
        await core.stop()

    run_virtual(main())


def test_a_trajectory_nobody_answers_ends_at_the_observation_deadline_and_waiting_ones_fill_the_queue():
    async def main():
        limits = CoreLimits(max_queued_samples=4, observation_timeout_s=30.0)
        core = RolloutCore(_engines(1), make_placement("least-assigned"), Clock(), limits)
        core.submit([_group("t", 3, [[15, 25]], max_turns=2)])
        await core.start()
        stream = core.delivery.stream("c").__aiter__()
        events = [(await stream.__anext__()) for _ in range(3)]
        assert all(e.sample.awaiting_observation for e in events) and core.trajectories.waiting == 3
        core.delivery.ack("c", events[-1].cursor)
        # 3 trajectories wait: 1 more sample fits under max_queued_samples=4, 2 do not.
        with pytest.raises(CoreError) as err:
            core.submit([GroupSpec("more", [5, 6], 2, SamplingParams(max_tokens=4))])
        assert err.value.code == "exhausted" and "3 trajectories waiting for an observation" in str(err.value)
        t0 = core.clock.now()
        core.continue_trajectory(events[0].sample.sample_id, 0, [3, 3])  # one is answered in time
        finished = []
        while len(finished) < 3:
            entry = await stream.__anext__()
            if not entry.sample.awaiting_observation:
                finished.append(entry.sample)
        waited = core.clock.now() - t0
        answered = [s for s in finished if s.sample_id == events[0].sample.sample_id]
        assert len(answered[0].response_token_ids) == 15 + 2 + 25 and not answered[0].drop_reason
        ended = [s for s in finished if s not in answered]
        assert 30.0 <= waited <= 31.5, waited
        assert all(s.finish_reason == FinishReason.ABORTED for s in ended)
        assert all(s.drop_reason.startswith("observation_timeout: no observation for turn 0 within "
                                            "observation_timeout_s=30 s") for s in ended)
        assert len(ended[0].response_token_ids) == 15  # the trajectory as it was
        assert core.counters["observation_timeouts"] == 2
        with pytest.raises(CoreError) as err:  # a late answer is refused, naming the trajectory
            core.continue_trajectory(ended[0].sample_id, 0, [3])
        assert err.value.code == "not_found"
        await core.stop()

    run_virtual(main())


def test_a_weight_push_between_turns_tags_each_turn_with_its_policy():
    async def main():
        core = RolloutCore(_engines(1), make_placement("least-assigned"), Clock(),
                           carry_over=CarryOverConfig(mode="continue"))
        core.submit([_group("w", 1, [[12, 9]], max_turns=2)])
        await core.start()
        stream = core.delivery.stream("c").__aiter__()
        event = (await stream.__anext__()).sample
        assert event.versions.max_version == 0
        await core.update_weights(1, StagedWeights({}))
        core.continue_trajectory(event.sample_id, 0, [4] * 5)
        final = (await stream.__anext__()).sample
        await core.stop()
        return final

    final = run_virtual(main())
    assert final.versions.per_token() == [0] * 12 + [NO_VERSION] * 5 + [1] * 9
    assert (final.versions.min_version, final.versions.max_version) == (0, 1)


def test_max_version_lag_restarts_a_waiting_trajectory_from_its_first_turn():
    async def main():
        core = RolloutCore(_engines(1), make_placement("least-assigned"), Clock(),
                           carry_over=CarryOverConfig(mode="continue", max_version_lag=0))
        core.submit([_group("r", 1, [[12, 9]], max_turns=2)])
        await core.start()
        stream = core.delivery.stream("c").__aiter__()
        event = (await stream.__anext__()).sample
        await core.update_weights(1, StagedWeights({}))
        # Its turn 0 is now too old: it starts over under version 1.
        with pytest.raises(CoreError):
            core.continue_trajectory(event.sample_id, 0, [4] * 5)
        again = (await stream.__anext__()).sample
        assert again.awaiting_observation and again.versions.per_token() == [1] * 12
        core.continue_trajectory(event.sample_id, 0, [4] * 5)
        final = (await stream.__anext__()).sample
        await core.stop()
        return final

    final = run_virtual(main())
    assert final.versions.per_token() == [1] * 12 + [NO_VERSION] * 5 + [1] * 9


def test_a_failing_environment_ends_its_trajectory_reported_and_others_continue():
    async def flaky(req: EnvRequest) -> EnvReply:
        if req.index == 0:
            raise RuntimeError("search backend down")
        return EnvReply(done=True)

    async def main():
        core = RolloutCore(_engines(1), make_placement("least-assigned"), Clock(), environments={"flaky": flaky})
        core.submit([_group("f", 2, [[10, 10]], env="flaky")])
        await core.start()
        got = await _samples(core, 2)
        await core.stop()
        return core, {s.index: s for s in got}

    core, got = run_virtual(main())
    assert got[0].finish_reason == FinishReason.ABORTED and "search backend down" in got[0].drop_reason
    assert len(got[0].response_token_ids) == 10  # what was generated is kept
    assert got[1].finish_reason == FinishReason.STOP and not got[1].drop_reason
    assert core.counters["environment_errors"] == 1


def test_an_unknown_environment_is_refused_at_submit():
    async def main():
        core = RolloutCore(_engines(1), make_placement("least-assigned"), Clock())
        with pytest.raises(CoreError) as err:
            core.submit([_group("u", 1, [[5]], env="nope")])
        assert "groups[0].multi_turn.environment" in str(err.value) and not core.groups

    run_virtual(main())


def test_waiting_trajectories_survive_a_restart_and_finish_after_it(tmp_path):
    # The virtual clock does not wait for the journal's writer thread: while a
    # commit is written it may run hours ahead, past the default hour's
    # observation deadline, which would end the waiting trajectory.
    limits = CoreLimits(observation_timeout_s=1e9)

    async def first():
        core = RolloutCore(_engines(1), make_placement("least-assigned"), Clock(), limits)
        core.open_state(str(tmp_path), 0.002, WIRE_SAMPLES)
        core.submit([_group("k", 1, [[8, 6]], max_turns=2)])
        await core.start()
        stream = core.delivery.stream("c").__aiter__()
        event = (await stream.__anext__()).sample
        core.delivery.ack("c", 1)
        await core.commit()
        await core.stop()  # no checkpoint: the journal holds the waiting trajectory
        return event

    async def second(sample_id):
        core = RolloutCore(_engines(1), make_placement("least-assigned"), Clock(), limits)
        assert core.open_state(str(tmp_path), 0.002, WIRE_SAMPLES)
        await core.start()
        assert core.continue_trajectory(sample_id, 0, [2] * 4)
        final = await _samples(core, 1)
        await core.stop()
        return final[0]

    event = run_virtual(first())
    final = run_virtual(second(event.sample_id))
    assert final.response_token_ids[:8] == event.response_token_ids
    assert [t.kind for t in final.turns] == ["generated", "observation", "generated"]
    assert final.loss_mask == [1] * 8 + [0] * 4 + [1] * 6


# -- configured environments, through the service --------------------------------

async def echo_tool(req: EnvRequest) -> EnvReply:
    """An entry-point environment for the tests: echoes the turn's length."""
    if req.turn >= 1:
        return EnvReply(done=True)
    return EnvReply(observation_token_ids=[len(req.turn_token_ids)] * 3)


async def test_a_configured_entry_point_and_an_http_environment_drive_trajectories():
    from aiohttp import web

    from helpers import running, sim_config

    seen = []

    async def step(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        if body["turn"] >= 1:
            return web.json_response({"done": True})
        return web.json_response({"observation_token_ids": [42] * 5})

    app = web.Application()
    app.router.add_post("/step", step)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    cfg = sim_config(num_engines=2)
    cfg.environments = {"echo": {"entry_point": "test_trajectories:echo_tool"},
                        "web": {"url": f"http://127.0.0.1:{port}/step", "timeout_s": 5}}
    try:
        async with running(cfg) as service:
            core = service.core
            core.submit([_group("e", 2, [[9, 4]], env="echo"), _group("h", 2, [[6, 3]], env="web")])
            got = {s.sample_id: s for s in await _samples(core, 4)}
    finally:
        await runner.cleanup()
    for sid in ("e/0", "e/1"):
        assert got[sid].response_token_ids[9:12] == [9, 9, 9] and got[sid].loss_mask == [1] * 9 + [0] * 3 + [1] * 4
    for sid in ("h/0", "h/1"):
        assert got[sid].response_token_ids[6:11] == [42] * 5 and len(got[sid].turns) == 3
    assert {b["finish_reason"] for b in seen} == {"stop"} and len(seen) == 4
    assert all(len(b["turn_token_ids"]) in (6, 3) for b in seen)


def test_environment_configuration_errors_name_the_key():
    from rollout_service.config import load_config
    from rollout_service.environments import Environments

    for overrides, needle in (
        (["environments.x.entry_point=nodots"], "environments.x.entry_point"),
        (["environments.x.url=ftp://h"], "environments.x.url"),
        (["environments.x.entry_point=a:b", "environments.x.url=http://h"], "exactly one"),
        (["environments.x.entry_point=a:b", "environments.x.retries=3"], "environments.x.retries"),
        (["environments.x.url=http://h", "environments.x.timeout_s=0"], "environments.x.timeout_s"),
    ):
        with pytest.raises(ValueError) as err:
            load_config(None, overrides)
        assert needle in str(err.value)
    with pytest.raises(ValueError) as err:
        Environments.build({"x": {"entry_point": "no_such_module_here:f"}})
    assert "environments.x.entry_point" in str(err.value)
    with pytest.raises(ValueError) as err:
        Environments.build({"x": {"entry_point": "json:dumps"}})
    assert "not an async function" in str(err.value)


@pytest.mark.parametrize("mode, salt", [("continue", 0), ("pause-resume", 1)])
def test_the_prefix_cache_partition_of_a_turn_after_a_push_follows_the_carry_over_mode(mode, salt):
    """`continue`: the next turn on its engine reuses the context KV the old
    weights computed (partition v0); `pause-resume`: recomputed under v1."""
    async def main():
        core = RolloutCore(_engines(1), make_placement("least-assigned"), Clock(), carry_over=CarryOverConfig(mode=mode))
        core.submit([_group("s", 1, [[12, 400]], max_turns=2)])
        await core.start()
        stream = core.delivery.stream("c").__aiter__()
        event = (await stream.__anext__()).sample
        req = core.groups["s"].requests[0]
        assert req.engine_request().cache_salt == "v0"
        await core.update_weights(1, StagedWeights({}))
        core.continue_trajectory(event.sample_id, 0, [4] * 5)
        await asyncio.sleep(0.05)  # its second turn is running
        assert req.engine_id is not None
        got = req.engine_request().cache_salt
        await core.stop()
        return got

    assert run_virtual(main()) == f"v{salt}"


@pytest.mark.parametrize("affinity", [True, False])
def test_a_session_key_sends_a_harness_s_next_call_to_its_engine(affinity):
    """A harness that drives its own turns (one single-turn call per turn,
    e.g. through the OpenAI-compatible side server) names its session
    (`metadata["session_id"]`): each call goes to the engine its last one
    ran on, even when least-assigned placement would pick the other engine
    (a long filler request runs on it). Without affinity the calls follow
    the placement and move."""
    async def main():
        core = RolloutCore(_engines(2), make_placement("least-assigned"), Clock(), affinity=affinity)
        await core.start()
        stream = core.delivery.stream("c")
        engines, fillers = [], []
        for turn in range(4):
            gid = f"call{turn}"
            core.submit([GroupSpec(gid, [5, 6, 7] * (turn + 1), 1, SamplingParams(max_tokens=50),
                                   metadata={"session_id": "harness-1", "sim.target_lengths": "5"})])
            entry = await stream.__anext__()
            assert entry.sample.group_id == gid
            engines.append(entry.sample.engines[0])
            # A long request (no key) now occupies the session's engine,
            # which makes it the busier one for the next call's placement.
            core.submit([GroupSpec(f"filler{turn}", [9, 9], 1, SamplingParams(max_tokens=100_000),
                                   metadata={"sim.target_lengths": "100000"})])
            await asyncio.sleep(0.05)
            fillers += [r.engine_id for r, _ in core.running.values() if r.group.group_id == f"filler{turn}"]
        moves = core.counters["session_moves"]
        await core.stop()
        return engines, fillers, moves

    engines, fillers, moves = run_virtual(main())
    if affinity:
        assert len(set(engines)) == 1 and moves == 0
    else:
        assert len(set(engines)) == 2  # least-assigned sends a call away from the filler's engine


def _waiting_turn(gid: str, context: int, engine_id: str) -> Request:
    spec = GroupSpec(gid, [5] * context, 1, SamplingParams(max_tokens=50), multi_turn=MultiTurnSpec(max_turns=4))
    req = Request(f"{gid}/0", Group(spec), 0)
    req.affinity = engine_id
    return req


def _load(engine_id: str, running: int, max_seqs: int = 2) -> EngineLoad:
    return EngineLoad(engine_id, "sim", "ready", running, 0, max_seqs, 0, 1 << 20, 0.0, 0)


@pytest.mark.parametrize("left,moves", [(3.0, False), (400.0, True)])
def test_a_turn_whose_engine_is_full_moves_only_when_the_wait_costs_more_than_the_re_prefill(left, moves):
    # e0 is full (2 of 2), e1 has a free slot. The trajectory's context of
    # 1000 tokens costs 0.02 * 1000 = 20 lone steps to prefill again on e1.
    cost = CostModel(per_sequence_cost=0.04, prefill_cost=0.02)
    wait = slot_waits(lambda: {"e0": [left, 500.0]}, {"e0": 2, "e1": 2}, cost)
    assert wait("e0", 0) == pytest.approx(left * (1 + 0.04 * 2)) and wait("e0", 2) == float("inf")
    queue = deque([_waiting_turn("g", 1000, "e0")])
    decisions = place_affine(queue, [_load("e0", 2), _load("e1", 1)], {"e0": 2, "e1": 1}, wait, cost)
    if moves:  # 400 tokens left on e0's soonest turn: 432 steps of waiting > 20 of re-prefill
        assert decisions == [] and len(queue) == 1  # left to placement, which has e1's free slot
    else:  # 3 tokens left: waiting ~3 steps beats re-prefilling 1000 tokens
        assert [(r.request_id, e) for r, e in decisions] == [("g/0", "e0")] and not queue
    # A second trajectory waiting for e0 gets the second slot to free (500 tokens away): it moves.
    queue = deque([_waiting_turn("g", 1000, "e0"), _waiting_turn("h", 1000, "e0")])
    decisions = place_affine(queue, [_load("e0", 2), _load("e1", 0)], {"e0": 2, "e1": 0}, wait, cost)
    assert [r.request_id for r in queue] == (["g/0", "h/0"] if moves else ["h/0"])
    # Without a wait estimate the old rule holds: a free slot elsewhere means a move.
    queue = deque([_waiting_turn("g", 1000, "e0")])
    assert place_affine(queue, [_load("e0", 2), _load("e1", 1)], {"e0": 2, "e1": 1}) == []
