"""Rollout throughput through the service vs vLLM driven directly, on the
same engines with the same prompts and seeds (so both produce the same tokens).
Each path starts with the engines' prefix caches emptied, so neither gains
from prompts the other one cached.

    python -m research.bench_vllm_throughput [--groups 32] [--samples 8] [--max-tokens 256] [--rounds 5]

Round 0 warms up; then the two paths alternate which goes first, and the
ratio of their tokens/s is printed per round, with its range and median,
and the pooled ratio (all tokens over all seconds after the warm-up). The
CPU time of this process (the engines' front ends, and for the service path
the server and its client) is printed a token per path: its difference is
what the service's relay costs on top of vLLM's own front end.

The service path is the whole product: gRPC Submit, placement, the engine
protocol, version tagging, the delivery log, gRPC streaming to a client.
The direct path calls `AsyncLLM.generate` on the same engine objects.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from rollout_service.config import EngineConfig, ServiceConfig
from rollout_service.service import RolloutService
from rollout_service.tasks import generate_problems, prompt_token_ids
from trainer_client import PromptGroup, RolloutClient


async def run(args) -> dict:
    # The direct path drives the engines' `AsyncLLM`s, so they run in this process.
    cfg = ServiceConfig(grpc_port=0, http_port=0, engine=EngineConfig(
        kind="vllm", num_engines=args.engines, model=args.model, max_seqs=args.max_seqs, placement_backend="local"))
    service = RolloutService(cfg)
    print(f"starting {args.engines} vLLM engines ...", flush=True)
    await service.start()
    prompts = [prompt_token_ids(p) for p in generate_problems(args.groups, seed=args.seed)]

    async def empty_prefix_caches() -> None:
        done = await asyncio.gather(*(e.async_llm.reset_prefix_cache() for e in service.core.engines.values()))
        if not all(done):
            raise RuntimeError("an engine refused to reset its prefix cache (requests still running?)")

    async def through_service(rnd: int) -> tuple[int, float, float]:
        await empty_prefix_caches()
        async with RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id=f"bench-{rnd}") as client:
            t0, c0 = time.perf_counter(), time.process_time()
            await client.submit(
                PromptGroup(prompt_token_ids=p, num_samples=args.samples, max_tokens=args.max_tokens,
                            temperature=1.0, seed=1000 * i, group_id=f"r{rnd}-g{i}")
                for i, p in enumerate(prompts)
            )
            tokens = n = 0
            async for s in client.stream():
                if not s.group_id.startswith(f"r{rnd}-"):
                    continue  # an earlier round's sample (a new consumer sees what is retained)
                n += 1
                tokens += len(s.response_token_ids)
                if n == args.groups * args.samples:
                    break
            return tokens, time.perf_counter() - t0, time.process_time() - c0

    async def direct(rnd: int) -> tuple[int, float, float]:
        # The same engines, the same requests and seeds, split evenly.
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        engines = list(service.core.engines.values())
        tokens = 0

        async def one(engine, i, j, p):
            nonlocal tokens
            sp = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=1000 * i + j, logprobs=0)
            async for out in engine.async_llm.generate(TokensPrompt(prompt_token_ids=p), sp, f"direct-{rnd}-{i}-{j}"):
                if out.finished:
                    tokens += len(out.outputs[0].token_ids)

        await empty_prefix_caches()
        t0, c0 = time.perf_counter(), time.process_time()
        jobs = [(i, j, p) for i, p in enumerate(prompts) for j in range(args.samples)]
        await asyncio.gather(*(one(engines[k % len(engines)], i, j, p) for k, (i, j, p) in enumerate(jobs)))
        return tokens, time.perf_counter() - t0, time.process_time() - c0

    try:
        results: dict = {}
        ratios = []
        measured = []  # after the warm-up: (tokens, seconds, CPU seconds) of the service path, then of the direct path
        for rnd in range(args.rounds):
            # The order alternates, so that a host getting faster or slower
            # through a run favours neither path.
            service_first = rnd % 2 == 0
            if service_first:
                (tokens, service_s, service_cpu), (direct_tokens, direct_s, direct_cpu) = \
                    await through_service(rnd), await direct(rnd)
            else:
                (direct_tokens, direct_s, direct_cpu), (tokens, service_s, service_cpu) = \
                    await direct(rnd), await through_service(rnd)
            ratio = (tokens / service_s) / (direct_tokens / direct_s)
            if rnd:
                ratios.append(round(ratio, 3))
                measured.append((tokens, service_s, service_cpu, direct_tokens, direct_s, direct_cpu))
            results = {
                "engines": args.engines, "service_tokens": tokens, "direct_tokens": direct_tokens,
                "service_s": round(service_s, 2), "direct_s": round(direct_s, 2),
                "service_tokens_per_s": round(tokens / service_s, 1),
                "direct_tokens_per_s": round(direct_tokens / direct_s, 1),
                "ratio": round(ratio, 3), "ratios_after_warmup": ratios,
                "service_cpu_s": round(service_cpu, 2), "direct_cpu_s": round(direct_cpu, 2),
            }
            first = "service first" if service_first else "direct first"
            print(f"round {rnd}{' (warm-up)' if not rnd else ''}, {first}: "
                  f"service {results['service_tokens_per_s']:.0f} tok/s ({tokens} tokens, {service_s:.1f}s), "
                  f"direct {results['direct_tokens_per_s']:.0f} tok/s ({direct_tokens} tokens, {direct_s:.1f}s), "
                  f"ratio {ratio:.1%}; this process's CPU {service_cpu:.1f}s vs {direct_cpu:.1f}s", flush=True)
        if ratios:
            median = statistics.median(ratios)
            s_tokens, s_secs, s_cpu, d_tokens, d_secs, d_cpu = (sum(column) for column in zip(*measured))
            overall = (s_tokens / s_secs) / (d_tokens / d_secs)
            results["ratio_median"] = round(median, 3)
            results["ratio_pooled"] = round(overall, 3)
            service_us, direct_us = 1e6 * s_cpu / s_tokens, 1e6 * d_cpu / d_tokens
            results["cpu_us_per_token"] = {"service": round(service_us, 1), "direct": round(direct_us, 1)}
            print(f"after the warm-up: service / direct {min(ratios):.1%}-{max(ratios):.1%}, median {median:.1%}, "
                  f"pooled {overall:.1%} over {len(ratios)} rounds; this process's CPU a token: "
                  f"service {service_us:.1f} us, direct {direct_us:.1f} us", flush=True)
    finally:
        await service.stop()
    return results


def main() -> None:
    from rollout_service.factory import default_model_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=default_model_path())
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--max-seqs", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5,
                   help="the first round warms up; the order of the two paths alternates by round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report")
    args = p.parse_args()
    r = asyncio.run(run(args))
    if args.report:
        Path(args.report).mkdir(parents=True, exist_ok=True)
        (Path(args.report) / "vllm_throughput.json").write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    from research.interrupt import stop_on_sigterm

    stop_on_sigterm()
    main()
