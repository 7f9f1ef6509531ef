"""A finite session: start the service, run a short GRPO-style client
session on the tiny reasoning task, print a summary, stop."""
from __future__ import annotations

import dataclasses
import statistics
import time

from rollout_service.config import ServiceConfig
from rollout_service.service import RolloutService
from rollout_service.tasks import decode, generate_problems, prompt_token_ids, verify
from trainer_client import PromptGroup, RolloutClient


async def run_demo(cfg: ServiceConfig, groups: int = 16, samples: int = 8, max_tokens: int = 256) -> int:
    cfg = dataclasses.replace(cfg, grpc_port=0, http_port=0)
    service = RolloutService(cfg)
    print(f"starting the service ({cfg.engine.num_engines} {cfg.engine.kind} engine(s)) ...", flush=True)
    t_start = time.perf_counter()
    await service.start()
    print(f"  up in {time.perf_counter() - t_start:.1f}s on gRPC port {service.grpc_port}", flush=True)
    try:
        problems = {f"demo-{i}": p for i, p in enumerate(generate_problems(groups, seed=7))}
        async with RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id="demo") as client:
            t0 = time.perf_counter()
            await client.submit(
                PromptGroup(
                    prompt_token_ids=prompt_token_ids(p), num_samples=samples, max_tokens=max_tokens,
                    temperature=1.0, group_id=gid, prompt_id=gid,
                )
                for gid, p in problems.items()
            )
            print(f"submitted {groups} groups x {samples} samples; streaming ...", flush=True)
            done, tokens, rewards, lengths = 0, 0, [], []
            async for group in client.groups():
                done += 1
                for s in group:
                    tokens += len(s.response_token_ids)
                    lengths.append(len(s.response_token_ids))
                    rewards.append(verify(problems[s.group_id], decode(s.response_token_ids)))
                if done % max(1, groups // 4) == 0 or done == groups:
                    print(f"  {done}/{groups} groups complete ({time.perf_counter() - t0:.1f}s)", flush=True)
                if done == groups:
                    break
            wall = time.perf_counter() - t0
            status = await client.status()
    finally:
        await service.stop()
    n = len(lengths)
    print("\nsummary")
    print(f"  engines            {cfg.engine.num_engines} x {cfg.engine.kind}")
    print(f"  samples            {n} in {done} groups")
    print(f"  wall time          {wall:.2f} s")
    print(f"  throughput         {n / wall:.1f} samples/s, {tokens / wall:.0f} tokens/s")
    print(f"  response length    median {statistics.median(lengths):.0f}, max {max(lengths)} tokens")
    note = " (simulated engines emit random tokens)" if cfg.engine.kind == "sim" else ""
    print(f"  pass rate          {statistics.mean(rewards):.1%}{note}")
    print(f"  policy version     {status.policy_version}")
    return 0
