"""Multi-turn trajectories over rollout.v1, on simulated engines: a real
server on loopback, the real client. Trainer-driven turns answered through
Continue, loss masks and version segments on the wire (observations carry
no version), idempotent answers, clear statuses for bad answers, and
single-turn groups exactly as before."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from rollout_proto import rollout_pb2 as pb
from rollout_service.tasks import tokenizer as char_tok
from trainer_client import MultiTurn, PromptGroup, RolloutClient

from helpers import connect, running, sim_config, unique

PROMPT = [1, 10, 11, 12, 13]
OBS = 4


@pytest.fixture(scope="module")
async def service():
    async with running(sim_config(num_engines=2)) as s:
        yield s


def _group(samples: int, turn_lengths: str, max_turns: int = 3, max_total: int = 0, **kw) -> PromptGroup:
    return PromptGroup(prompt_token_ids=PROMPT, num_samples=samples, max_tokens=64, group_id=unique("mt"),
                       metadata={"sim.turn_lengths": turn_lengths},
                       multi_turn=MultiTurn(max_turns=max_turns, max_total_tokens=max_total), **kw)


async def _next_event(stream, group_id: str):
    async for s in stream:
        if s.group_id == group_id:
            return s


def _check_trajectory(s, generated: list[int], observations: list[list[int]]) -> None:
    """Turns alternate, the mask is 1 on generated / 0 on observation tokens,
    version segments cover exactly the generated tokens."""
    kinds = [t.kind for t in s.turns]
    assert kinds == ["generated", "observation"] * len(observations) + ["generated"]
    assert [t.length for t in s.turns if t.kind == "generated"] == generated
    assert len(s.response_token_ids) == sum(generated) + sum(map(len, observations))
    expected_mask: list[int] = []
    for i, n in enumerate(generated):
        expected_mask += [1] * n
        if i < len(observations):
            expected_mask += [0] * len(observations[i])
    assert s.response_mask == expected_mask and s.loss_mask() == expected_mask
    got_obs = [s.response_token_ids[t.start:t.start + t.length] for t in s.turns if t.kind == "observation"]
    assert got_obs == observations
    covered = [0] * len(s.response_token_ids)
    for _, start, length in s.versions:
        for i in range(start, start + length):
            covered[i] += 1
    assert covered == expected_mask  # no segment over an observation, none twice
    per_token = s.token_versions()
    assert all((v == -1) == (m == 0) for v, m in zip(per_token, expected_mask))
    assert all(s.logprobs[i] == 0.0 for i, m in enumerate(expected_mask) if m == 0)
    assert s.min_version >= 0
    for t in s.turns:
        assert t.finished_at >= t.started_at > 0
        if t.kind == "generated":
            assert t.engine_id.startswith("sim-") and t.finish_reason in ("stop", "length")
        else:
            assert t.tool_seconds >= 0


async def test_trainer_driven_turns_through_the_group_iterator(service):
    seen: list[tuple[str, int, int]] = []

    async def respond(event):
        assert event.awaiting_observation and not event.group_complete
        seen.append((event.sample_id, event.turn_index, len(event.response_token_ids)))
        await asyncio.sleep(0.01)  # a tool call
        return [20 + event.turn_index] * OBS

    async with connect(service, "mt") as c:
        g = _group(3, "5,6,7;8,9,10;4,4,4")
        await c.submit([g])
        async for group in c.trajectory_groups(respond=respond):
            if group[0].group_id == g.group_id:
                break
    assert [s.index for s in group] == [0, 1, 2] and all(not s.awaiting_observation for s in group)
    for s, lengths in zip(group, ([5, 6, 7], [8, 9, 10], [4, 4, 4])):
        _check_trajectory(s, lengths, [[20] * OBS, [21] * OBS])
        assert s.finish_reason in ("stop", "length")
    # Two turn events per trajectory (max_turns 3: the third turn ends it).
    assert sorted((sid.rsplit("/", 1)[1], turn) for sid, turn, _ in seen) == \
        [(str(i), t) for i in range(3) for t in (0, 1)]
    counters = (await c_status(service)).counters
    assert counters["turn_events"] >= 6 and counters["observations_appended"] >= 6


async def c_status(service):
    async with connect(service, "st") as c:
        return await c.status()


async def test_observation_text_is_tokenized_by_the_server_and_done_ends_early(service):
    async def respond(event):
        return "ok: 3" if event.turn_index == 0 else None  # done after the second turn

    async with connect(service, "mt") as c:
        g = _group(1, "6,6,6", max_turns=4)
        await c.submit([g])
        async for group in c.trajectory_groups(respond=respond):
            if group[0].group_id == g.group_id:
                break
    (s,) = group
    _check_trajectory(s, [6, 6], [char_tok.encode("ok: 3")])


async def test_bad_answers_get_a_clear_status_and_change_nothing(service):
    async with connect(service, "mt") as c, connect(service, "other") as other:
        g = _group(1, "5,5,5", max_turns=3, max_total=40)
        single = PromptGroup(prompt_token_ids=PROMPT, num_samples=2, max_tokens=16, group_id=unique("single"),
                             metadata={"sim.target_lengths": "9,11"})
        await c.submit([g])
        stream = c.stream(ack_every=1)
        event = await _next_event(stream, g.group_id)
        assert event.awaiting_observation and event.turn_index == 0 and len(event.response_token_ids) == 5
        sid = event.sample_id

        async def status_of(**kw) -> tuple[grpc.StatusCode, str]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.continue_trajectory(**kw)
            return err.value.code(), err.value.details()

        code, details = await status_of(sample_id=sid, turn=1, observation_token_ids=[20])
        assert code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith("turn")
        code, details = await status_of(sample_id=sid, turn=0, observation_token_ids=[20] * 40)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("observation_token_ids")
        assert "max_total_tokens 40" in details
        code, details = await status_of(sample_id=sid, turn=0, observation_token_ids=[20, 100])
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("observation_token_ids[1]")
        code, details = await status_of(sample_id=sid, turn=0, observation_token_ids=[20], observation_text="x")
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("observation_text")
        code, details = await status_of(sample_id=sid, turn=0, observation_token_ids=[20], done=True)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("observation_token_ids")
        code, details = await status_of(sample_id=unique("nope") + "/0", turn=0)
        assert code == grpc.StatusCode.NOT_FOUND and details.startswith("sample_id")
        code, details = await status_of(sample_id="", turn=0)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("sample_id")

        # A single-turn group submitted meanwhile runs as before.
        await other.submit([single])
        async for done in other.groups():
            if done[0].group_id == single.group_id:
                break
        assert [len(s.response_token_ids) for s in done] == [9, 11]
        assert all(s.turns == [] and s.loss_mask() == [1] * len(s.response_token_ids) for s in done)
        assert all(s.versions == [(0, 0, len(s.response_token_ids))] for s in done)
        code, details = await status_of(sample_id=done[0].sample_id, turn=0)
        assert code == grpc.StatusCode.NOT_FOUND  # finished (and not a trajectory)

        # The right answer applies once; its repeat is acknowledged, not applied again.
        assert await c.continue_trajectory(sid, 0, observation_token_ids=[20] * OBS) is True
        assert await c.continue_trajectory(sid, 0, observation_token_ids=[20] * OBS) is False
        event = await _next_event(stream, g.group_id)
        assert event.awaiting_observation and event.turn_index == 1
        assert len(event.response_token_ids) == 5 + OBS + 5
        assert await c.continue_trajectory(sid, 1, done=True) is True
        final = await _next_event(stream, g.group_id)
        assert not final.awaiting_observation and final.group_complete
        _check_trajectory(final, [5, 5], [[20] * OBS])
        await stream.aclose()
        code, details = await status_of(sample_id=sid, turn=2, observation_token_ids=[20])
        assert code == grpc.StatusCode.NOT_FOUND and "finished" in details
        st = await c.status()
        assert st.open_groups == 0 or all(e.state == "ready" for e in st.engines)


async def test_multi_turn_settings_are_validated_naming_the_field(service):
    async with connect(service, "mt") as c:
        for mt, field in ((MultiTurn(max_turns=0), "groups[0].multi_turn.max_turns"),
                          (MultiTurn(max_turns=2000), "groups[0].multi_turn.max_turns"),
                          (MultiTurn(max_turns=2, environment="no-such-env"), "groups[0].multi_turn.environment")):
            g = PromptGroup(prompt_token_ids=PROMPT, num_samples=1, max_tokens=8, multi_turn=mt)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.submit([g])
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith(field), err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:  # the per-turn budget is checked as any max_tokens
            await c.submit([PromptGroup(prompt_token_ids=PROMPT, num_samples=1, max_tokens=5000,
                                        multi_turn=MultiTurn(max_turns=2))])
        assert err.value.details().startswith("groups[0].sampling.max_tokens")
        assert (await c.status()).engines  # still serving


async def test_the_wire_omits_observation_versions_and_single_turn_fields_stay_empty(service):
    """Read with the generated stub: what any rollout.v1 client sees."""
    async with connect(service, "raw") as c:
        gid = unique("raw")
        g = pb.PromptGroup(group_id=gid, prompt_token_ids=PROMPT, num_samples=1,
                           sampling=pb.SamplingParams(max_tokens=32), metadata={"sim.turn_lengths": "3,4"},
                           multi_turn=pb.MultiTurn(max_turns=2))
        old = pb.PromptGroup(group_id=unique("raw"), prompt_token_ids=PROMPT, num_samples=1,
                             sampling=pb.SamplingParams(max_tokens=32), metadata={"sim.target_lengths": "7"})
        await c._stub.Submit(pb.SubmitRequest(groups=[g, old]))
        call = c._stub.StreamSamples(pb.StreamSamplesRequest(consumer_id=c.consumer_id))
        events = []
        async for ev in call:
            if ev.sample.group_id not in (gid, old.group_id):
                continue  # retained from other tests
            events.append(ev)
            if ev.awaiting_observation:
                assert not ev.group_complete
                await c._stub.Continue(pb.ContinueRequest(sample_id=ev.sample.sample_id, turn=0,
                                                          observation_token_ids=[30, 31]))
            if sum(e.group_complete for e in events) == 2:
                break
        call.cancel()
    final = next(e.sample for e in events if e.sample.group_id == gid and not e.awaiting_observation)
    assert list(final.loss_mask) == [1] * 3 + [0] * 2 + [1] * 4
    assert [(v.start, v.length) for v in final.versions] == [(0, 3), (5, 4)]
    assert [t.kind for t in final.turns] == [pb.Turn.KIND_GENERATED, pb.Turn.KIND_OBSERVATION, pb.Turn.KIND_GENERATED]
    assert final.min_version == final.max_version == 0
    single = next(e.sample for e in events if e.sample.group_id == old.group_id)
    assert not single.turns and not single.loss_mask and len(single.response_token_ids) == 7
    assert [(v.start, v.length) for v in single.versions] == [(0, 7)]


async def test_the_blocking_client_runs_trajectories_with_a_plain_respond(service):
    from trainer_client import SyncRolloutClient

    def run() -> list:
        with SyncRolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id=unique("sync")) as c:
            g = _group(2, "3,4", max_turns=2)
            c.submit([g])
            for group in c.trajectory_groups(respond=lambda event: [40] * OBS):
                if group[0].group_id == g.group_id:
                    return group

    group = await asyncio.to_thread(run)
    for s in group:
        _check_trajectory(s, [3, 4], [[40] * OBS])


async def test_an_observation_too_long_ends_its_trajectory_and_respond_errors_are_raised(service):
    async def too_long(event):
        return [20] * 100  # more than max_total_tokens leaves

    async with connect(service, "mt") as c:
        g = _group(2, "5,5,5", max_turns=3, max_total=40)
        await c.submit([g])
        async for group in c.trajectory_groups(respond=too_long):
            if group[0].group_id == g.group_id:
                break
        for s in group:  # ended after its first turn, as an environment's would be
            assert [t.kind for t in s.turns] == ["generated"] and len(s.response_token_ids) == 5

        class ToolDown(Exception):
            pass

        async def broken(event):
            raise ToolDown("search backend unreachable")

        g = _group(1, "5,5,5", max_turns=3)
        await c.submit([g])
        with pytest.raises(ToolDown):
            async for group in c.trajectory_groups(respond=broken):
                pass
    # The trajectory still waits for its answer, and the turn event was not
    # acknowledged: the trainer, back with the same consumer id, gets it again.
    async with RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id=c.consumer_id) as again:
        async for group in again.trajectory_groups(respond=lambda event: [21] * OBS):
            if group[0].group_id == g.group_id:
                break
    _check_trajectory(group[0], [5, 5, 5], [[21] * OBS, [21] * OBS])
