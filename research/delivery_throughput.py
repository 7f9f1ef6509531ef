"""How fast completed samples reach one trainer over loopback.

Starts the service on simulated engines whose steps cost (almost) nothing, so
the figure measures the service itself: core bookkeeping, delivery log,
protobuf encoding, gRPC streaming and the client's decoding. Each size runs
without and with a `state_dir` (the write-ahead journal, synced by group
commit) side by side, and prints the journal's cost as the ratio. Each
size runs `--repeats` pairs, alternating, and reports the median ratio and
its range: one pair of 2-second runs moves by several percent on a busy host.

    python -m research.delivery_throughput [--quick] [--repeats N] [--report DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from rollout_service.config import EngineConfig, ServiceConfig
from rollout_service.service import RolloutService
from trainer_client import PromptGroup, RolloutClient


async def measure(groups: int, samples: int, length: int, engines: int, state_dir: str = "") -> dict:
    sim = {"decode_base_s": 0.0, "decode_per_seq_s": 0.0, "prefill_per_token_s": 0.0, "max_seqs": 256}
    cfg = ServiceConfig(grpc_port=0, http_port=0, engine=EngineConfig(kind="sim", num_engines=engines, max_seqs=256, sim=sim),
                        state_dir=state_dir)
    service = RolloutService(cfg)
    await service.start()
    try:
        async with RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id="bench") as client:
            lengths = ",".join([str(length)] * samples)
            t0 = time.perf_counter()
            await client.submit(
                PromptGroup(prompt_token_ids=[1, 5, 6, 7], num_samples=samples, max_tokens=length + 1,
                            group_id=f"b{i}", metadata={"sim.target_lengths": lengths})
                for i in range(groups)
            )
            n = tokens = 0
            first = None
            async for s in client.stream():
                first = first or time.perf_counter()
                n += 1
                tokens += len(s.response_token_ids)
                if n == groups * samples:
                    break
            wall = time.perf_counter() - t0
    finally:
        await service.stop()
    return {
        "journal": bool(state_dir),
        "samples": n,
        "tokens": tokens,
        "response_length": length,
        "engines": engines,
        "wall_s": round(wall, 3),
        "samples_per_s": round(n / wall, 1),
        "tokens_per_s": round(tokens / wall, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small run (CI)")
    p.add_argument("--report", help="directory for delivery_throughput.json")
    p.add_argument("--repeats", type=int, default=3, help="pairs (no state, journal) per size (default 3)")
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    groups = 64 if args.quick else 512
    results = []
    for length in (32, 512):
        ratios = []
        for _ in range(args.repeats):
            pair = []
            for journal in (False, True):
                with tempfile.TemporaryDirectory(prefix="delivery-state-") as state_dir:
                    r = asyncio.run(measure(groups, 8, length, engines=4, state_dir=state_dir if journal else ""))
                pair.append(r)
                results.append(r)
                print(f"{r['samples']:>6} samples x {length:>4} tokens, {'journal' if journal else 'no state':>8}: "
                      f"{r['samples_per_s']:>8.0f} samples/s {r['tokens_per_s']:>10.0f} tokens/s  ({r['wall_s']} s)",
                      flush=True)
            ratio = pair[1]["samples_per_s"] / pair[0]["samples_per_s"]
            pair[1]["ratio_to_no_state"] = round(ratio, 3)
            ratios.append(ratio)
        median = statistics.median(ratios)
        print(f"{'':>6} journal / no state at {length} tokens: {median:.2f} median of {len(ratios)} pairs "
              f"({min(ratios):.2f}-{max(ratios):.2f}; {(1 - median) * 100:+.0f}% cost)", flush=True)
    if args.report:
        out = Path(args.report)
        out.mkdir(parents=True, exist_ok=True)
        (out / "delivery_throughput.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    from research.interrupt import stop_on_sigterm

    stop_on_sigterm()
    main()
