"""`rollout-service selftest`: the GPU path, end to end, on this machine.

Starts a service on 2 vLLM engines of the bundled tiny reasoner (speculating
with the bundled drafter) and checks, in order, through the real client:

1. `plan`: the device plan puts the engines on disjoint GPUs (CPU: cores);
2. `start`: both engines start;
3. `devices`: each engine's workers report a GPU (by UUID) or cores that
   the other's do not;
4. `generate`: both engines sample, tagged version 0, and every served
   logprob matches transformers' recomputation on the model's weights;
5. `push-grpc`, 6. `push-collective` (NCCL on GPUs, gloo on a CPU):
   perturbed weights pushed, the reply's version on every engine and every
   token, logprobs matching the pushed weights and not the previous ones;
7. `speculation`: the drafter proposes and the engines accept on each engine;
8. `push-draft`: draft weights pushed (model runner V2's `get_draft_model`
   on GPUs), and speculation goes on accepting.

Each check is timed; the report says pass, fail or skip (with the reason).
The NCCL push needs a GPU of its own for the trainer's rank (NCCL refuses
two ranks on one device): 3 GPUs, else it is skipped.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from rollout_service.assets import tiny_draft_path, tiny_model_path
from rollout_service.config import EngineConfig, ServiceConfig
from rollout_service.device_plan import FleetPlan, Platform

# Four short prompts of the tiny reasoner's vocabulary, each sampled on both engines.
PROMPTS = [[1, 40, 41, 42, 14], [1, 55, 20, 33, 14], [1, 60, 61, 12, 30], [1, 25, 26, 27, 28]]
MAX_TOKENS = 24
# Served logprobs against transformers' float32 recomputation (nats): the
# largest gap allowed, and the smallest gap against weights that were not
# pushed (the check could fail: the perturbation is visible in every sample).
TOLERANCE = {"cpu": 1e-3, "cuda": 2e-2}
DISTINCT = 0.1


@dataclass(slots=True)
class Check:
    name: str
    status: str = "skip"  # pass | fail | skip
    seconds: float = 0.0
    detail: str = ""


@dataclass(slots=True)
class Report:
    platform: str
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not any(c.status == "fail" for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {"platform": self.platform, "passed": self.passed, "checks": [dataclasses.asdict(c) for c in self.checks]}

    def describe(self) -> str:
        width = max(len(c.name) for c in self.checks)
        lines = [f"rollout-service selftest on {self.platform}: 2 engines of {tiny_model_path().name}",
                 f"{'check':<{width}}  result  seconds  detail"]
        lines += [f"{c.name:<{width}}  {c.status:<6}  {c.seconds:>7.1f}  {c.detail}" for c in self.checks]
        counts = {s: sum(c.status == s for c in self.checks) for s in ("pass", "fail", "skip")}
        lines.append(f"{'PASSED' if self.passed else 'FAILED'}: {counts['pass']} passed, {counts['fail']} failed, "
                     f"{counts['skip']} skipped")
        return "\n".join(lines)


class CheckFailed(Exception):
    pass


class Skipped(Exception):
    pass


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def selftest_config() -> ServiceConfig:
    """2 engines of the bundled reasoner speculating with the bundled drafter
    (K=3 at every batch size), small batches and context."""
    spec = {"method": "draft_model", "model": str(tiny_draft_path()), "num_speculative_tokens": 3,
            "schedule": [[1, 16, 3]]}
    engine = EngineConfig(kind="vllm", num_engines=2, model=str(tiny_model_path()), max_seqs=16, max_model_len=256,
                          gpu_memory_utilization=0.3, spec=spec)
    return ServiceConfig(grpc_port=0, http_port=0, engine=engine)


def perturbed(weights: dict, seed: int) -> dict:
    """`weights` with every matrix moved by half its standard deviation of noise."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=g) if v.ndim == 2 else v for k, v in weights.items()}


def max_logprob_gap(samples, model_dir: str, weights) -> float:
    """The largest |served logprob - transformers' recomputation| (nats)
    over every response token of `samples`, the model at `model_dir` loaded
    with `weights` (a state dict), on the CPU in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict({k: v.detach().to("cpu", torch.float32) for k, v in weights.items()}, strict=False)
    model.tie_weights()
    worst = 0.0
    for s in samples:
        ids = torch.tensor([s.prompt_token_ids + s.response_token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(s.prompt_token_ids) - 1: -1]
        ref = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(s.response_token_ids)[:, None])[:, 0]
        worst = max(worst, float((ref - torch.tensor(s.logprobs, dtype=torch.float64)).abs().max()))
    return worst


class SelfTest:
    """The checks, in order, on one service; `run()` returns the report."""

    def __init__(self, platform: str = "auto", timeout_s: float = 600.0) -> None:
        self.requested = platform
        self.timeout_s = timeout_s  # bound on each check
        self.report = Report(platform)
        self.cfg = selftest_config()
        self.plan: FleetPlan | None = None
        self.machine: Platform | None = None
        self.service = None
        self.client = None
        self.weights: dict = {}  # what serves now
        self.samples: list = []  # the last samples generated

    async def check(self, name: str, body: Callable[[], Awaitable[str]], needs: bool = True) -> bool:
        c = Check(name)
        self.report.checks.append(c)
        if not needs:
            c.detail = "not run: an earlier check failed"
            return False
        t0 = time.perf_counter()
        try:
            c.detail = await asyncio.wait_for(body(), self.timeout_s)
            c.status = "pass"
        except Skipped as exc:
            c.detail = str(exc)
        except CheckFailed as exc:
            c.status, c.detail = "fail", str(exc)
        except Exception as exc:  # reported; the next checks still run
            c.status, c.detail = "fail", f"{type(exc).__name__}: {exc}"
        c.seconds = time.perf_counter() - t0
        return c.status == "pass"

    async def run(self) -> Report:
        from safetensors.torch import load_file

        self.weights = load_file(os.path.join(tiny_model_path(), "model.safetensors"))
        if not await self.check("plan", self.check_plan):
            for name in ("start", "devices", "generate", "push-grpc", "push-collective", "speculation", "push-draft"):
                await self.check(name, None, needs=False)
            return self.report
        try:
            up = await self.check("start", self.start)
            await self.check("devices", self.check_devices, up)
            await self.check("generate", self.check_generate, up)
            await self.check("push-grpc", self.check_push_grpc, up)
            await self.check("push-collective", self.check_push_collective, up)
            await self.check("speculation", self.check_speculation, up)
            await self.check("push-draft", self.check_push_draft, up)
        finally:
            await self.stop()
        return self.report

    # -- the checks ---------------------------------------------------------------

    async def check_plan(self) -> str:
        from rollout_service.factory import fleet_plan, model_info

        machine = Platform.detect()
        self.report.platform = machine.name
        if self.requested not in ("auto", machine.name):
            raise CheckFailed(f"--platform {self.requested}: this machine runs vLLM's {machine.name} platform")
        if machine.name == "cuda" and len(machine.devices) < 2:
            raise CheckFailed(f"2 engines need 2 GPUs; {len(machine.devices)} visible (CUDA_VISIBLE_DEVICES)")
        self.machine = machine
        self.plan = fleet_plan(self.cfg.engine, model_info(self.cfg.engine), machine)
        a, b = self.plan.engines
        if machine.name == "cuda":
            expect(a.devices and b.devices and not set(a.devices) & set(b.devices),
                   f"engines planned on GPUs {a.devices} and {b.devices}")
            return f"{a.id} on GPU {','.join(a.devices)}, {b.id} on GPU {','.join(b.devices)}"
        return f"{a.id} on cores {a.cpu_bind}, {b.id} on cores {b.cpu_bind}"

    async def start(self) -> str:
        from rollout_service.service import RolloutService
        from trainer_client import RolloutClient

        self.service = RolloutService(self.cfg)
        await self.service.start()
        self.client = RolloutClient(f"127.0.0.1:{self.service.grpc_port}", consumer_id="selftest")
        return f"{len(self.service.core.engines)} engines ready"

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.close()
        if self.service is not None:
            await self.service.stop()

    async def check_devices(self) -> str:
        engines = list(self.service.core.engines.values())
        reports = [await e.device_report() for e in engines]
        if self.report.platform == "cuda":
            owned = [{w["uuid"] for w in r} for r in reports]
            expect(all(owned) and not owned[0] & owned[1], f"engines on GPUs {owned[0]} and {owned[1]}")
            for e, r, p in zip(engines, reports, self.plan.engines):
                expect(all(w["visible"] == ",".join(p.devices) for w in r),
                       f"{e.engine_id}'s workers see CUDA_VISIBLE_DEVICES {[w['visible'] for w in r]}, planned "
                       f"{','.join(p.devices)}")
            return "; ".join(f"{e.engine_id}: {', '.join(w['device'] + ' ' + w['uuid'][:13] for w in r)}"
                             for e, r in zip(engines, reports))
        cores = [set().union(*(w["cores"] for w in r)) for r in reports]
        if len(os.sched_getaffinity(0)) < 2:
            raise Skipped("one core: the engines share it")
        expect(not cores[0] & cores[1], f"engines' threads run on cores {sorted(cores[0])} and {sorted(cores[1])}")
        return "; ".join(f"{e.engine_id}: cores {','.join(map(str, sorted(c)))}" for e, c in zip(engines, cores))

    async def generate(self, version: int, temperature: float = 1.0) -> list:
        """2 samples of each prompt (one group each), on both engines, tagged `version`."""
        from trainer_client import PromptGroup

        tag = f"selftest-{time.monotonic_ns()}"
        await self.client.submit([PromptGroup(prompt_token_ids=p, num_samples=1, max_tokens=MAX_TOKENS,
                                              temperature=temperature, group_id=f"{tag}-{i}")
                                  for i, p in enumerate(PROMPTS + PROMPTS)])
        samples = []
        async for s in self.client.stream():
            if s.group_id.startswith(tag):
                samples.append(s)
                if len(samples) == 2 * len(PROMPTS):
                    break
        served = sorted({e for s in samples for e in s.engines})
        expect(len(served) == 2, f"the samples ran on {served} only")
        tags = sorted({v for s in samples for v in (s.min_version, s.max_version)})
        expect(tags == [version], f"tokens tagged versions {tags}, expected {version}")
        self.samples = samples
        return samples

    async def logprobs_match(self, samples, weights, other) -> str:
        tol = TOLERANCE[self.report.platform]
        model = str(tiny_model_path())
        gap = await asyncio.to_thread(max_logprob_gap, samples, model, weights)
        expect(gap < tol, f"served logprobs differ from the weights' by up to {gap:.2g} nats (tolerance {tol:g})")
        off = await asyncio.to_thread(max_logprob_gap, samples, model, other)
        expect(off > DISTINCT, f"served logprobs are within {off:.2g} nats of weights that were not pushed")
        return f"logprobs within {gap:.1g} nats of the weights"

    async def check_generate(self) -> str:
        samples = await self.generate(0)
        tokens = sum(len(s.response_token_ids) for s in samples)
        return f"{tokens} tokens on 2 engines, version 0; " + await self.logprobs_match(
            samples, self.weights, perturbed(self.weights, seed=99))

    async def check_push_grpc(self) -> str:
        version = (await self.client.status()).policy_version + 1
        new = perturbed(self.weights, seed=1)
        reply = await self.client.push_weights(new, version)
        return await self.pushed(reply, version, new, "gRPC")

    async def check_push_collective(self) -> str:
        version = (await self.client.status()).policy_version + 1
        new = perturbed(self.weights, seed=2)
        backend = "gloo"
        if self.report.platform == "cuda":
            import torch

            used = {d for e in self.plan.engines for d in e.devices}
            spare = [i for i, d in enumerate(self.machine.devices) if d not in used]
            if not spare:
                raise Skipped("NCCL needs a GPU for the trainer's rank besides the engines': 3 GPUs")
            torch.cuda.set_device(spare[0])
            new = {k: v.to(f"cuda:{spare[0]}") for k, v in new.items()}
            backend = "nccl"
        reply = await self.client.push_weights_collective(new, version, backend=backend, timeout_s=60)
        await self.client.close_collective()
        return await self.pushed(reply, version, new, backend)

    async def pushed(self, reply, version: int, new: dict, how: str) -> str:
        expect(reply.applied_version == version, f"the push replied version {reply.applied_version}, not {version}")
        status = await self.client.status()
        engines = {e.engine_id: e.policy_version for e in status.engines}
        expect(set(engines.values()) == {version}, f"engines at versions {engines} after pushing {version}")
        samples = await self.generate(version)
        previous, self.weights = self.weights, new
        return f"version {version} over {how} in {reply.seconds:.2f} s; " + await self.logprobs_match(
            samples, new, previous)

    async def check_speculation(self) -> str:
        samples = self.samples or await self.generate((await self.client.status()).policy_version)
        counts = {}  # engine -> (drafted, accepted)
        for eid in sorted({s.engines[-1] for s in samples}):
            on = [s for s in samples if s.engines[-1] == eid]
            counts[eid] = (sum(s.draft_tokens for s in on), sum(s.accepted_tokens for s in on))
            expect(all(counts[eid]), f"{eid} drafted {counts[eid][0]} tokens, accepted {counts[eid][1]}")
        return "; ".join(f"{eid}: {a}/{d} drafts accepted" for eid, (d, a) in counts.items())

    async def check_push_draft(self) -> str:
        from safetensors.torch import load_file

        status = await self.client.status()
        draft = load_file(os.path.join(tiny_draft_path(), "model.safetensors"))
        version = status.spec.draft_version + 1
        reply = await self.client.push_weights(draft, version, target="draft")
        expect(reply.applied_version == version, f"the draft push replied version {reply.applied_version}")
        self.samples = []
        await self.generate(status.policy_version)
        return f"draft version {version}; " + await self.check_speculation()


def run_selftest(platform: str = "auto", as_json: bool = False, timeout_s: float = 600.0) -> int:
    """Run the checks and print the report; 0 if none failed, else 1."""
    # The report is what this command prints: vLLM (here and in its engine
    # processes) logs through logging, warnings only, to stderr.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    report = asyncio.run(SelfTest(platform, timeout_s).run())
    print(json.dumps(report.to_dict(), indent=2) if as_json else report.describe(), flush=True)
    return 0 if report.passed else 1
