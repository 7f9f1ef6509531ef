"""TRL's GRPOTrainer on the service: generation through the side server's
`vllm serve` surface, weights pushed over gRPC (trainer_client.trl)."""
from __future__ import annotations

import asyncio
import copy
import json
import time

import pytest

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

MAX_COMPLETION = 64


def _train(base_url: str, grpc_address: str, model_dir: str, out_dir: str) -> dict:
    """Two optimizer steps of TRL's GRPOTrainer (run in a thread: the service
    shares this process's event loop)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from trl import GRPOConfig

    from rollout_service.tasks import generate_problems, verify
    from trainer_client.trl import GRPOTrainer

    torch.manual_seed(0)
    problems = [p for p in generate_problems(400, seed=7) if len(p.solution) < MAX_COMPLETION - 4]
    problems = list({p.prompt: p for p in problems}.values())[:32]
    by_prompt = {p.prompt: p for p in problems}
    dataset = Dataset.from_list([{"prompt": p.prompt} for p in problems])

    def correctness(prompts, completions, **_):
        return [verify(by_prompt[p], c) for p, c in zip(prompts, completions)]

    def brevity(completion_ids, **_):  # a small tie-breaker: fewer groups without a gradient
        return [-len(ids) / MAX_COMPLETION for ids in completion_ids]

    args = GRPOConfig(
        output_dir=out_dir, max_steps=2, per_device_train_batch_size=16, num_generations=4,
        max_completion_length=MAX_COMPLETION, learning_rate=1e-3, beta=0.0, temperature=1.0,
        use_vllm=True, vllm_mode="server", vllm_server_base_url=base_url, vllm_server_timeout=30,
        reward_weights=[1.0, 0.1], bf16=False, use_cpu=True, report_to="none", logging_steps=1, save_strategy="no",
        disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # The model's tokenizer.json as written (one token per character).
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    initial = copy.deepcopy(model)
    trainer = GRPOTrainer(model=model, reward_funcs=[correctness, brevity], args=args, train_dataset=dataset,
                          processing_class=tokenizer, rollout_address=grpc_address)
    client = trainer.rollout_client
    start_version = client.policy_version

    # Record, per generation, the version pushed just before it and the
    # versions the service says sampled its tokens.
    generations = []
    generate = trainer.vllm_generation.generate

    def spy(*a, **k):
        out = generate(*a, **k)
        generations.append((client.policy_version, client.last_generation_versions, len(out[1])))
        return out

    trainer.vllm_generation.generate = spy
    t0 = time.perf_counter()
    try:
        trainer.train()
    finally:
        client.close()
    seconds = time.perf_counter() - t0
    before = dict(initial.named_parameters())
    changed = max((p.detach() - before[n]).abs().max().item() for n, p in model.named_parameters())
    return {"start_version": start_version, "generations": generations, "pushes": client.pushes,
            "final_version": client.policy_version, "global_step": trainer.state.global_step,
            "seconds": seconds, "max_weight_change": changed, "model": model, "initial": initial,
            "tokenizer": trainer.processing_class, "prompt": problems[0].prompt, "log": trainer.state.log_history}


async def _post(port: int, path: str, body: dict) -> tuple[int, dict]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://127.0.0.1:{port}{path}", json=body) as r:
            return r.status, await r.json()


@pytest.fixture(scope="module")
async def trained(vllm_service, tmp_path_factory):
    """One TRL training run against the session's service."""
    from trainer_client import RolloutClient

    async with RolloutClient(f"127.0.0.1:{vllm_service.grpc_port}") as client:
        before = (await client.status()).policy_version
    run = await asyncio.to_thread(
        _train, f"http://127.0.0.1:{vllm_service.http_port}", f"127.0.0.1:{vllm_service.grpc_port}",
        vllm_service.config.engine.model, str(tmp_path_factory.mktemp("trl")))
    run["before"] = before
    print(json.dumps({k: run[k] for k in ("before", "start_version", "generations", "pushes", "final_version",
                                          "seconds", "max_weight_change")}))
    return run


async def _served_logprobs(vllm_service, run) -> dict:
    """A fresh completion from the service, with the trained and the initial
    model's logprobs of its tokens."""
    import torch

    model, tok = run["model"], run["tokenizer"]
    prompt = tok(run["prompt"])["input_ids"]
    status, reply = await _post(vllm_service.http_port, "/v1/completions",
                                {"prompt": prompt, "max_tokens": 24, "temperature": 1.0, "logprobs": 0,
                                 "return_token_ids": True, "return_tokens_as_token_ids": True})
    assert status == 200, reply
    choice = reply["choices"][0]
    assert choice["prompt_token_ids"] == prompt
    ids = choice["token_ids"]

    def logprobs(m):
        with torch.no_grad():
            logits = m(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
        return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(ids)[:, None])[:, 0]

    served = torch.tensor(choice["logprobs"]["token_logprobs"])
    gaps = {"policy_version": reply["policy_version"],
            "trained_gap": (logprobs(model) - served).abs().max().item(),
            "initial_gap": (logprobs(run["initial"]) - served).abs().max().item()}
    print(json.dumps(gaps))
    return gaps


async def test_grpo_trainer_generates_on_the_service_and_pushes_its_weights(trained, vllm_service, vclient):
    run, before = trained, trained["before"]
    # Two optimizer steps, each on completions the service generated with
    # the weights pushed just before (the step's policy).
    assert run["global_step"] == 2 and run["start_version"] == before
    assert len(run["generations"]) == 2
    for step, (pushed, versions, n) in enumerate(run["generations"]):
        assert pushed == before + 1 + step
        assert versions == (pushed, pushed), f"step {step}: tokens sampled by versions {versions}, pushed {pushed}"
        assert n == 16
    assert run["max_weight_change"] > 0  # the optimizer did change the policy
    # The final weights were pushed too, and the service serves them.
    assert run["pushes"] == 3 and run["final_version"] == before + 3
    status = await vclient.status()
    assert status.policy_version == before + 3
    assert all(e.policy_version == before + 3 for e in status.engines)
    served = await _served_logprobs(vllm_service, run)
    assert served["policy_version"] == before + 3
    assert served["trained_gap"] < served["initial_gap"]  # the trained policy, not the initial one


async def test_the_service_serves_exactly_the_trained_weights(trained, vllm_service):
    served = await _served_logprobs(vllm_service, trained)
    assert served["trained_gap"] < 2e-4  # float32 on both sides: kernels differ, weights do not
