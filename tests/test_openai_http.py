"""The OpenAI-compatible endpoint, driven by the official `openai` client."""
from __future__ import annotations

import json

import pytest

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
])
async def test_malformed_requests_get_400_naming_the_field(sim_service, path, body, param):
    status, payload = await _post(sim_service.http_port, path, body)
    assert status == 400
    assert payload["error"]["param"] == param and param in payload["error"]["message"]
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
