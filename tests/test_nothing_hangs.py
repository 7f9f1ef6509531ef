"""Nothing hangs: aborted or abandoned HTTP requests end, file pushes cannot
block, large prompts do not stall the event loop, streamed text is decoded
incrementally and exactly."""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time

import aiohttp
import grpc
import numpy as np
import pytest

from rollout_proto import rollout_pb2 as pb
from rollout_service.api.openai_http import ResponseText
from rollout_service.engines.weights import WeightsChanged, WeightTensor, write_safetensors
from trainer_client import PromptGroup, RolloutClient

from helpers import connect, free_port, running, sim_config, unique, wait_until

# Slow simulated engines: a 1,000-token response takes ~20 s.
SLOW_SIM = {"decode_base_s": 0.02, "decode_per_seq_s": 0.0}
LONG = {"prompt": [1, 40, 41], "max_tokens": 1000, "ignore_eos": True}


@pytest.fixture(scope="module")
async def service(tmp_path_factory):
    """2 slow simulated engines; file pushes may read one directory."""
    cfg = sim_config(num_engines=2, sim=dict(SLOW_SIM))
    cfg.weights_file_dirs = [str(tmp_path_factory.mktemp("weights"))]
    async with running(cfg) as service:
        yield service


@pytest.fixture
async def rclient(service):
    async with connect(service, "hangs") as c:
        yield c


def _running(service) -> int:
    return sum(e.load().running for e in service.core.engines.values())


def _private_groups(service) -> int:
    return sum(g.listener is not None for g in service.core.groups.values())


async def _post(session: aiohttp.ClientSession, port: int, path: str, body: dict, stream: bool):
    """The response's JSON, or for a stream its chunks' finish reasons."""
    async with session.post(f"http://127.0.0.1:{port}{path}", json={**body, "stream": stream}) as r:
        assert r.status == 200, await r.text()
        if not stream:
            return await r.json()
        reasons = []
        async for line in r.content:
            if line.startswith(b"data: {"):
                reasons += [c["finish_reason"] for c in json.loads(line[6:])["choices"] if c["finish_reason"]]
        return reasons


# -- Abort, timeout and disconnect end HTTP requests -----------------------------------

@pytest.mark.parametrize("stream", [False, True])
async def test_abort_all_answers_an_http_request_in_flight_within_a_second(service, rclient, stream):
    async with aiohttp.ClientSession() as session:
        request = asyncio.ensure_future(_post(session, service.http_port, "/v1/completions", LONG, stream))
        await wait_until(lambda: _running(service) > 0, 10, "the HTTP request to run")
        t0 = time.monotonic()
        aborted, _ = await rclient.abort(all=True)
        answer = await asyncio.wait_for(request, 5)
        elapsed = time.monotonic() - t0
    assert aborted >= 1
    assert elapsed < 1.0, f"answered {elapsed:.2f} s after the Abort"
    reasons = answer if stream else [c["finish_reason"] for c in answer["choices"]]
    assert reasons == ["abort"]
    assert _private_groups(service) == 0


async def test_an_http_request_past_http_request_timeout_s_is_answered_aborted():
    cfg = sim_config(num_engines=1, sim=dict(SLOW_SIM))
    cfg.http_request_timeout_s = 0.5
    async with running(cfg) as service, aiohttp.ClientSession() as session:
        t0 = time.monotonic()
        answer = await asyncio.wait_for(_post(session, service.http_port, "/v1/completions", LONG, False), 10)
        assert 0.5 <= time.monotonic() - t0 < 2.0
        assert [c["finish_reason"] for c in answer["choices"]] == ["abort"]
        assert 0 < len(answer["choices"][0]["token_ids"]) < 1000  # what was generated, kept
        await wait_until(lambda: _running(service) == 0, 2, "the engine to stop generating")


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_disconnects_stops_its_generation(service, stream):
    async with aiohttp.ClientSession() as session:
        request = asyncio.ensure_future(_post(session, service.http_port, "/v1/completions", LONG, stream))
        await wait_until(lambda: _running(service) > 0, 10, "the HTTP request to run")
        request.cancel()  # the client goes away: its connection closes
        with pytest.raises(asyncio.CancelledError):
            await request
    await wait_until(lambda: _running(service) == 0 and _private_groups(service) == 0, 2,
                     "the engines to stop generating for the departed client")


def _serve(grpc_port: int, http_port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rollout_service.cli", "serve", "--engine", "sim", "--num-engines", "1",
         "--grpc-port", str(grpc_port), "--http-port", str(http_port), "--set", "engine.sim.decode_base_s=0.02"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})


async def test_after_an_abort_and_with_a_request_in_flight_sigterm_stops_promptly():
    grpc_port, http_port = free_port(), free_port()
    server = _serve(grpc_port, http_port)
    try:
        async with RolloutClient(f"127.0.0.1:{grpc_port}", consumer_id="sigterm") as client, \
                aiohttp.ClientSession() as session:
            await client.wait_ready(60)
            first = asyncio.ensure_future(_post(session, http_port, "/v1/completions", LONG, False))

            async def generating():
                return (await client.status()).running_requests > 0

            await wait_until(generating, 10, "the HTTP request to run")
            await client.abort(all=True)
            assert [c["finish_reason"] for c in (await asyncio.wait_for(first, 2))["choices"]] == ["abort"]
            second = asyncio.ensure_future(_post(session, http_port, "/v1/completions", LONG, True))
            await wait_until(generating, 10, "the second HTTP request to run")
            t0 = time.monotonic()
            server.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(second, 5) == ["abort"]  # answered, not cut off
            await asyncio.to_thread(server.wait, 10)
            stopped = time.monotonic() - t0
        assert server.returncode == 0
        assert stopped < 5.0, f"stopped {stopped:.1f} s after SIGTERM"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


# -- file pushes --------------------------------------------------------------------------

def _weights_file(path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    tensors = {"w": rng.standard_normal((64, 32), dtype=np.float32), "b": rng.standard_normal(32, dtype=np.float32)}
    write_safetensors(str(path), [WeightTensor(k, "float32", v.shape, memoryview(v).cast("B"))
                                  for k, v in tensors.items()])


def _allowed(service):
    from pathlib import Path

    return Path(service.config.weights_file_dirs[0])


async def test_a_fifo_push_is_refused_at_once_and_submit_answers_meanwhile(service, rclient):
    before = (await rclient.status()).policy_version
    fifos = []
    for i in range(8):  # more than the default pool's share that blocked pushes used to take
        fifos.append(_allowed(service) / unique("fifo"))
        os.mkfifo(fifos[-1])
    t0 = time.monotonic()
    pushes = [asyncio.ensure_future(rclient.push_weights_file(str(f), version=before + 1)) for f in fifos]
    # A Submit of many text prompts is validated on the default thread pool.
    gid = unique("meanwhile")
    await asyncio.wait_for(rclient.submit([PromptGroup(prompt_text=f"add {i}+{i}", num_samples=1, max_tokens=2,
                                                       group_id=f"{gid}-{i}") for i in range(16)]), 5)
    for push in pushes:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(push, 5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "header.file_path" in err.value.details() and "a FIFO" in err.value.details()
    assert time.monotonic() - t0 < 5.0
    assert (await rclient.status()).policy_version == before


async def test_file_pushes_outside_the_listed_directories_are_refused_naming_the_key(service, rclient, tmp_path):
    before = (await rclient.status()).policy_version
    outside = tmp_path / "outside.safetensors"
    _weights_file(outside)
    link = _allowed(service) / unique("escape.safetensors")
    link.symlink_to(outside)  # inside by name, outside once resolved
    for path in (outside, link):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rclient.push_weights_file(str(path), version=before + 1)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
        assert "weights_file_dirs" in err.value.details()
    inside = _allowed(service) / unique("inside.safetensors")
    _weights_file(inside)
    assert (await rclient.push_weights_file(str(inside), version=before + 1)).applied_version == before + 1


async def test_file_pushes_are_refused_naming_the_key_when_no_directory_is_listed(client, tmp_path):
    path = tmp_path / "w.safetensors"
    _weights_file(path)
    before = (await client.status()).policy_version
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.push_weights_file(str(path), version=before + 1)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "weights_file_dirs" in err.value.details()


async def test_a_file_whose_header_claims_more_bytes_than_it_holds_is_refused_before_mapping(service, rclient):
    path = _allowed(service) / unique("short.safetensors")
    _weights_file(path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 4)  # the last tensor's bytes cut short
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await rclient.push_weights_file(str(path), version=(await rclient.status()).policy_version + 1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a safetensors file" in err.value.details() and "'b'" in err.value.details()


async def test_a_pushed_file_overwritten_in_place_is_never_served_under_its_version(service, rclient):
    path = _allowed(service) / unique("policy.safetensors")
    _weights_file(path, seed=1)
    verified = path.read_bytes()
    version = (await rclient.status()).policy_version + 1
    await rclient.push_weights_file(str(path), version=version)
    staged = service.core.weight_sync.last  # what a restarted engine or a roll-back reads
    assert await staged.as_file() == str(path)
    # The trainer writes its next weights into the same file, in place.
    with open(path, "r+b") as f:
        f.seek(len(verified) - 8)
        f.write(b"\x00" * 8)
    with pytest.raises(WeightsChanged, match="push the weights again"):
        await staged.as_file()


async def test_a_pushed_file_replaced_by_rename_is_served_from_the_verified_bytes(service, rclient):
    path = _allowed(service) / unique("policy.safetensors")
    _weights_file(path, seed=2)
    verified = path.read_bytes()
    version = (await rclient.status()).policy_version + 1
    await rclient.push_weights_file(str(path), version=version)
    staged = service.core.weight_sync.last
    _weights_file(path.with_suffix(".next"), seed=3)
    os.replace(path.with_suffix(".next"), path)  # the trainer's next version, renamed over it
    served = await staged.as_file()
    assert served != str(path)
    with open(served, "rb") as f:
        from rollout_service.engines.weights import read_safetensors

        specs, data = read_safetensors(served)
        assert bytes(data) == verified[len(verified) - len(data):]


# -- large prompts off the event loop -------------------------------------------------------

# ~810,000 characters (under the 1,000,000 a text may have): ~0.8 s to
# tokenize on this machine when idle, long enough to tell a stalled loop.
BIG_PROMPT = "add 9+6689 then collatz 27\n" * 30_000


async def _max_latency_while(ping, work: asyncio.Future) -> tuple[float, float]:
    """(the longest wait of `ping()` (a health check) while `work` runs, how
    long it ran), s. The service runs in this process, on this event loop: a
    stall of the loop delays each ping by as much."""
    t0, worst = time.monotonic(), 0.0
    while not work.done():
        t = time.monotonic()
        await ping()
        await asyncio.sleep(0.01)
        worst = max(worst, time.monotonic() - t - 0.01)
    await work
    return worst, time.monotonic() - t0


async def test_a_large_http_prompt_is_tokenized_while_health_checks_answer(sim_service):
    text = BIG_PROMPT
    async with aiohttp.ClientSession() as session:
        async def big():
            async with session.post(f"http://127.0.0.1:{sim_service.http_port}/v1/completions",
                                    json={"prompt": text, "max_tokens": 4}) as r:
                assert r.status == 400 and "prompt" in (await r.json())["error"]["param"]  # too long, once tokenized

        async def health():
            async with session.get(f"http://127.0.0.1:{sim_service.http_port}/healthz") as r:
                assert r.status == 200

        worst, took = await _max_latency_while(health, asyncio.ensure_future(big()))
    assert took > 0.3, "the prompt was checked too fast to tell"
    assert worst < took / 3, f"a health check waited {worst:.2f} s during a {took:.2f} s prompt check"


async def test_a_large_submit_is_tokenized_while_get_status_answers(sim_service, client):
    text = BIG_PROMPT  # refused for length, once tokenized
    request = pb.SubmitRequest(groups=[pb.PromptGroup(prompt_text=text, num_samples=1,
                                                      sampling=pb.SamplingParams(max_tokens=1))])

    async def submit():
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client._stub.Submit(request)
        return err

    work = asyncio.ensure_future(submit())
    worst, took = await _max_latency_while(client.status, work)
    err = work.result()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_token_ids" in err.value.details()
    assert took > 0.3, "the prompt was checked too fast to tell"
    assert worst < took / 3, f"GetStatus waited {worst:.2f} s during a {took:.2f} s Submit check"


# -- incremental detokenization ---------------------------------------------------------------

def _streamed(decode, ids: list[int], rng: random.Random) -> tuple[str, str]:
    """(the pieces streamed, concatenated; the final text) of ids pushed in random chunks."""
    text = ResponseText(decode)
    pieces, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        pieces.append(text.push(ids[i:i + n]))
        i += n
    pieces.append(text.finish())
    return "".join(pieces), text.text


def test_incremental_detokenization_equals_a_full_decode_with_the_bundled_tokenizer():
    from transformers import PreTrainedTokenizerFast

    from rollout_service.factory import default_model_path

    tok = PreTrainedTokenizerFast.from_pretrained(default_model_path())
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731 (as the front end decodes)
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 60))]
        streamed, final = _streamed(decode, ids, rng)
        assert streamed == final == decode(ids), ids


def test_incremental_detokenization_keeps_multibyte_characters_split_across_tokens():
    from tokenizers import ByteLevelBPETokenizer

    # A byte-level BPE tokenizer (GPT-2's and Qwen's kind) with few merges:
    # most non-ASCII characters are two to four byte tokens.
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(["plain ascii words"] * 10, vocab_size=300, min_frequency=2)
    decode = tok.decode
    rng = random.Random(1)
    text = "naïve café — 数学 😀 Ωmega ünïcödé\n" * 3
    ids = tok.encode(text).ids
    assert len(ids) > len(text.encode()) / 2  # multi-byte characters span several tokens
    for _ in range(50):
        streamed, final = _streamed(decode, ids, rng)
        assert streamed == final == decode(ids) == text
    cut = _streamed(decode, ids[:-1], rng)[1]  # a response ending mid-character: as decoded whole
    assert cut == decode(ids[:-1])
