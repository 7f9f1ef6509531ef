"""The OpenAI-compatible endpoint, driven by the official `openai` client."""
from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import tempfile
import urllib.request

import pytest

from helpers import free_port, vllm_model, wait_until_sync
from rollout_service.bench.report import compare
from rollout_service.bench.run import BenchOptions, run_bench

openai = pytest.importorskip("openai")


@pytest.fixture
def oai(sim_service):
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{sim_service.http_port}/v1", api_key="unused")


@pytest.fixture
def model(sim_service):
    return sim_service.model_name


async def test_completions_text_and_token_ids_with_n_and_logprobs(oai, model):
    r = await oai.completions.create(model=model, prompt="C 27:", max_tokens=8, n=3, logprobs=1, temperature=1.0)
    assert len(r.choices) == 3 and sorted(c.index for c in r.choices) == [0, 1, 2]
    for c in r.choices:
        assert isinstance(c.text, str) and c.finish_reason in ("stop", "length")
        assert len(c.logprobs.token_logprobs) == len(c.logprobs.tokens) > 0
    assert r.usage.completion_tokens > 0
    assert r.model_extra["policy_version"] >= 0
    r2 = await oai.completions.create(model=model, prompt=[1, 10, 11], max_tokens=4)
    assert len(r2.choices) == 1 and r2.choices[0].model_extra["token_ids"]


async def test_chat_completions_and_streaming(oai, model):
    r = await oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "C 6:"}],
                                          max_tokens=8, n=2, logprobs=True)
    assert len(r.choices) == 2
    assert all(c.message.role == "assistant" and c.logprobs.content for c in r.choices)
    stream = await oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "C 6:"}],
                                               max_tokens=8, stream=True)
    pieces, finishes = [], []
    async for chunk in stream:
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            if c.finish_reason:
                finishes.append(c.finish_reason)
    assert finishes and len(pieces) > 1
    cstream = await oai.completions.create(model=model, prompt=[1, 10, 11], max_tokens=6, n=2, stream=True)
    seen = set()
    async for chunk in cstream:
        seen |= {c.index for c in chunk.choices}
    assert seen == {0, 1}


async def _post(port, path, body) -> tuple[int, dict]:
    import aiohttp

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://127.0.0.1:{port}{path}", data=data,
                                headers={"Content-Type": "application/json"}) as r:
            return r.status, await r.json()


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": [1, 2], "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": [1, 2], "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": [1, 2], "n": 0}, "n"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [1, 10**7]}, "prompt"),
    ("/v1/completions", {"max_tokens": 4}, "prompt"),
    ("/v1/completions", b"{not json", "body"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0]"),
    # Every list and string field has a limit (docs/api.md#limits); a number out of range is a 400, however large.
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 10**400}, "max_tokens"),
    ("/v1/completions", {"prompt": [1, 2], "n": -10**400}, "n"),
    ("/v1/completions", {"prompt": [1, 2], "seed": 2**63}, "seed"),
    ("/v1/completions", {"prompt": [1, 2], "stop": ["x" * 257]}, "stop"),
    ("/v1/completions", {"prompt": [1, 2], "stop_token_ids": [2] * 257}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x" * 1_000_001}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2], "user": "u" * 257}, "user"),
    ("/v1/completions", b'{"prompt": [1, 2], "n": 1' + b"0" * 5000 + b"}", "body"),
    ("/v1/completions", b" " * (17 * 2**20), "body"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 1_000_001}]}, "messages"),
    ("/inference/v1/generate", {"token_ids": [1, 2], "request_id": "r" * 257}, "request_id"),
])
async def test_malformed_requests_get_400_naming_the_field(sim_service, path, body, param):
    status, payload = await _post(sim_service.http_port, path, body)
    assert status == 400, payload
    assert payload["error"]["param"] == param and param in payload["error"]["message"]
    assert len(payload["error"]["message"]) < 400  # a huge value is not echoed back
    ok, good = await _post(sim_service.http_port, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
    assert ok == 200 and good["choices"]


async def test_http_completions_do_not_leak_into_the_trainer_stream(oai, model, client):
    before = (await client.status()).last_cursor
    await oai.completions.create(model=model, prompt=[1, 10, 11], max_tokens=4, n=2)
    assert (await client.status()).last_cursor == before


async def test_text_prompts_are_tokenized_like_the_task(sim_service):
    from rollout_service.tasks import encode

    text = "add 12+3\nsort 5 3\n"
    assert sim_service.core.detokenizer.encode(text, add_special_tokens=False) == encode(text)


async def test_a_private_group_reports_typed_delta_and_sample_events(sim_service):
    from rollout_service.engines.types import SamplingParams
    from rollout_service.lifecycle.types import DeltaEvent, GroupSpec, SampleEvent

    group = sim_service.core.submit_private(GroupSpec("", [1, 4, 7], 2, SamplingParams(max_tokens=12)))
    tokens: dict[int, list[int]] = {0: [], 1: []}
    samples = []
    while len(samples) < 2:
        event = await group.listener.get()
        assert isinstance(event, (DeltaEvent, SampleEvent)), event
        if isinstance(event, DeltaEvent):
            tokens[event.index] += event.delta.token_ids
        else:
            samples.append(event.sample)
    for s in samples:
        assert s.response_token_ids == tokens[s.index] and 0 < len(s.response_token_ids) <= 12


# -- the surface as agent harnesses use it (issue 19, part 3) ------------------------


@pytest.mark.parametrize("path,body,param,words", [
    ("/v1/completions", {"prompt": [1, 2], "foo": 1}, "foo", "unknown parameter 'foo'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "C 6:"}], "store": True}, "store",
     "unsupported parameter 'store'"),
    ("/v1/completions", {"prompt": [1, 2], "frequency_penalty": 0.5}, "frequency_penalty",
     "unsupported parameter 'frequency_penalty'"),
    ("/v1/completions", {"prompt": [1, 2], "messages": []}, "messages", "unknown parameter 'messages'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "C 6:"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "chat template"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "C 6:"}], "tool_choice": "required"},
     "tool_choice", "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "C 6:"}], "top_logprobs": 2},
     "top_logprobs", "logprobs"),
    ("/v1/completions", {"prompt": [1, 2], "stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ("/v1/completions", {"prompt": [1, 2], "stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage", "boolean"),
    ("/v1/completions", {"prompt": [1, 2], "min_tokens": 9, "max_tokens": 4}, "min_tokens", "min_tokens"),
    ("/v1/completions", {"prompt": [1, 2], "ignore_eos": "yes"}, "ignore_eos", "boolean"),
    ("/v1/completions", {"prompt": [1, 2], "stop": [1, 2]}, "stop", "strings"),
    ("/v1/completions", {"prompt": [1, 2], "stop": "\n"}, "stop", "simulated"),  # sim engines have no text
    ("/v1/completions", {"prompt": [1, 2], "user": 7}, "user", "string"),
])
async def test_unknown_and_unsupported_parameters_are_400s_naming_them(sim_service, path, body, param, words):
    status, payload = await _post(sim_service.http_port, path, body)
    assert status == 400, payload
    assert payload["error"]["param"] == param and words in payload["error"]["message"], payload
    keep = "messages" if "chat" in path else "prompt"
    ok, good = await _post(sim_service.http_port, path, {keep: body[keep], "max_tokens": 2})
    assert ok == 200 and good["choices"]


async def test_neutral_values_of_unimplemented_settings_stay_accepted(sim_service):
    status, r = await _post(sim_service.http_port, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "C 6:"}], "max_tokens": 3, "presence_penalty": 0.0,
        "frequency_penalty": 0, "logit_bias": {}, "response_format": {"type": "text"}, "tool_choice": "none",
        "tools": [], "user": "s1", "stream": False})
    assert status == 200, r


async def test_min_tokens_and_ignore_eos_on_simulated_engines(oai, model):
    r = await oai.completions.create(model=model, prompt=[1, 10, 11], max_tokens=300, n=4,
                                     extra_body={"min_tokens": 200})
    assert all(len(c.model_extra["token_ids"]) >= 200 for c in r.choices)
    r = await oai.completions.create(model=model, prompt=[1, 10, 11], max_tokens=300, n=2,
                                     extra_body={"ignore_eos": True})
    assert all(c.finish_reason == "length" and len(c.model_extra["token_ids"]) == 300 for c in r.choices)
    assert r.usage.completion_tokens == 600


async def test_include_usage_gives_a_final_usage_chunk_with_exact_counts(oai, model):
    stream = await oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "C 6:"}],
                                               max_tokens=20, n=2, stream=True,
                                               stream_options={"include_usage": True})
    streamed, usages, last = 0, [], None
    async for chunk in stream:
        last = chunk
        for c in chunk.choices:
            streamed += len(c.model_extra.get("token_ids") or [])
        if chunk.usage is not None:
            usages.append(chunk.usage)
            assert chunk.choices == []
    assert len(usages) == 1 and last.usage is not None  # the last chunk, and only it
    u = usages[0]
    assert u.completion_tokens == streamed > 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens > 0


async def test_session_key_reaches_the_group_metadata(sim_service, oai, model, monkeypatch):
    seen = []
    submit = sim_service.core.submit_private

    def spy(spec):
        seen.append(dict(spec.metadata))
        return submit(spec)

    monkeypatch.setattr(sim_service.core, "submit_private", spy)
    await oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "C 6:"}], max_tokens=2,
                                      user="harness-7")
    await oai.completions.create(model=model, prompt=[1, 2], max_tokens=2, user="harness-7",
                                 extra_headers={"X-Session-Id": "traj-42"})
    await oai.completions.create(model=model, prompt=[1, 2], max_tokens=2)
    assert seen == [{"session_id": "harness-7"}, {"session_id": "traj-42"}, {}]


async def test_top_logprobs_on_simulated_engines_are_the_sampled_token(oai, model):
    r = await oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "C 6:"}], max_tokens=4,
                                          logprobs=True, top_logprobs=3)
    for e in r.choices[0].logprobs.content:
        assert [(t.token, t.logprob) for t in e.top_logprobs] == [(e.token, e.logprob)]


def test_response_text_cuts_at_the_first_stop_string_and_streams_safely():
    from rollout_service.api.openai_http import ResponseText

    def decode(ids):
        return "".join(chr(i) for i in ids)

    ids = [ord(c) for c in "abc<tool>xyz</tool>rest"]
    whole = ResponseText(decode, ("</tool>", "<tool>"))
    whole.push(ids, final=True)
    assert whole.text == "abc" and whole.stop_reason == "<tool>"
    streamed = ResponseText(decode, ("</tool>",), include_stop=True)
    pieces = [streamed.push([i]) for i in ids] + [streamed.finish()]
    assert "".join(pieces) == "abc<tool>xyz</tool>" and streamed.stop_reason == "</tool>"
    assert all("</" not in p or p.endswith("</tool>") for p in pieces)  # a stop string's start is held back
    late = ResponseText(decode, ("b",), min_tokens=3)  # like vLLM: no stop before min_tokens tokens
    late.push([ord(c) for c in "abcb!"], final=True)
    assert late.text == "abc"
    plain = ResponseText(decode)
    assert "".join([plain.push([i]) for i in ids] + [plain.finish()]) == decode(ids)


def test_tools_reach_a_chat_template_that_renders_them():
    from rollout_service.api.openai_http import BadRequest, OpenAIFrontEnd
    from rollout_service.api.validation import ModelLimits

    class Tok:  # a model whose chat template renders tools
        chat_template = "{% for t in tools %}{{ t }}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"

        def __init__(self):
            self.calls = []

        def apply_chat_template(self, messages, **kwargs):
            self.calls.append(kwargs.get("tools"))
            return [1, 5, 6]

    tok = Tok()
    front = OpenAIFrontEnd(core=None, limits=ModelLimits(vocab_size=100, max_model_len=64), tokenizer=tok,
                           model_name="m")
    tools = [{"type": "function", "function": {"name": "search", "parameters": {}}}]
    messages = [{"role": "user", "content": "hi"}]
    assert front._chat_prompt(messages, front.chat_tools({"tools": tools, "tool_choice": "auto"})) == [1, 5, 6]
    assert front._chat_prompt(messages, front.chat_tools({"tools": tools, "tool_choice": "none"})) == [1, 5, 6]
    assert tok.calls == [tools, None]
    with pytest.raises(BadRequest) as e:
        front.chat_tools({"tools": tools, "tool_choice": "required"})
    assert e.value.param == "tool_choice"
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(BadRequest) as e:
        front.chat_tools({"tools": tools})
    assert e.value.param == "tools" and "does not support tools" in str(e.value)


# -- on real vLLM CPU engines: what depends on the engine -----------------------------


@pytest.fixture
def voai(vllm_service):
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{vllm_service.http_port}/v1", api_key="unused")


def _collatz_prompt() -> str:
    from rollout_service.tasks.generator import make_problem

    return make_problem("collatz", [27]).prompt  # a long answer


async def test_two_turn_chat_with_a_stop_string_on_vllm(voai, vllm_service):
    model = vllm_service.model_name
    messages = [{"role": "user", "content": _collatz_prompt()}]
    free = await voai.chat.completions.create(model=model, messages=messages, max_tokens=60, temperature=0.0)
    text = free.choices[0].message.content
    assert len(text) > 16, text
    stop = text[10:13]
    expected = text[:text.find(stop)]
    r = await voai.chat.completions.create(model=model, messages=messages, max_tokens=60, temperature=0.0,
                                           stop=[stop, "\x7f never"], user="traj-1")
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.message.content == expected
    # The engine itself stopped (one token per character): at the token completing the string.
    assert len(c.model_extra["token_ids"]) == len(expected) + len(stop) == r.usage.completion_tokens
    assert c.model_extra["stop_reason"] == stop
    # Streamed: the same text, the stop string never sent.
    stream = await voai.chat.completions.create(model=model, messages=messages, max_tokens=60, temperature=0.0,
                                                stop=stop, stream=True)
    pieces, finish = [], None
    async for chunk in stream:
        for ch in chunk.choices:
            pieces.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert "".join(pieces) == expected and finish == "stop"
    # The next turn: the previous reply appended, the harness's stop string again.
    messages += [{"role": "assistant", "content": c.message.content}, {"role": "user", "content": "\n"}]
    r2 = await voai.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0.0,
                                            stop=[stop], user="traj-1")
    c2 = r2.choices[0]
    assert c2.finish_reason in ("stop", "length") and stop not in c2.message.content
    assert r2.usage.prompt_tokens == 1 + len("".join(m["content"] for m in messages))  # <bos> + the conversation
    if c2.finish_reason == "length":
        assert r2.usage.completion_tokens == 40


async def test_min_tokens_and_ignore_eos_on_vllm(voai, vllm_service):
    from rollout_service.tasks.generator import make_problem

    model = vllm_service.model_name
    prompt = make_problem("add", [12, 3]).prompt  # a short answer, ended by <eos>
    free = await voai.completions.create(model=model, prompt=prompt, max_tokens=200, temperature=0.0)
    n = free.usage.completion_tokens
    assert free.choices[0].finish_reason == "stop" and n < 150, free
    r = await voai.completions.create(model=model, prompt=prompt, max_tokens=200, temperature=0.0,
                                      extra_body={"min_tokens": n + 10})
    assert r.usage.completion_tokens >= n + 10
    r = await voai.completions.create(model=model, prompt=prompt, max_tokens=n + 30, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == n + 30


async def test_include_usage_and_top_logprobs_on_vllm(voai, vllm_service):
    model = vllm_service.model_name
    messages = [{"role": "user", "content": _collatz_prompt()}]
    stream = await voai.chat.completions.create(model=model, messages=messages, max_tokens=30, n=2, seed=3,
                                                stream=True, stream_options={"include_usage": True})
    streamed, usage = 0, None
    async for chunk in stream:
        for c in chunk.choices:
            streamed += len(c.model_extra.get("token_ids") or [])
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage.completion_tokens == streamed > 0
    assert usage.prompt_tokens == 1 + len(messages[0]["content"])
    r = await voai.chat.completions.create(model=model, messages=messages, max_tokens=12, seed=5,
                                           logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == len(r.choices[0].model_extra["token_ids"])
    for e in content:  # vLLM's order: the sampled token first, then the top ones by rank
        tops = e.top_logprobs
        assert len(tops) == 3 and len({t.token for t in tops}) == 3
        assert (tops[0].token, tops[0].logprob) == (e.token, e.logprob)
        assert tops[1].logprob >= tops[2].logprob
    r = await voai.completions.create(model=model, prompt=_collatz_prompt(), max_tokens=12, seed=5, logprobs=2,
                                      extra_body={"return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    for tok, top in zip(lp.tokens, lp.top_logprobs):
        assert tok in top and len(top) in (2, 3)
    import aiohttp

    async with aiohttp.ClientSession() as session:  # vLLM's tokens-in, tokens-out endpoint, the same alternatives
        async with session.post(f"http://127.0.0.1:{vllm_service.http_port}/inference/v1/generate", json={
                "token_ids": [1, 10, 11], "sampling_params": {"max_tokens": 6, "logprobs": 2, "seed": 1}}) as resp:
            assert resp.status == 200
            out = await resp.json()
    for e in out["choices"][0]["logprobs"]["content"]:
        assert e["top_logprobs"][0]["token_id"] == e["token_id"] and len(e["top_logprobs"]) in (2, 3)


# -- `rollout-service bench` against stock vLLM's OpenAI server on the bundled model, and against
# this service on the same model with the same workload: both deliver every sample at its traced
# length, and `bench compare` puts the two reports side by side (docs/results.md keeps that table).

BENCH_WORKLOAD = dict(workload="math", quick=True, steps=2, groups_per_step=4, max_model_len=1024, run_timeout_s=300)


def _vllm_serve(port: int, log) -> subprocess.Popen:
    """`vllm serve` as a user starts it on this CPU: the bundled model, the
    service's engine settings (float32, eager, 32 sequences, 1 GiB of KV cache)."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", vllm_model(), "--dtype", "float32",
         "--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "32", "--seed", "0",
         "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT)


def _healthy(server: subprocess.Popen, port: int, log) -> bool:
    if server.poll() is not None:
        log.seek(0)
        pytest.fail(f"vllm serve exited {server.returncode}: {log.read()[-2000:]}")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


async def _bench(target: str) -> dict:
    return await run_bench(BenchOptions(target=target, **BENCH_WORKLOAD), out=io.StringIO())


async def test_bench_runs_the_same_workload_against_vllm_serve_and_the_service_side_by_side(vllm_service):
    port = free_port()
    log = tempfile.TemporaryFile(mode="w+")
    server = _vllm_serve(port, log)
    try:
        await asyncio.to_thread(wait_until_sync, lambda: _healthy(server, port, log), 300, "vllm serve's /health", 1.0)
        vllm_doc = await _bench(f"http://127.0.0.1:{port}")
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
    service_doc = await _bench(f"http://127.0.0.1:{vllm_service.http_port}")
    for doc in (vllm_doc, service_doc):
        s = doc["summary"]
        assert s["samples_delivered"] == s["samples_submitted"] > 0 and not s["errors"], s["errors"]
        assert s["lengths_matched"] == 1.0  # min_tokens = max_tokens with ignore_eos: both honour it
        assert s["tokens_per_s"] > 0 and s["ttft_s"]["p50"] > 0
    assert vllm_doc["summary"]["tokens"] == service_doc["summary"]["tokens"]  # the same work
    table = compare(vllm_doc, service_doc, ("vllm serve", "rollout-service"))
    print(table)
    assert "tokens/s" in table and "vllm serve" in table
