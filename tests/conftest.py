"""Shared fixtures: a real service on loopback ports, talked to by the real client."""
from __future__ import annotations

import contextlib
import os
import uuid

import pytest

from rollout_service.config import EngineConfig, ServiceConfig
from rollout_service.service import RolloutService
from trainer_client import RolloutClient

# Fast simulated engines: 1 ms steps, so hundreds of samples finish in seconds.
FAST_SIM = {"decode_base_s": 0.001, "decode_per_seq_s": 0.00002, "length_median": 24, "length_sigma": 0.6}


def sim_config(**engine) -> ServiceConfig:
    engine.setdefault("sim", dict(FAST_SIM))
    return ServiceConfig(grpc_port=0, http_port=0, engine=EngineConfig(kind="sim", **engine))


@contextlib.asynccontextmanager
async def running(cfg: ServiceConfig):
    """A real service started on loopback ports, stopped on exit."""
    service = RolloutService(cfg)
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


def connect(service: RolloutService, prefix: str, **kwargs) -> RolloutClient:
    """The real client on a service, as a consumer of its own."""
    return RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id=unique(prefix), **kwargs)


@pytest.fixture(scope="session")
async def sim_service():
    """One service on 2 simulated engines for the whole session."""
    async with running(sim_config(num_engines=2)) as service:
        yield service


@pytest.fixture
async def client(sim_service):
    async with connect(sim_service, "test") as c:
        yield c


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def vllm_model() -> str:
    """The bundled tiny reasoner (ROLLOUT_TEST_MODEL overrides it)."""
    from rollout_service.factory import default_model_path

    return os.environ.get("ROLLOUT_TEST_MODEL") or default_model_path()


@pytest.fixture(scope="session")
async def vllm_service():
    """One service on 2 real vLLM CPU engines, shared by every test that
    needs real engines (start-up costs ~20 s per engine here)."""
    pytest.importorskip("vllm")
    cfg = ServiceConfig(grpc_port=0, http_port=0,
                        engine=EngineConfig(kind="vllm", num_engines=2, model=vllm_model(), max_model_len=1024, max_seqs=32))
    async with running(cfg) as service:
        yield service


@pytest.fixture
async def vclient(vllm_service):
    async with connect(vllm_service, "v") as c:
        yield c


def max_logprob_gap(samples, model_dir: str, weights) -> float:
    """The largest |served logprob - transformers' recomputation| (nats)
    over every response token of `samples`, the model at `model_dir` loaded
    with `weights` (a state dict)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    worst = 0.0
    for s in samples:
        ids = torch.tensor([s.prompt_token_ids + s.response_token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(s.prompt_token_ids) - 1 : -1]
        ref = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(s.response_token_ids)[:, None])[:, 0]
        worst = max(worst, float((ref - torch.tensor(s.logprobs, dtype=torch.float64)).abs().max()))
    return worst
