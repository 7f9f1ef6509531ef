"""Helpers shared by the test modules (fixtures live in conftest.py).

A test module imports from here, never from another test module or from
conftest. Heavy imports (torch, safetensors, transformers, vllm) stay inside
the functions that need them, so the fast tier does not pay for them."""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import socket
import time
import uuid

from rollout_service.config import EngineConfig, ServiceConfig
from rollout_service.service import RolloutService
from trainer_client import RolloutClient

# -- services on loopback ports ---------------------------------------------------

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


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def connect(service: RolloutService, prefix: str, **kwargs) -> RolloutClient:
    """The real client on a service, as a consumer of its own."""
    return RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id=unique(prefix), **kwargs)


def check_versions(sample, allowed: set[int]) -> None:
    """Every response token is tagged, segments in order, versions never go back."""
    assert sum(n for _, _, n in sample.versions) == len(sample.response_token_ids)
    starts = [s for _, s, _ in sample.versions]
    assert starts == sorted(starts)
    versions = [v for v, _, _ in sample.versions]
    assert versions == sorted(versions) and set(versions) <= allowed, sample.versions


async def rollout_through_a_kill(client: RolloutClient, core, victim_id: str, timeout: float = 120.0) -> list:
    """16 groups of 8 (60 to 300 tokens each) submitted; once `victim_id`
    runs a request with tokens, the process holding it is SIGKILLed (its
    `host_pid`) and, while it is down, version 1 is pushed, which every
    engine still up applies. Returns the 128 samples."""
    import signal

    import numpy as np
    from trainer_client import PromptGroup

    prefix = unique("k")
    await client.submit([PromptGroup(prompt_token_ids=[1, 5, i], num_samples=8, max_tokens=400, group_id=f"{prefix}-{i}",
                                     metadata={"sim.target_lengths": "60,300,120,200"}) for i in range(16)])
    victim = core.engines[victim_id]
    await wait_until(lambda: any(r.engine_id == victim_id and len(r.token_ids) > 5 for r, _ in core.running.values()),
                     60, f"a request with tokens on {victim_id}")
    os.kill(victim.host_pid, signal.SIGKILL)
    await wait_until(lambda: victim.load().state != "ready", 60, "the death to be seen")
    reply = await client.push_weights({"w": np.ones((64, 64), np.float32)}, version=1)
    assert reply.applied_version == 1
    assert all(e.load().policy_version == 1 for e in core.engines.values() if e.load().state == "ready")
    return await collect(client, prefix, 128, timeout=timeout)


def free_port() -> int:
    """A loopback TCP port nothing listens on (for a server started as a subprocess)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def collect(client: RolloutClient, prefix: str, count: int, timeout: float = 60.0):
    """The next `count` streamed samples whose group id starts with `prefix`
    (fails after `timeout` seconds)."""
    out = []

    async def run():
        async for s in client.stream():
            if s.group_id.startswith(prefix):
                out.append(s)
                if len(out) == count:
                    return

    await asyncio.wait_for(run(), timeout)
    return out


# -- bounded waits -------------------------------------------------------------------

async def wait_until(condition, timeout: float, what: str = "the condition", interval: float = 0.05):
    """Poll `condition()` (a function, or one returning an awaitable) every
    `interval` seconds until it is true, and return its value; fail naming
    `what` once `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(interval)


def wait_until_sync(condition, timeout: float, what: str = "the condition", interval: float = 0.1):
    """`wait_until` for tests without an event loop."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


# -- the bundled tiny model on real vLLM engines -------------------------------------

# Four short prompts of the tiny reasoner's vocabulary.
PROMPTS = [[1, 40, 41, 42, 14], [1, 55, 20, 33, 14], [1, 60, 61, 12, 30], [1, 25, 26, 27, 28]]


def vllm_model() -> str:
    """The bundled tiny reasoner (ROLLOUT_TEST_MODEL overrides it)."""
    from rollout_service.factory import default_model_path

    return os.environ.get("ROLLOUT_TEST_MODEL") or default_model_path()


def bundled_weights() -> dict:
    """The bundled model's state dict (a fresh copy each call)."""
    from safetensors.torch import load_file

    return load_file(os.path.join(vllm_model(), "model.safetensors"))


def perturbed(weights: dict, seed: int = 0) -> dict:
    """`weights` with every matrix moved by half its standard deviation of noise."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=g) if v.ndim == 2 else v for k, v in weights.items()}


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


# -- speculative decoding on real vLLM engines ------------------------------------------

SPEC_MAX_SEQS = 64
K = 3
ALWAYS = [[1, SPEC_MAX_SEQS, K]]  # speculate at every batch size (the exactness test needs drafts verified)
TAIL = [[1, 4, K], [5, SPEC_MAX_SEQS, 0]]

# "add 9+6689" and the first 3 tokens of its solution: the tiny reasoner is
# unsure of the next digits, so the joint distribution of 3-token
# completions spreads over ~80 cells (entropy ~3.9 nats at top-p 0.9).
PROMPT = [1, 70, 73, 73, 5, 30, 16, 27, 27, 29, 30, 4, 21, 16, 27]
EXACT_N = 6000  # samples per engine
ALPHA = 1e-3  # the exact path fails the test with this probability


def draft_model() -> str:
    from rollout_service.assets import tiny_draft_path

    return os.environ.get("ROLLOUT_TEST_DRAFT") or str(tiny_draft_path())


def spec_cfg(schedule=ALWAYS, **kw) -> dict:
    """`engine.spec` for the bundled drafter."""
    return {"method": "draft_model", "model": draft_model(), "num_speculative_tokens": K, "schedule": schedule, **kw}


def eagle_cfg(head: str, **kw) -> dict:
    """`engine.spec` for the EAGLE head in directory `head`."""
    return {"method": "eagle", "model": head, "num_speculative_tokens": K, "schedule": ALWAYS, **kw}


async def sample(engine, prompt, n, max_tokens=3, temperature=1.0, top_p=0.9, concurrency=SPEC_MAX_SEQS):
    """`n` completions of one prompt straight from an engine: [(token ids, drafted, accepted)]."""
    from rollout_service.engines.types import EngineRequest, SamplingParams

    gate = asyncio.Semaphore(concurrency)
    tag = uuid.uuid4().hex[:8]

    async def one(i):
        req = EngineRequest(f"{tag}-{i}", list(prompt), [], SamplingParams(max_tokens, temperature, top_p), max_tokens)
        ids, drafted, accepted = [], 0, 0
        async with gate:
            async for delta in engine.add(req):
                ids += delta.token_ids
                drafted += delta.draft_tokens
                accepted += delta.accepted_tokens
        return tuple(ids), drafted, accepted

    return await asyncio.gather(*(one(i) for i in range(n)))


async def assert_same_distribution(spec, plain, label: str) -> None:
    """6,000 three-token completions at temperature 1.0, top-p 0.9, with
    speculation (K=3 drafts verified at every step) and without. Stated
    power: 90% to detect 3 points of probability moved between two cells of
    mass 0.1, at level 1e-3 (see `detectable_shift`)."""
    from rollout_service.drafter.exactness import detectable_shift, homogeneity_test

    on, off = await asyncio.gather(sample(spec, PROMPT, EXACT_N), sample(plain, PROMPT, EXACT_N))
    assert sum(d for _, d, _ in on) > EXACT_N, "speculation did not run"
    assert 0 < sum(a for _, _, a in on) < sum(d for _, d, _ in on)  # drafts both accepted and rejected
    result = homogeneity_test([t for t, _, _ in on], [t for t, _, _ in off])
    shift = detectable_shift(result.n_a, result.n_b, result.dof)
    print(f"{label} vs plain: {result}; 90%-power detectable shift {shift:.3f}")
    assert result.dof >= 10 and shift < 0.05
    assert result.p_value > ALPHA, result


def staged(state):
    """A state dict as the engines' weight path takes it."""
    import torch

    from rollout_service.engines.weights import StagedWeights, WeightTensor

    tensors = [WeightTensor(k, "float32", tuple(v.shape), memoryview(v.contiguous().view(-1).view(torch.uint8).numpy()))
               for k, v in state.items()]
    return StagedWeights(tensors)


def problem_prompts(n: int, seed: int) -> list[list[int]]:
    from rollout_service.tasks import generate_problems, prompt_token_ids

    return [prompt_token_ids(p) for p in generate_problems(n, seed=seed)]


async def greedy_acceptance(engine, prompts, max_tokens=200) -> float:
    """Accepted / drafted tokens on the greedy continuations of `prompts`:
    deterministic for given weights, so two drafters compare without
    sampling noise."""
    done = await asyncio.gather(*(sample(engine, p, 1, max_tokens=max_tokens, temperature=0.0) for p in prompts))
    return sum(a for [(_, _, a)] in done) / sum(d for [(_, d, _)] in done)


def swapped(state: dict, a: int, b: int) -> dict:
    """`state` with the embedding rows of tokens a and b exchanged: with
    tied embeddings, the same model writing a and b the other way round."""
    out = dict(state)
    embed = state["model.embed_tokens.weight"].clone()
    embed[[a, b]] = embed[[b, a]]
    out["model.embed_tokens.weight"] = embed
    return out


async def feed_samples(trainer, engine, version: int, prompts) -> None:
    """3 samples (200 tokens, full distribution) of each prompt, given to the
    trainer as produced under policy `version`."""
    done = await asyncio.gather(*(sample(engine, p, 3, max_tokens=200, top_p=1.0, concurrency=3) for p in prompts))
    trainer.add_examples(version, [(p, list(ids)) for p, group in zip(prompts, done) for ids, _, _ in group])


# -- multi-turn trajectories on real vLLM engines ------------------------------------------

TOOL_LATENCY_S = 0.05


async def check_step(req):
    """The `check` environment of the vLLM fleet: checks the line the policy
    just wrote against the reference solution's step (group metadata
    `reference`) and answers with the right step; done after the last step."""
    from rollout_service.lifecycle.types import EnvReply
    from rollout_service.tasks import tokenizer as tok

    await asyncio.sleep(TOOL_LATENCY_S)  # a tool call: the latency is part of what the trajectories measure
    steps = req.metadata["reference"].splitlines()
    if req.turn + 1 >= len(steps):
        return EnvReply(done=True)
    wrote = tok.decode(req.turn_token_ids).strip()
    verdict = "ok" if wrote == steps[req.turn] else "no"
    return EnvReply(observation_token_ids=tok.encode(f"{verdict}> {steps[req.turn]}\n"))


# -- Ray ------------------------------------------------------------------------------------

RAY_STORE = 256 * 1024**2  # object store per node (bytes)


def add_ray_node(cluster):
    """A worker node with 1 CPU. Ray gives a node 30 s to register; a
    loaded machine can take longer to start its Python agents: try again."""
    for attempt in range(3):
        try:
            return cluster.add_node(num_cpus=1, object_store_memory=RAY_STORE)
        except Exception:
            if attempt == 2:
                raise


def ray_config(cluster, **engine) -> ServiceConfig:
    """A service whose engines are Ray actors on `cluster` (`cpus`: CPUs per engine, default 1)."""
    from rollout_service.config import RayConfig

    ray_cfg = RayConfig(address=cluster.address, cpus_per_engine=engine.pop("cpus", 1.0), heartbeat_s=0.1)
    return ServiceConfig(grpc_port=0, http_port=0,
                         engine=EngineConfig(placement_backend="ray", ray=ray_cfg, **engine))


def self_signed(tmp_path):
    """A self-signed certificate for localhost and its key: (cert file, key file) under tmp_path."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)
