"""vLLM's RL routes for the whole fleet (api/vllm_compat.py, api/vllm_control.py,
core/pause.py) on simulated engines slow enough to pause mid-response.
TRL's and vLLM's own clients drive them on vLLM engines in
test_vllm_routes_engines.py (importing them imports vLLM)."""
from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest

from helpers import connect, running, sim_config, wait_until
from trainer_client import PromptGroup
from trainer_client.collective import HttpControl

SLOW_SIM = {"decode_base_s": 0.01, "decode_per_seq_s": 0.0, "length_median": 24, "length_sigma": 0.6,
            "prefix_cache": True}
PROMPT = [1, 10, 11, 12]


@pytest.fixture(scope="module")
async def fleet():
    """2 simulated engines at ~100 tokens/s per sequence, prefix caching on."""
    async with running(sim_config(num_engines=2, sim=dict(SLOW_SIM))) as service:
        yield service


@pytest.fixture(autouse=True)
async def _resumed(fleet):
    """Every test starts and ends on a fleet that places requests."""
    fleet.core.pausing.resume()
    yield
    fleet.core.pausing.resume()


async def _call(port: int, method: str, path: str, body=None, headers=None) -> tuple[int, dict]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.request(method, f"http://127.0.0.1:{port}{path}", json=body, headers=headers) as r:
            return r.status, await r.json()


class Stream:
    """A streaming /inference/v1/generate call read in the background."""

    def __init__(self, port: int, body: dict, headers: dict | None = None) -> None:
        self.chunks: list[dict] = []
        self.task = asyncio.ensure_future(self._read(port, {**body, "stream": True}, headers))

    async def _read(self, port, body, headers) -> None:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{port}/inference/v1/generate", json=body,
                                    headers=headers) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                        self.chunks.append(json.loads(line[6:]))

    @property
    def tokens(self) -> list[int]:
        return [t for c in self.chunks for ch in c["choices"] for t in ch["token_ids"] or []]

    def finals(self) -> list[dict]:
        return [ch for c in self.chunks for ch in c["choices"] if ch["finish_reason"] is not None]

    async def done(self, timeout: float = 30.0) -> None:
        await asyncio.wait_for(self.task, timeout)


def _long(max_tokens: int, **extra) -> dict:
    return {"token_ids": PROMPT, "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True, **extra}}


async def test_server_info_describes_the_fleet_as_one_data_parallel_deployment(fleet):
    port = fleet.http_port
    status, info = await _call(port, "GET", "/server_info?config_format=json")
    assert status == 200
    assert info["vllm_config"]["model_config"]["dtype"] == "torch.float32"  # what a push to simulated engines carries
    parallel = info["vllm_config"]["parallel_config"]
    assert parallel["data_parallel_size"] == 2 and parallel["world_size"] == 1
    assert parallel["world_size_across_dp"] == 2
    assert await _call(port, "GET", "/get_world_size") == (200, {"world_size": 2})  # one worker per engine, all
    assert await _call(port, "GET", "/get_world_size?include_dp=false") == (200, {"world_size": 1})
    status, version = await _call(port, "GET", "/version")
    assert status == 200 and isinstance(version["version"], str)


async def test_pause_keep_holds_a_stream_and_resumes_it_under_the_pushed_version(fleet):
    """pause (mode=keep), a push, resume: the response goes on from where
    it was held, and its spans name both versions, split exactly where the
    push landed."""
    port, before = fleet.http_port, fleet.core.policy_version
    stream = Stream(port, _long(150, logprobs=0))
    await wait_until(lambda: len(stream.tokens) >= 10, 30, "the first tokens")
    assert await _call(port, "POST", "/pause?mode=keep") == (200, {"status": "paused"})
    assert await _call(port, "GET", "/is_paused") == (200, {"is_paused": True})
    await asyncio.sleep(0.2)  # tokens generated before the pause reach the stream
    held = len(stream.tokens)
    await asyncio.sleep(0.5)
    assert len(stream.tokens) == held and 10 <= held < 150  # held: nothing generated while paused
    async with connect(fleet, "push") as c:
        await c.push_weights({"w": np.zeros(4, np.float32)}, version=before + 1)
    assert await _call(port, "POST", "/resume") == (200, {"status": "resumed"})
    assert await _call(port, "GET", "/is_paused") == (200, {"is_paused": False})
    await stream.done()
    (final,) = stream.finals()
    assert len(stream.tokens) == 150 and final["finish_reason"] == "length"
    assert final["weight_versions"] == [{"version": str(before), "start": 0, "end": held},
                                        {"version": str(before + 1), "start": held, "end": 150}]
    logprob_ids = [e["token_id"] for c in stream.chunks for ch in c["choices"] if ch["logprobs"]
                   for e in ch["logprobs"]["content"]]
    assert logprob_ids == stream.tokens


async def test_requests_sent_while_paused_wait_for_resume(fleet):
    port = fleet.http_port
    assert await _call(port, "POST", "/pause?mode=keep") == (200, {"status": "paused"})
    stream = Stream(port, _long(5))
    await asyncio.sleep(0.5)
    assert stream.tokens == [] and not stream.task.done()
    assert await _call(port, "POST", "/resume") == (200, {"status": "resumed"})
    await stream.done()
    assert len(stream.tokens) == 5


async def test_a_pause_shows_in_get_status_and_a_restarted_service_is_still_paused_until_resume(tmp_path):
    cfg = sim_config(num_engines=2, sim=dict(SLOW_SIM))
    cfg.state_dir = str(tmp_path)
    async with running(cfg) as first:
        async with connect(first, "trainer") as client:
            assert (await client.status()).paused == ""
            assert await _call(first.http_port, "POST", "/pause?mode=keep") == (200, {"status": "paused"})
            assert (await client.status()).paused == "keep"
            await client.submit([PromptGroup(prompt_token_ids=PROMPT, num_samples=2, max_tokens=5, group_id="held")])
    async with running(cfg) as second:  # the first checkpointed the group and the pause
        async with connect(second, "trainer") as client:
            assert (await client.status()).paused == "keep"
            assert await _call(second.http_port, "GET", "/is_paused") == (200, {"is_paused": True})
            await asyncio.sleep(0.5)
            st = await client.status()
            assert st.queued_requests == 2 and st.running_requests == 0  # nothing placed while paused
            assert await _call(second.http_port, "POST", "/resume") == (200, {"status": "resumed"})
            got = []
            async with asyncio.timeout(30):
                async for s in client.stream():
                    got.append(s)
                    if len(got) == 2:
                        break
            assert {s.group_id for s in got} == {"held"} and all(len(s.response_token_ids) == 5 for s in got)
            assert (await client.status()).paused == ""
    async with running(cfg) as third:  # the resume was kept too
        assert await _call(third.http_port, "GET", "/is_paused") == (200, {"is_paused": False})


def test_a_pause_is_journaled_when_it_happens_not_only_at_a_checkpoint(tmp_path):
    from rollout_service.api.convert import WIRE_SAMPLES
    from rollout_service.core.clock import Clock
    from rollout_service.core.rollout import RolloutCore
    from rollout_service.engines.sim import SimEngine, SimParams
    from rollout_service.scheduling import make_placement

    async def reopened(action: str | None) -> str | None:
        """The pause the journal restored; then `action` (a pause mode or
        "resume") and a stop without a checkpoint."""
        core = RolloutCore([SimEngine("e0", SimParams())], make_placement("least-assigned"), Clock())
        core.open_state(str(tmp_path), 0.002, WIRE_SAMPLES)
        mode = core.pausing.mode
        await core.start()
        if action == "resume":
            core.pausing.resume()
        elif action:
            await core.pausing.pause(action, 1.0)
        await core.commit()
        await core.stop()  # no checkpoint: what survives is what the journal recorded
        return mode

    assert asyncio.run(reopened("wait")) is None
    assert asyncio.run(reopened("resume")) == "wait"
    assert asyncio.run(reopened(None)) is None


async def test_pause_abort_answers_every_request_with_what_it_generated(fleet):
    """HTTP callers get their answer at once (finish "abort"), a trainer's
    gRPC stream gets its samples aborted with their tokens."""
    port = fleet.http_port
    http = asyncio.ensure_future(_call(port, "POST", "/inference/v1/generate", _long(400)))
    async with connect(fleet, "abort") as c:
        gid = (await c.submit([PromptGroup(prompt_token_ids=PROMPT, num_samples=2, max_tokens=400,
                                           min_tokens=400)]))[0]
        await wait_until(lambda: sum(len(r.token_ids) for g in fleet.core.groups.values() for r in g.requests) > 40,
                         30, "tokens on every request")
        assert await _call(port, "POST", "/pause?mode=abort&clear_cache=false") == (200, {"status": "paused"})
        status, r = await asyncio.wait_for(http, 10)
        assert status == 200
        choice = r["choices"][0]
        assert choice["finish_reason"] == "abort" and 0 < len(choice["token_ids"]) < 400
        assert choice["weight_versions"][-1]["end"] == len(choice["token_ids"])
        samples = [s for s in await asyncio.wait_for(_samples(c, gid, 2), 10)]
        assert all(s.finish_reason == "aborted" and 0 < len(s.response_token_ids) < 400 for s in samples)
    assert not fleet.core.groups


async def _samples(client, group_id: str, count: int) -> list:
    out = []
    async for s in client.stream():
        if s.group_id == group_id:
            out.append(s)
            if len(out) == count:
                return out


async def test_pause_wait_drains_what_runs_and_starts_nothing_new(fleet):
    port = fleet.http_port
    running_ = Stream(port, _long(60))
    await wait_until(lambda: running_.tokens, 30, "the first tokens")
    status, body = await _call(port, "POST", "/pause?mode=wait")
    assert (status, body) == (200, {"status": "paused"})
    await asyncio.sleep(0.1)
    assert len(running_.tokens) == 60 and running_.finals()[0]["finish_reason"] == "length"  # drained, not cut
    later = Stream(port, _long(5))
    await asyncio.sleep(0.4)
    assert later.tokens == []
    await _call(port, "POST", "/resume")
    await later.done()
    assert len(later.tokens) == 5


async def test_abort_requests_by_id_answers_that_request_only(fleet):
    port = fleet.http_port
    first = Stream(port, {**_long(300), "request_id": "first"})
    second = Stream(port, {**_long(300), "request_id": "second"})
    await wait_until(lambda: first.tokens and second.tokens, 30, "both requests to start")
    status, body = await _call(port, "POST", "/abort_requests", {"request_ids": ["generate-tokens-first"]})
    assert (status, body) == (200, {"status": "aborted", "aborted": 1})
    await first.done(10)
    assert first.finals()[0]["finish_reason"] == "abort" and first.chunks[0]["request_id"] == "generate-tokens-first"
    assert not second.task.done()
    import aiohttp

    async with aiohttp.ClientSession() as session:  # vLLM's generate-router abort: an empty 200
        async with session.post(f"http://127.0.0.1:{port}/inference/v1/abort_requests",
                                json={"request_ids": ["second"]}) as r:
            assert r.status == 200 and await r.read() == b""
    await second.done(10)
    assert second.finals()[0]["finish_reason"] == "abort"
    assert (await _call(port, "POST", "/inference/v1/abort_requests", {}))[1]["error"]["param"] == "request_ids"
    third = Stream(port, _long(300))
    await wait_until(lambda: third.tokens, 30, "the third request to start")
    assert (await _call(port, "POST", "/abort_requests", {}))[0] == 200  # no ids: every open group
    await third.done(10)
    assert third.finals()[0]["finish_reason"] == "abort" and not fleet.core.groups


async def test_session_header_keeps_a_session_on_one_engine(fleet):
    seen: dict[str, list] = {}

    def tap(sample):
        seen.setdefault(sample.group_id, []).extend(sample.engines)

    fleet.core.sample_taps.append(tap)
    try:
        async def one(headers):
            status, r = await _call(fleet.http_port, "POST", "/inference/v1/generate", _long(3), headers)
            assert status == 200
        for _ in range(6):
            await asyncio.gather(one({"X-Session-ID": "conv-a"}), one({"X-Session-ID": "conv-b"}))
    finally:
        fleet.core.sample_taps.remove(tap)
    engines_of = {fleet.core.sessions.engine_for({"session_id": k}) for k in ("conv-a", "conv-b")}
    assert len(seen) == 12
    by_engine = {tuple(v) for v in seen.values()}
    assert by_engine <= {(e,) for e in engines_of}  # every request on its session's engine


async def test_cache_salt_partitions_the_prefix_cache(fleet):
    """Same prompt, same salt: its KV is reused; another salt: computed again."""
    prompt = [1 + i % 90 for i in range(200)]

    def hits() -> int:
        return sum(e.load().prefix_cache_hit_tokens for e in fleet.core.engines.values())

    async def once(salt: str, session: str) -> None:
        status, r = await _call(fleet.http_port, "POST", "/inference/v1/generate",
                                {"token_ids": prompt, "cache_salt": salt, "sampling_params": {"max_tokens": 2}},
                                {"X-Session-ID": session})
        assert status == 200, r

    await once("alice", "s1")
    before = hits()
    await once("alice", "s1")
    reused = hits() - before
    await once("bob", "s1")
    assert reused >= 150 and hits() - before == reused


async def test_control_routes_need_the_weights_token():
    cfg = sim_config(num_engines=1)
    cfg.auth.submit_tokens = ["submit-secret"]
    cfg.auth.weights_tokens = ["weights-secret"]
    async with running(cfg) as service:
        port = service.http_port

        def auth(token):
            return {"Authorization": f"Bearer {token}"}

        status, body = await _call(port, "POST", "/pause?mode=keep", headers=auth("submit-secret"))
        assert status == 403 and body["error"]["param"] == "authorization"
        status, _ = await _call(port, "POST", "/inference/v1/generate", _long(2), auth("submit-secret"))
        assert status == 200
        assert (await _call(port, "GET", "/is_paused", headers=auth("submit-secret")))[1] == {"is_paused": False}
        assert await _call(port, "POST", "/pause?mode=keep", headers=auth("weights-secret")) == (
            200, {"status": "paused"})
        assert (await _call(port, "POST", "/resume"))[0] == 401


@pytest.mark.parametrize("method,path,body,param", [
    ("POST", "/pause?mode=later", None, "mode"),
    ("POST", "/pause?clear_cache=maybe", None, "clear_cache"),
    ("GET", "/get_world_size?include_dp=2", None, "include_dp"),
    ("GET", "/server_info?config_format=yaml", None, "config_format"),
    ("POST", "/abort_requests", {"request_ids": "all"}, "request_ids"),
    ("POST", "/inference/v1/generate", {**_long(2), "output_mode": "text"}, "output_mode"),
    ("POST", "/inference/v1/generate", {**_long(2), "priority": 3}, "priority"),
    ("POST", "/inference/v1/generate", {**_long(2), "cache_salt": ""}, "cache_salt"),
    ("POST", "/inference/v1/generate", {**_long(2), "stream_options": {"include_usage": True}}, "stream_options"),
    ("POST", "/v1/completions", {"prompt": PROMPT, "cache_salt": 7}, "cache_salt"),
    ("POST", "/update_weights", {"weight_dir": "/checkpoints/step_3"}, "weight_dir"),  # prime-rl's body
])
async def test_bad_values_are_400_in_vllms_error_shape_naming_the_field(fleet, method, path, body, param):
    status, r = await _call(fleet.http_port, method, path, body)
    assert status == 400 and r["error"]["param"] == param and r["error"]["code"] == 400, r
    assert param in r["error"]["message"]
    assert await _call(fleet.http_port, "GET", "/is_paused") == (200, {"is_paused": False})  # still serving


async def _push_over_routes(port: int, state_dict: dict, client: type = HttpControl, group_timeout_s: float = 30,
                            timeout_s: float = 120) -> int:
    """One push by the gloo trainer engine over the routes (through
    `client`, vLLM's HTTP weight-sync protocol as `trainer_client.collective.
    HttpControl` speaks it: importing vLLM's own client imports vLLM, which
    test_vllm_routes_engines.py does); the bytes it sent."""
    from rollout_proto.gloo_trainer import GlooTrainerInitInfo, GlooTrainerWeightTransferEngine
    from trainer_client.collective import StateDictSource, free_port

    _, world = await _call(port, "GET", "/get_world_size")
    source = StateDictSource()
    source.state_dict = state_dict

    def push():
        info = GlooTrainerInitInfo("127.0.0.1", free_port(), world["world_size"] + 1, timeout_s=group_timeout_s)
        engine = GlooTrainerWeightTransferEngine.trainer_init(info, client=client(f"http://127.0.0.1:{port}"),
                                                              source=source)
        try:
            engine.send_weights()
            return engine.bytes_sent
        finally:
            engine.shutdown()

    return await asyncio.wait_for(asyncio.to_thread(push), timeout_s)


async def test_the_trainer_sends_the_same_bytes_to_one_engine_as_to_two(fleet):
    torch = pytest.importorskip("torch")
    state = {"w": torch.ones(4096)}
    async with running(sim_config(num_engines=1)) as one:
        alone = await _push_over_routes(one.http_port, state)
        assert one.core.policy_version == 1
    assert alone == await _push_over_routes(fleet.http_port, state) == 4 * 4096


async def test_weight_transfer_routes_push_once_to_every_engine_and_the_version_goes_live(fleet):
    """The gloo trainer engine drives the routes: one group over both
    engines, each byte sent once, the version live on every engine at
    finish; /update_weight_version relabels it in /weight_info and spans."""
    torch = pytest.importorskip("torch")
    port, before = fleet.http_port, fleet.core.policy_version
    sent = await _push_over_routes(port, {"w": torch.ones(1024), "b": torch.zeros(3, 5)})
    assert sent == 4 * (1024 + 15)  # once, for both engines
    assert fleet.core.policy_version == before + 1
    assert {e.load().policy_version for e in fleet.core.engines.values()} == {before + 1}
    assert await _call(port, "GET", "/weight_info") == (200, {"weight_version": str(before + 1)})
    assert await _call(port, "POST", "/update_weight_version", {"new_version": "step-7"}) == (
        200, {"success": True, "new_version": "step-7"})
    assert await _call(port, "GET", "/weight_info") == (200, {"weight_version": "step-7"})
    status, r = await _call(port, "POST", "/inference/v1/generate", _long(4))
    assert status == 200 and r["choices"][0]["weight_versions"] == [{"version": "step-7", "start": 0, "end": 4}]
    await _call(port, "POST", "/shutdown_weight_transfer_engine")
    assert fleet.core.collective.plan_in_force is None


async def test_an_update_the_service_refuses_ends_the_trainers_send_at_once_with_its_reason(fleet):
    """/update_weights refused (here a manifest naming one tensor twice; a
    served model refuses a tensor it lacks the same way) while the trainer
    sends: no engine takes the bytes, and the trainer stops at once with
    the service's reason, not at the group's timeout; the fleet keeps its
    version."""
    torch = pytest.importorskip("torch")

    class Twice(dict):  # a state dict whose manifest names "w" twice
        def items(self):
            return [("w", self["w"]), ("w", self["w"])]

        def keys(self):
            return ["w", "w"]

    before = fleet.core.policy_version
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"update_info.names\[1\].*must be a new tensor name"):
        await _push_over_routes(fleet.http_port, Twice(w=torch.ones(1 << 20)), group_timeout_s=60, timeout_s=120)
    assert time.monotonic() - t0 < 20
    assert fleet.core.policy_version == before
    # That update is over: the next trainer forms its group and pushes.
    assert await _push_over_routes(fleet.http_port, {"w": torch.ones(16)}) == 64
    assert fleet.core.policy_version == before + 1


class NeverFinishes(HttpControl):
    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass  # a trainer that died between update_weights and finish_weight_update


async def test_a_push_never_finished_is_abandoned_and_the_previous_version_serves(fleet):
    torch = pytest.importorskip("torch")

    port, before = fleet.http_port, fleet.core.policy_version
    _, label = await _call(port, "GET", "/weight_info")
    await _push_over_routes(port, {"w": torch.ones(64)}, client=NeverFinishes, group_timeout_s=2, timeout_s=60)
    await wait_until(lambda: fleet.core.collective.plan_in_force is None, 10, "the push to be abandoned")
    assert fleet.core.policy_version == before
    assert await _call(port, "GET", "/weight_info") == (200, label)
    status, r = await _call(port, "POST", "/start_weight_update")  # not "already open": the group is gone
    assert status == 409 and "/init_weight_transfer_engine" in r["error"]["message"]
    status, r = await _call(port, "POST", "/inference/v1/generate", _long(3))
    assert status == 200 and r["choices"][0]["weight_versions"][0]["version"] == label["weight_version"]
