"""Where each drafting route wins on this machine: step costs, acceptance by
draft position, and decode speed at small batch for no speculation, the
draft model and n-gram drafts, at every depth K.

    python -m research.spec_routes --report reports/spec-routes          # ~4 min on 2 cores
    python -m research.spec_routes --quick                              # ~2 min

Measured on real vLLM CPU engines (one core each) with the bundled tiny
reasoner and its drafter, on tiny-reasoner prompts at temperature 1.0. The
machine is shared, so every figure is a median over rounds measured in
alternation (shuffled order), and K = 0 on the same engine is the baseline:

- step cost: seconds per decode step of a single sequence, for the target
  and for the drafter served alone; their ratio is what a draft step costs
  next to a target step (the simulated engine's `spec_draft_cost`);
- per route and K: tokens/s at batch 1 and batch 4, draft tokens proposed
  and accepted, mean acceptance length, acceptance by draft position.

Writes DIR/spec_routes.json and DIR/spec_routes.png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from pathlib import Path

from research.report import save_json
from rollout_service.engines.types import EngineRequest, SamplingParams
from rollout_service.engines.vllm import VllmEngine


def prompts(n: int, seed: int) -> list[list[int]]:
    from rollout_service.tasks import generate_problems, prompt_token_ids

    return [prompt_token_ids(p) for p in generate_problems(n, seed=seed)]


async def decode_rate(engine, batch_prompts: list[list[int]], max_tokens: int, temperature: float = 1.0) -> dict:
    """Run the prompts concurrently; tokens/s of the whole batch and the
    engine's speculative counters over the run."""
    monitor = engine.speculation.monitor
    before = (monitor.draft_tokens, monitor.accepted_tokens, monitor.spec_steps,
              list(monitor.accepted_per_pos), list(monitor.drafted_per_pos))
    tag = uuid.uuid4().hex[:6]

    async def one(i, prompt):
        n = 0
        req = EngineRequest(f"{tag}-{i}", prompt, [], SamplingParams(max_tokens, temperature), max_tokens)
        async for delta in engine.add(req):
            n += len(delta.token_ids)
        return n

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(batch_prompts))))
    seconds = time.perf_counter() - t0
    drafted = monitor.draft_tokens - before[0]
    accepted = monitor.accepted_tokens - before[1]
    steps = monitor.spec_steps - before[2]
    per_pos = [(a - a0) / (d - d0) if d > d0 else None for a, a0, d, d0 in
               zip(monitor.accepted_per_pos, before[3], monitor.drafted_per_pos, before[4])]
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / steps if steps else 1.0,
        "acceptance_by_position": per_pos,
    }


async def measure(args) -> dict:
    import random

    from rollout_service.assets import tiny_draft_path, tiny_model_path

    target = args.model or str(tiny_model_path())
    draft = args.draft or str(tiny_draft_path())
    ps = prompts(64, args.seed)
    rounds = 1 if args.quick else args.rounds
    max_tokens = 96 if args.quick else 192
    batches = {1: 1, 4: 4}
    rng = random.Random(args.seed)
    out: dict = {"target": target, "draft": draft, "max_tokens": max_tokens, "temperature": 1.0, "rounds": rounds,
                 "routes": {}}
    common = dict(max_seqs=16, max_model_len=1024)

    # Step costs: the target and the drafter served alone, one core each,
    # measured in alternation so that load from elsewhere hits both alike.
    # Both on core 0, one measuring at a time; the plain target stays up as
    # the no-speculation baseline of every route.
    plain = VllmEngine("target", target, cpu_bind="0", **common)
    alone = {"target": plain, "draft": VllmEngine("draft", draft, cpu_bind="0", **common)}
    for engine in alone.values():
        await engine.start()
    try:
        rates = {name: [] for name in alone}
        for r in range(rounds + 2):
            for name, engine in alone.items():
                result = await decode_rate(engine, [ps[r % 8]], max_tokens)
                if r >= 1:  # the first round warms up
                    rates[name].append(result["tokens_per_s"])
    finally:
        await alone["draft"].close()
    median = {name: statistics.median(v) for name, v in rates.items()}
    out["step_seconds_target"] = 1 / median["target"]
    out["step_seconds_draft"] = 1 / median["draft"]
    out["draft_cost_ratio"] = median["target"] / median["draft"]
    print(f"  step: target {1e3 / median['target']:.2f} ms, drafter {1e3 / median['draft']:.2f} ms, "
          f"ratio {out['draft_cost_ratio']:.2f}", flush=True)

    # Routes: one engine each; K = 0 to 4, switched at run time through the
    # depth schedule, and the plain engine ("off"), in shuffled order,
    # `rounds` times. K = 0 is not "off" for a draft model: vLLM still runs
    # one drafter forward per step to keep the drafter's KV cache in sync.
    kmax = 4
    routes = {
        "draft_model": {"method": "draft_model", "model": draft},
        "draft_greedy": {"method": "draft_model", "model": draft, "draft_sample_method": "greedy"},
        "ngram": {"method": "ngram"},
    }
    for name, spec in routes.items():
        engine = VllmEngine(name, target, cpu_bind="0", **common,
                            spec=dict(spec, num_speculative_tokens=kmax, schedule=[[1, 16, kmax]]))
        await engine.start()
        samples: dict[tuple[int, int], list[dict]] = {}
        try:
            await decode_rate(engine, ps[60:61], 16)  # warm-up
            for r in range(rounds):
                plan = [(k, b) for k in range(-1, kmax + 1) for b in batches]  # k = -1: the plain engine
                rng.shuffle(plan)
                for k, batch in plan:
                    first = (r * 4 + max(k, 0)) % 48
                    if k < 0:
                        result = await decode_rate(plain, ps[first:first + batch], max_tokens)
                    else:
                        await engine.speculation.set_schedule([[1, 16, k]])
                        result = await decode_rate(engine, ps[first:first + batch], max_tokens)
                    samples.setdefault((k, batch), []).append(result)
        finally:
            await engine.close()
        rows = []
        for (k, batch), runs in sorted(samples.items()):
            drafted = sum(x["draft_tokens"] for x in runs)
            accepted = sum(x["accepted_tokens"] for x in runs)
            per_pos = [statistics.mean(x["acceptance_by_position"][i] for x in runs if x["acceptance_by_position"][i] is not None)
                       if any(x["acceptance_by_position"][i] is not None for x in runs) else None for i in range(kmax)]
            row = {"k": k, "batch": batch, "tokens_per_s": statistics.median(x["tokens_per_s"] for x in runs),
                   "draft_tokens": drafted, "accepted_tokens": accepted,
                   "acceptance_rate": accepted / drafted if drafted else None,
                   "mean_acceptance_length": statistics.mean(x["mean_acceptance_length"] for x in runs),
                   "acceptance_by_position": per_pos[:k]}
            rows.append(row)
            print(f"  {name:<12} {'off' if k < 0 else f'K={k}'} batch {batch}: {row['tokens_per_s']:7.1f} tokens/s"
                  + (f", acceptance {row['acceptance_rate']:.2f}, length {row['mean_acceptance_length']:.2f}, "
                     f"by position {[round(x, 2) for x in row['acceptance_by_position'] if x is not None]}" if drafted else ""),
                  flush=True)
        out["routes"][name] = rows
    await plain.close()

    out["best"] = {}
    for route, rows in out["routes"].items():
        for batch in batches:
            base = next(r for r in rows if r["batch"] == batch and r["k"] < 0)["tokens_per_s"]
            best = max((r for r in rows if r["batch"] == batch and r["k"] > 0), key=lambda r: r["tokens_per_s"])
            out["best"][f"{route}@{batch}"] = {"k": best["k"], "speedup": best["tokens_per_s"] / base,
                                               "mean_acceptance_length": best["mean_acceptance_length"], "off_tokens_per_s": base,
                                               "tokens_per_s": best["tokens_per_s"]}
    return out


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, batch in zip(axes, (1, 4)):
        for i, (route, rows) in enumerate(out["routes"].items()):
            off = next(r for r in rows if r["batch"] == batch and r["k"] < 0)["tokens_per_s"]
            ax.axhline(off, color=f"C{i}", ls=":", lw=1)
            rows = [r for r in rows if r["batch"] == batch and r["k"] >= 0]
            ax.plot([r["k"] for r in rows], [r["tokens_per_s"] for r in rows], "o-", color=f"C{i}",
                    label=f"{route} (dotted: plain engine, same rounds)")
        ax.set_xlabel("draft tokens per step (K)")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"batch {batch}")
        ax.legend()
    fig.suptitle(f"vLLM CPU, one core: drafter step = {out['draft_cost_ratio']:.2f} x target step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="target model directory (default: the bundled tiny reasoner)")
    p.add_argument("--draft", default="", help="draft model directory (default: the bundled drafter)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3, help="measurements of every (K, batch), in shuffled order")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--report", help="output directory")
    args = p.parse_args(argv)
    out = asyncio.run(measure(args))
    out["command"] = "python -m research.spec_routes" + (" --quick" if args.quick else "")
    print(json.dumps({k: out[k] for k in ("draft_cost_ratio", "step_seconds_target", "step_seconds_draft", "best")}, indent=2))
    save_json(args.report, "spec_routes.json", out, plot)
    return 0


if __name__ == "__main__":
    from research.interrupt import stop_on_sigterm

    stop_on_sigterm()
    raise SystemExit(main())
