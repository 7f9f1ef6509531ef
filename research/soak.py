"""Soak run: the closed-loop driver for a fixed time against the live service
over loopback, with engines killed at random intervals. Reports samples
lost and duplicated (goal: 0 and 0) and the server's memory over time.

    python -m research.soak --minutes 30 --kill-every 60 [--engine sim|vllm] [--report DIR]

Kills: a vLLM engine's engine-core process gets SIGKILL; a simulated engine
is closed under its requests. Either way the core re-queues the partial
responses and restarts the engine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import psutil

from rollout_service.config import EngineConfig, ServiceConfig
from rollout_service.service import RolloutService
from trainer_client import PromptGroup, RolloutClient


async def kill_one(service: RolloutService, rng: random.Random) -> str:
    engine = rng.choice(list(service.core.engines.values()))
    pid = getattr(engine, "engine_core_pid", None)
    if pid:
        os.kill(pid, signal.SIGKILL)
    else:
        await engine.close()
    return engine.engine_id


async def soak(args) -> dict:
    engine = EngineConfig(kind=args.engine, num_engines=args.engines, max_seqs=64)
    if args.engine == "sim":
        engine.sim = {"decode_base_s": 0.02, "length_median": 120, "length_sigma": 1.0}
    service = RolloutService(ServiceConfig(grpc_port=0, http_port=0, engine=engine))
    await service.start()
    proc = psutil.Process()
    rng = random.Random(args.seed)
    deadline = time.monotonic() + args.minutes * 60
    submitted: set[str] = set()
    seen: dict[str, int] = {}
    memory, kills, steps = [], [], 0
    next_kill = time.monotonic() + rng.expovariate(1 / args.kill_every)
    t0 = time.monotonic()
    try:
        async with RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id="soak") as client:
            async def consume():
                async for s in client.stream(ack_every=32):
                    seen[s.sample_id] = seen.get(s.sample_id, 0) + 1

            consumer = asyncio.create_task(consume())
            while time.monotonic() < deadline:
                groups = [PromptGroup(prompt_token_ids=[1, 5, 7, (steps * 31 + i) % 50 + 4], num_samples=8,
                                      max_tokens=512, temperature=1.0, group_id=f"s{steps}-{i}")
                          for i in range(args.groups_per_step)]
                await client.submit(groups)
                want = {f"{g.group_id}/{j}" for g in groups for j in range(8)}
                submitted |= want
                while want - seen.keys():
                    if time.monotonic() > next_kill:
                        kills.append((round(time.monotonic() - t0, 1), await kill_one(service, rng)))
                        next_kill = time.monotonic() + rng.expovariate(1 / args.kill_every)
                    await asyncio.sleep(0.2)
                await client.push_weights({"w": np.full(16, steps, np.float32)}, version=steps + 1)
                steps += 1
                memory.append((round(time.monotonic() - t0, 1), proc.memory_info().rss // 2**20))
                if steps % 10 == 0:
                    print(f"[{time.monotonic() - t0:7.0f}s] step {steps}: {len(seen)} samples, {len(kills)} kills, "
                          f"rss {memory[-1][1]} MiB", flush=True)
            status = await client.status()
            consumer.cancel()
    finally:
        await service.stop()
    result = {
        "minutes": args.minutes, "engine": args.engine, "engines": args.engines, "steps": steps,
        "samples_submitted": len(submitted), "samples_delivered": sum(1 for k in submitted if k in seen),
        "samples_lost": len(submitted - seen.keys()), "samples_duplicated": sum(n - 1 for n in seen.values() if n > 1),
        "kills": kills, "engine_restarts": status.counters.get("engine_restarts", 0),
        "rss_mib": memory,
    }
    print(f"soak: {steps} steps, {result['samples_delivered']}/{len(submitted)} samples delivered, "
          f"lost {result['samples_lost']}, duplicated {result['samples_duplicated']}, {len(kills)} kills, "
          f"rss {memory[0][1] if memory else 0} -> {memory[-1][1] if memory else 0} MiB")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--kill-every", type=float, default=60, help="mean seconds between engine kills")
    p.add_argument("--engine", choices=["sim", "vllm"], default="sim")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--groups-per-step", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report")
    args = p.parse_args()
    result = asyncio.run(soak(args))
    if args.report:
        out = Path(args.report)
        out.mkdir(parents=True, exist_ok=True)
        (out / "soak.json").write_text(json.dumps(result, indent=2))
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.plot([t / 60 for t, _ in result["rss_mib"]], [m for _, m in result["rss_mib"]])
        for t, _ in result["kills"]:
            ax.axvline(t / 60, color="red", alpha=0.3)
        ax.set_xlabel("minutes (red: engine killed)")
        ax.set_ylabel("server RSS (MiB)")
        ax.set_title(f"soak: {result['samples_lost']} lost, {result['samples_duplicated']} duplicated")
        fig.tight_layout()
        fig.savefig(out / "soak_memory.png", dpi=120)


if __name__ == "__main__":
    from research.interrupt import stop_on_sigterm

    stop_on_sigterm()
    main()
