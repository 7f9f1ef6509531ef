"""The side server's `vllm serve` surface (api/vllm_compat.py and the vLLM
extensions of /v1/completions), on simulated engines; TRL's own client where
it is installed."""
from __future__ import annotations

import asyncio

import pytest


async def _call(port: int, method: str, path: str, body=None) -> tuple[int, dict]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.request(method, f"http://127.0.0.1:{port}{path}", json=body) as r:
            return r.status, await r.json()


async def test_server_info_world_size_and_weight_info(sim_service):
    port = sim_service.http_port
    status, info = await _call(port, "GET", "/server_info?config_format=json")
    assert status == 200
    cfg = info["vllm_config"]
    assert cfg["weight_transfer_config"] == {"backend": "gloo"}  # the weight-transfer routes, on CPUs
    assert cfg["model_config"]["logprobs_mode"] == "processed_logprobs"
    assert cfg["model_config"]["model"] == sim_service.model_name
    assert info["rollout_service"]["policy_version"] == sim_service.core.policy_version
    assert info["rollout_service"]["checkpoint_tensors"] is None  # simulated engines take any manifest
    status, text = await _call(port, "GET", "/server_info")
    assert status == 200 and isinstance(text["vllm_config"], str)
    assert await _call(port, "GET", "/get_world_size") == (200, {"world_size": len(sim_service.core.engines)})
    assert await _call(port, "GET", "/weight_info") == (200, {"weight_version": str(sim_service.core.policy_version)})
    assert await _call(port, "POST", "/reset_prefix_cache") == (200, {"success": True})


@pytest.mark.parametrize("path,body,status,param", [
    ("/init_weight_transfer_engine", {"init_info": {}}, 400, "init_info.master_address"),
    ("/init_weight_transfer_engine", {"init_info": {"master_address": "127.0.0.1", "master_port": 29500,
                                                    "world_size": 3, "rank_offset": 2}}, 400, "init_info.rank_offset"),
    ("/start_weight_update", None, 409, None),
    ("/update_weights", {"update_info": {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2, "x"]]}},
     400, "update_info.shapes[0]"),
    ("/finish_weight_update", None, 409, None),
    ("/start_draft_weight_update", None, 501, None),
])
async def test_weight_transfer_routes_refuse_out_of_order_or_malformed_calls_naming_them(sim_service, path, body,
                                                                                          status, param):
    got, r = await _call(sim_service.http_port, "POST", path, body)
    assert got == status and r["error"]["param"] == param and r["error"]["code"] == status, r
    if status == 409:
        assert "/init_weight_transfer_engine" in r["error"]["message"] or "/start_weight_update" in r["error"][
            "message"]


async def test_batched_completions_with_vllm_extensions(sim_service):
    prompts = [[1, 10, 11], [1, 12], [1, 13, 14, 15]]
    status, r = await _call(sim_service.http_port, "POST", "/v1/completions", {
        "prompt": prompts, "n": 2, "max_tokens": 5, "logprobs": 0, "top_k": 0, "min_p": 0.0,
        "repetition_penalty": 1.0, "return_token_ids": True, "return_tokens_as_token_ids": True})
    assert status == 200
    assert [c["index"] for c in r["choices"]] == list(range(6))
    for i, c in enumerate(r["choices"]):  # prompt-major, like vLLM
        assert c["prompt_token_ids"] == prompts[i // 2]
        lp = c["logprobs"]
        assert lp["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
        assert lp["top_logprobs"] == [{t: v} for t, v in zip(lp["tokens"], lp["token_logprobs"])]
    assert r["usage"]["prompt_tokens"] == sum(map(len, prompts))


@pytest.mark.parametrize("body,param", [
    ({"prompt": [[1, 2]], "min_p": 0.1}, "min_p"),
    ({"prompt": [[1, 2]], "repetition_penalty": 1.2}, "repetition_penalty"),
    ({"prompt": [[1, 2]], "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ({"prompt": [[1, 2]], "top_k": -5}, "top_k"),
    ({"prompt": [[1, 2]], "prompt_logprobs": 5}, "prompt_logprobs"),
    ({"prompt": [[1, 2], [1, 3]], "stream": True}, "stream"),
    ({"prompt": [[1, 2], []]}, "prompt"),
])
async def test_unsupported_sampling_settings_get_400(sim_service, body, param):
    status, r = await _call(sim_service.http_port, "POST", "/v1/completions", body)
    assert status == 400 and r["error"]["param"] == param


async def test_tokens_in_tokens_out_generate(sim_service):
    status, r = await _call(sim_service.http_port, "POST", "/inference/v1/generate", {
        "request_id": "r1", "token_ids": [1, 10, 11], "return_token_ids": True,
        "sampling_params": {"n": 3, "max_tokens": 4, "logprobs": 0}})
    assert status == 200 and r["request_id"] == "generate-tokens-r1" and r["prompt_token_ids"] == [1, 10, 11]
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    for c in r["choices"]:
        content = c["logprobs"]["content"]
        assert [e["token_id"] for e in content] == c["token_ids"]
        assert all(e["token"] == f"token_id:{e['token_id']}" and e["top_logprobs"][0]["logprob"] == e["logprob"]
                   for e in content)
        assert sum(s["end"] - s["start"] for s in c["weight_versions"]) == len(c["token_ids"])
    for body, param in [({"token_ids": "text"}, "token_ids"),
                        ({"token_ids": [1, 2], "sampling_params": {"n": 0}}, "sampling_params.n"),
                        ({"token_ids": [1, 2], "features": {"mm_hashes": {}}}, "features"),
                        ({"token_ids": [1, 2], "sampling_params": {"frequency_penalty": 0.3}},
                         "sampling_params.frequency_penalty"),
                        ({"token_ids": [1, 2], "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
                        ({"token_ids": [1, 2], "kv_transfer_params": {"x": 1}}, "kv_transfer_params")]:
        status, r = await _call(sim_service.http_port, "POST", "/inference/v1/generate", body)
        assert status == 400 and r["error"]["param"] == param, r


async def test_trl_vllm_client_generates_unchanged(sim_service):
    """TRL's stock VLLMClient (no NCCL: generation only) reads the answers."""
    client_mod = pytest.importorskip("trl.generation.vllm_client")

    def run():
        client = client_mod.VLLMClient(base_url=f"http://127.0.0.1:{sim_service.http_port}")
        out = client.generate([[1, 10, 11], [1, 12]], n=3, max_tokens=6, logprobs=0, top_k=0)
        client.reset_prefix_cache()
        return client.model, out, client.get_world_size(), client.get_server_info()

    model, out, world, info = await asyncio.to_thread(run)
    assert model == sim_service.model_name and world == len(sim_service.core.engines)
    assert out["prompt_ids"] == [[1, 10, 11], [1, 12]]
    assert len(out["completion_ids"]) == 6
    for ids, lps, lp_ids in zip(out["completion_ids"], out["logprobs"], out["logprob_token_ids"]):
        assert [x[0] for x in lp_ids] == ids and len(lps) == len(ids)
    assert info["weight_transfer_config"] == {"backend": "gloo"}


async def test_stock_trl_weight_sync_is_refused_clearly(sim_service):
    client_mod = pytest.importorskip("trl.generation.vllm_client")

    def run():
        client = client_mod.VLLMClient(base_url=f"http://127.0.0.1:{sim_service.http_port}")
        with pytest.raises(NotImplementedError, match="CUDA"):  # stock TRL syncs over NCCL only
            client.init_communicator(device="cpu")

    await asyncio.to_thread(run)


async def test_trl_client_generates_and_pushes_with_a_token():
    """trainer_client.trl's client against a service that requires tokens:
    generation over HTTP, weights over gRPC with increasing versions."""
    pytest.importorskip("trl")
    torch = pytest.importorskip("torch")
    from rollout_service.service import RolloutService
    from trainer_client.trl import RolloutServiceVLLMClient

    from helpers import sim_config

    cfg = sim_config(num_engines=1)
    cfg.auth.weights_tokens = ["weights-secret"]
    service = RolloutService(cfg)
    await service.start()
    try:
        def run():
            client = RolloutServiceVLLMClient(base_url=f"http://127.0.0.1:{service.http_port}",
                                              rollout_address=f"127.0.0.1:{service.grpc_port}", token="weights-secret")
            try:
                client.init_communicator(device="cpu")
                first = client.generate([[1, 10, 11]], n=2, max_tokens=4)
                versions = [client.last_generation_versions]
                weights = {"w": torch.ones(2, 3)}
                client.update_named_params([("w", "float32", [2, 3])], iter(weights.items()))
                with client.weight_update():
                    client.update_named_params([("w", "float32", [2, 3])], iter(weights.items()))
                client.generate([[1, 10, 11]], n=2, max_tokens=4)
                versions.append(client.last_generation_versions)
                return first, versions, client.policy_version, client.pushes
            finally:
                client.close()

        first, versions, pushed, pushes = await asyncio.to_thread(run)
        assert len(first["completion_ids"]) == 2
        assert pushes == 2 and pushed == 2 and service.core.policy_version == 2
        assert versions == [(0, 0), (2, 2)]
    finally:
        await service.stop()
