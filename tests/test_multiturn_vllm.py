"""Multi-turn trajectories on real vLLM CPU engines (the bundled tiny
reasoner, float32, vLLM's prefix caching on): a small environment that
checks one step of the reasoning task per turn and answers with the right
step. The model's skill does not matter here, the mechanics do: turns,
loss masks and version tags (across a weight push between turns), answers
that are idempotent or refused with a clear status, session affinity
measured on vLLM's own prefix-cache counters, an engine killed in the
middle of a trajectory, and the official openai client holding a
multi-turn conversation with stop strings on the side server.

The session's fleet of 2 engines (`vllm_service`, whose `check`
environment is `helpers.check_step`) serves the module."""
from __future__ import annotations

import asyncio
import os
import random
import signal
import statistics
import time

import grpc
import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from rollout_service.tasks import tokenizer as tok  # noqa: E402
from rollout_service.tasks.generator import iter_problems, reference_solution  # noqa: E402
from trainer_client import MultiTurn, PromptGroup  # noqa: E402

from helpers import TOOL_LATENCY_S, bundled_weights, connect, perturbed, unique, wait_until  # noqa: E402

NEWLINE = tok.VOCAB["\n"]


@pytest.fixture
async def vc(vllm_service):
    async with connect(vllm_service, "mtv") as c:
        yield c


def _problems(n: int, seed: int):
    return [p for p, _ in zip(iter_problems(seed=seed), range(n))]


def _trainer_group(problem, samples: int, max_turns: int = 3, **kw) -> PromptGroup:
    return PromptGroup(prompt_token_ids=tok.prompt_token_ids(problem), num_samples=samples, max_tokens=24,
                       temperature=1.0, stop_token_ids=[NEWLINE], group_id=unique("mtv"),
                       multi_turn=MultiTurn(max_turns=max_turns), **kw)


async def _events(stream, group_ids: set[str], n: int, timeout: float = 180.0) -> list:
    """The next `n` stream events (turn events or samples) of these groups."""
    out = []

    async def take():
        async for s in stream:
            if s.group_id in group_ids:
                out.append(s)
                if len(out) == n:
                    return

    await asyncio.wait_for(take(), timeout)
    return out


def _mask_ok(s) -> None:
    """The loss mask is 1 on generated and 0 on observation tokens; version
    segments cover exactly the generated tokens; observations have no version."""
    mask = [0] * len(s.response_token_ids)
    for t in s.turns:
        if t.kind == "generated":
            mask[t.start:t.start + t.length] = [1] * t.length
    assert s.loss_mask() == mask
    assert [m == 1 for m in mask] == [v != -1 for v in s.token_versions()]
    assert sum(n for _, _, n in s.versions) == sum(mask)
    assert all(s.logprobs[i] == 0.0 for i, m in enumerate(mask) if m == 0)


async def test_turns_masks_and_version_tags_across_a_weight_push(vc):
    v0 = (await vc.status()).policy_version
    problem = _problems(1, seed=1)[0]
    g = _trainer_group(problem, samples=2, max_turns=3)
    await vc.submit([g])
    stream = vc.stream(ack_every=1)
    first = await _events(stream, {g.group_id}, 2)
    assert all(e.awaiting_observation and e.turn_index == 0 for e in first)
    assert all(e.versions and {v for v, _, _ in e.versions} == {v0} for e in first)
    # New weights between turns: the next turns are sampled (and their
    # context prefilled) by them; what was generated keeps its version.
    await vc.push_weights(perturbed(bundled_weights()), version=v0 + 1)
    obs = {e.sample_id: tok.encode(f"> {reference_solution(problem).splitlines()[0]}\n") for e in first}
    for e in first:
        assert await vc.continue_trajectory(e.sample_id, 0, observation_token_ids=obs[e.sample_id]) is True
    second = await _events(stream, {g.group_id}, 2)
    assert all(e.awaiting_observation and e.turn_index == 1 for e in second)
    for e in second:
        assert await vc.continue_trajectory(e.sample_id, 1, observation_text="> next\n") is True
    final = {s.sample_id: s for s in await _events(stream, {g.group_id}, 2)}
    await stream.aclose()
    before = {e.sample_id: e for e in first}
    for sid, s in final.items():
        assert not s.awaiting_observation and s.finish_reason in ("stop", "length")
        assert [t.kind for t in s.turns] == ["generated", "observation"] * 2 + ["generated"]
        _mask_ok(s)
        gen = [t for t in s.turns if t.kind == "generated"]
        observations = [s.response_token_ids[t.start:t.start + t.length] for t in s.turns if t.kind == "observation"]
        assert observations == [obs[sid], tok.encode("> next\n")]
        # Nothing of turn 0 changed; it is tagged v0, the later turns v0 + 1.
        n0 = gen[0].length
        assert s.response_token_ids[:n0] == before[sid].response_token_ids
        per_token = s.token_versions()
        assert set(per_token[:n0]) == {v0}
        assert {per_token[i] for t in gen[1:] for i in range(t.start, t.start + t.length)} == {v0 + 1}
        assert s.min_version == v0 and s.max_version == v0 + 1
        # A turn ends at its stop token (the newline) or its budget.
        for t in gen:
            ends_at_stop = s.response_token_ids[t.start + t.length - 1] in (NEWLINE, tok.EOS_ID)
            assert ends_at_stop or t.length == 24
    await vc.push_weights(bundled_weights(), version=v0 + 2)


async def test_answers_are_idempotent_and_bad_ones_get_a_clear_status(vllm_service, vc):
    problem = _problems(1, seed=2)[0]
    g = _trainer_group(problem, samples=1, max_turns=3)
    other = PromptGroup(prompt_token_ids=tok.prompt_token_ids(_problems(1, seed=3)[0]), num_samples=2,
                        max_tokens=32, temperature=1.0, group_id=unique("single"))
    await vc.submit([g])
    async with connect(vllm_service, "other") as oc:
        await oc.submit([other])
        others = asyncio.create_task(_first_group(oc, other.group_id))
        await _answer_checks(vc, g, others)


async def _first_group(client, group_id: str) -> list:
    async for group in client.groups():
        if group[0].group_id == group_id:
            return group


async def _answer_checks(vc, g, others) -> None:
    stream = vc.stream(ack_every=1)
    (event,) = await _events(stream, {g.group_id}, 1)
    sid = event.sample_id
    room = 1024 - len(event.prompt_token_ids) - len(event.response_token_ids)

    async def refused(**kw) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await vc.continue_trajectory(**kw)
        return err.value.code(), err.value.details()

    code, details = await refused(sample_id=sid, turn=0, observation_token_ids=[tok.VOCAB["x"]] * room)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("observation_token_ids")
    assert "context of 1024" in details
    code, details = await refused(sample_id=unique("gone") + "/0", turn=0, observation_token_ids=[5])
    assert code == grpc.StatusCode.NOT_FOUND and details.startswith("sample_id")
    code, details = await refused(sample_id=sid, turn=1, observation_token_ids=[5])
    assert code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith("turn")
    assert await vc.continue_trajectory(sid, 0, observation_text="ok\n") is True
    assert await vc.continue_trajectory(sid, 0, observation_text="ok\n") is False  # a retry: applied once
    (second,) = await _events(stream, {g.group_id}, 1)
    assert second.awaiting_observation and second.turn_index == 1
    obs = [second.response_token_ids[t.start:t.start + t.length] for t in second.turns if t.kind == "observation"]
    assert obs == [tok.encode("ok\n")]  # once, not twice
    assert await vc.continue_trajectory(sid, 1, done=True) is True
    (final,) = await _events(stream, {g.group_id}, 1)
    await stream.aclose()
    assert final.group_complete and [t.kind for t in final.turns] == ["generated", "observation", "generated"]
    _mask_ok(final)
    code, details = await refused(sample_id=sid, turn=2, observation_token_ids=[5])
    assert code == grpc.StatusCode.NOT_FOUND and "finished" in details
    # The other group ran untouched, single-turn as ever.
    singles = await asyncio.wait_for(others, 180)
    assert len(singles) == 2 and all(not s.turns and s.loss_mask() == [1] * len(s.response_token_ids)
                                     for s in singles)
    assert all(e.state == "ready" for e in (await vc.status()).engines)


async def _stats_settled(core) -> None:
    """Until every engine's stat logger has reported a step with nothing
    running or waiting: the prefix-cache counters hold every step that ran."""
    await wait_until(lambda: all(e.load().running == 0 and e.load().waiting == 0 for e in core.engines.values()),
                     30, "the engines' statistics of an idle step")


async def _run_environment_trajectories(vllm_service, vc, n: int, seed: int) -> dict:
    """n environment-driven trajectories on distinct long prompts; what the
    engines' prefix caches and the turns measured."""
    core = vllm_service.core
    await _stats_settled(core)  # the engines' stat loggers have reported what ran before
    before = core.status()
    q0, h0 = before.prefix_cache_queried_tokens, before.prefix_cache_hit_tokens
    moves0 = before.counters.get("trajectory_moves", 0)
    groups = []
    for i, problem in enumerate(_problems(n, seed=seed)):
        rng = random.Random(seed * 1000 + i)
        # A long, distinct context per trajectory (its prefix is only cached where it ran).
        notes = " ".join(str(rng.randrange(10**6)) for _ in range(60))
        prompt = tok.prompt_token_ids(f"{notes}\n{problem.prompt}")
        groups.append(PromptGroup(prompt_token_ids=prompt, num_samples=1, max_tokens=16, temperature=1.0,
                                  stop_token_ids=[NEWLINE], group_id=unique("aff"),
                                  metadata={"reference": "\n".join(["x"] * 6)},
                                  multi_turn=MultiTurn(max_turns=5, environment="check")))
    t0 = time.perf_counter()
    await vc.submit(groups)
    samples = []
    async for group in vc.trajectory_groups():
        if group[0].group_id in {g.group_id for g in groups}:
            samples += group
            if len(samples) == n:
                break
    wall = time.perf_counter() - t0
    await _stats_settled(core)
    after = core.status()
    queried, hits = after.prefix_cache_queried_tokens - q0, after.prefix_cache_hit_tokens - h0
    later_turns = [t.finished_at - t.started_at for s in samples for t in s.turns[1:] if t.kind == "generated"]
    return {"samples": samples, "hit_rate": hits / max(1, queried), "queried": queried, "hits": hits,
            "turn_s": statistics.median(later_turns), "turns": len(later_turns), "wall_s": wall,
            "moves": after.counters.get("trajectory_moves", 0) - moves0}


async def test_affinity_raises_prefix_cache_hits_and_lowers_time_per_turn(vllm_service, vc):
    core = vllm_service.core
    assert core.affinity is True  # `session_affinity` defaults to on
    await _run_environment_trajectories(vllm_service, vc, n=2, seed=10)  # warm-up: first requests compile, not measured
    try:
        with_affinity = await _run_environment_trajectories(vllm_service, vc, n=8, seed=11)
        core.affinity = False  # least-assigned placement for every turn
        without = await _run_environment_trajectories(vllm_service, vc, n=8, seed=12)
    finally:
        core.affinity = True
    for s in with_affinity["samples"] + without["samples"]:
        # The environment answered each turn: 5 turns, 4 observations "no> x\n" or "ok> x\n".
        kinds = [t.kind for t in s.turns]
        assert kinds == ["generated", "observation"] * 4 + ["generated"], kinds
        _mask_ok(s)
        for t in s.turns:
            if t.kind == "observation":
                assert tok.decode(s.response_token_ids[t.start:t.start + t.length]) in ("ok> x\n", "no> x\n")
                assert t.tool_seconds >= TOOL_LATENCY_S
    for name, r in (("affinity", with_affinity), ("least-assigned", without)):
        print(f"\n{name}: prefix-cache hit rate {r['hit_rate']:.3f} ({r['hits']}/{r['queried']} tokens), "
              f"median time per later turn {1000 * r['turn_s']:.1f} ms over {r['turns']} turns, "
              f"{r['moves']} moves, wall {r['wall_s']:.1f} s")
    assert with_affinity["queried"] > 0 and without["queried"] > 0  # vLLM's counters are read
    assert with_affinity["moves"] == 0 < without["moves"]
    assert with_affinity["hit_rate"] > without["hit_rate"]


async def test_openai_client_drives_a_multi_turn_conversation_with_stop_strings(vllm_service):
    openai = pytest.importorskip("openai")
    oai = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{vllm_service.http_port}/v1", api_key="unused")
    model = vllm_service.model_name
    problem = _problems(1, seed=4)[0]
    conversation = problem.prompt
    replies = []
    for turn in range(3):
        out = await oai.completions.create(model=model, prompt=conversation, max_tokens=40, temperature=1.0,
                                           stop=["\n", " c"], user="conversation-1")
        choice = out.choices[0]
        assert "\n" not in choice.text and " c" not in choice.text
        assert choice.finish_reason in ("stop", "length")
        assert out.model_extra["policy_version"] >= 0
        replies.append(choice.text)
        conversation += choice.text + f"\n> step {turn} noted\n"  # the tool's answer, then the next turn
    assert conversation.count("noted") == 3 and len(replies) == 3
    await oai.close()


async def _both_engines_up(core, timeout: float = 180.0) -> None:
    deadline = time.time() + timeout
    while len(core.fleet.live()) < len(core.engines):
        assert time.time() < deadline, "a killed engine did not come back"
        await asyncio.sleep(0.2)


async def _kill_mid_turn(core, vc, stream, seed: int):
    """One try: a group's second turns start; the engine running one of them
    (more than 5 tokens in) is killed. Returns the first turn events, the
    final samples, the victim and the partial response of each second turn
    it was running when killed (victim None and no partials when every
    second turn ended before one was caught: a hot sample may stop early)."""
    problem = _problems(1, seed=seed)[0]
    # Hot sampling (vLLM allows up to 2.0): turns run long, so one is caught mid-way.
    g = PromptGroup(prompt_token_ids=tok.prompt_token_ids(problem), num_samples=4, max_tokens=200, temperature=2.0,
                    group_id=unique("kill"), multi_turn=MultiTurn(max_turns=2))
    await vc.submit([g])
    first = {e.sample_id: e for e in await _events(stream, {g.group_id}, 4)}
    for sid in first:
        assert await vc.continue_trajectory(sid, 0, observation_text="> go on\n") is True
    finals = asyncio.ensure_future(_events(stream, {g.group_id}, 4, timeout=240))
    victim_id = None
    while victim_id is None and not finals.done():
        for r, _ in list(core.running.values()):
            if r.group.group_id == g.group_id and r.turn_index == 1 and len(r.token_ids) - r.turn_start > 5:
                victim_id = r.engine_id
                break
        else:
            await asyncio.sleep(0.01)
    partials = {}
    if victim_id is not None:
        partials = {r.request_id: list(r.token_ids) for r, _ in list(core.running.values())
                    if r.group.group_id == g.group_id and r.engine_id == victim_id and r.turn_index == 1}
        os.kill(core.engines[victim_id].engine_core_pid, signal.SIGKILL)
    final = {s.sample_id: s for s in await finals}
    return first, final, victim_id, partials


async def test_an_engine_killed_in_the_middle_of_a_turn_loses_nothing(vllm_service, vc):
    """Killed while it generates a trajectory's second turn: the turn goes on
    elsewhere from the whole context (prompt, first turn, observation and
    the part of the turn generated so far). The kill may land after the
    engine already sent a turn's last token (the tiny model is fast): such a
    turn finishes on the victim, and the try is repeated (at most 3); so is
    a try whose second turns all ended before one was seen running."""
    core = vllm_service.core
    stream = vc.stream(ack_every=1)
    moved = []
    for attempt in range(3):
        await _both_engines_up(core)
        first, final, victim_id, partials = await _kill_mid_turn(core, vc, stream, seed=5 + attempt)
        for e in first.values():
            s = final[e.sample_id]
            assert s.finish_reason in ("stop", "length") and not s.drop_reason
            n0 = len(e.response_token_ids)
            assert s.response_token_ids[:n0] == e.response_token_ids
            assert s.response_token_ids[n0:n0 + 8] == tok.encode("> go on\n")
            assert [t.kind for t in s.turns] == ["generated", "observation", "generated"]
            _mask_ok(s)
        moved = [sid for sid in partials if final[sid].engines[-1] != victim_id]
        if moved:
            break
    await stream.aclose()
    assert moved, "in 3 tries the kill never landed before a turn's last token"
    for sid in moved:
        s = final[sid]
        assert s.response_token_ids[:len(partials[sid])] == partials[sid]  # nothing generated before the kill is lost
        assert victim_id in s.engines  # it ran there, and finished on the engine still up


async def test_a_stop_string_over_grpc_ends_each_turn(vc):
    """`stop` strings (a tool-call delimiter) end a turn on vLLM: every
    generated turn's text holds the delimiter only at its end."""
    problem = _problems(1, seed=5)[0]
    g = PromptGroup(prompt_token_ids=tok.prompt_token_ids(problem), num_samples=2, max_tokens=48, temperature=1.0,
                    stop=["\n"], group_id=unique("mtv-stop"), multi_turn=MultiTurn(max_turns=2))
    await vc.submit([g])
    stream = vc.stream(ack_every=1)
    first = await _events(stream, {g.group_id}, 2)
    for e in first:
        await vc.continue_trajectory(e.sample_id, 0, observation_text="ok\n")
    final = await _events(stream, {g.group_id}, 2)
    await stream.aclose()
    stopped = 0
    for s in final:
        assert not s.awaiting_observation
        for t in (t for t in s.turns if t.kind == "generated"):
            text = tok.decode(s.response_token_ids[t.start:t.start + t.length])
            assert "\n" not in text.rstrip("\n") or t.length == 48
            stopped += text.endswith("\n")
    assert stopped >= 2  # the tiny reasoner writes one line per step
