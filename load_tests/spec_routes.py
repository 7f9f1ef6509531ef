"""Where each drafting route wins on this machine: step costs, acceptance by
draft position, and decode speed at small batch for no speculation, the
draft model and n-gram drafts, at every depth K.

    python -m load_tests.spec_routes --report reports/spec-routes          # ~4 min on 2 cores
    python -m load_tests.spec_routes --quick                              # ~2 min

Measured on real vLLM CPU engines (one core each) with the bundled tiny
reasoner and its drafter, on tiny-reasoner prompts at temperature 1.0:

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
import time
import uuid
from pathlib import Path

from rollout_service.core.types import EngineRequest, SamplingParams
from rollout_service.engines.vllm import VllmEngine


def prompts(n: int, seed: int) -> list[list[int]]:
    from rollout_service.tasks import generate_problems, prompt_token_ids

    return [prompt_token_ids(p) for p in generate_problems(n, seed=seed)]


async def decode_rate(engine, batch_prompts: list[list[int]], max_tokens: int, temperature: float = 1.0) -> dict:
    """Run the prompts concurrently; tokens/s of the whole batch and the
    engine's speculative counters over the run."""
    monitor = engine.spec_monitor
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
    from rollout_service.assets import tiny_draft_path, tiny_model_path

    target = args.model or str(tiny_model_path())
    draft = args.draft or str(tiny_draft_path())
    ps = prompts(64, args.seed)
    batches = {1: [ps[:1], ps[1:2], ps[2:3]] if not args.quick else [ps[:1]], 4: [ps[4:8]] if args.quick else [ps[4:8], ps[8:12]]}
    max_tokens = 96 if args.quick else 192
    out: dict = {"target": target, "draft": draft, "max_tokens": max_tokens, "temperature": 1.0, "routes": {}}

    async def run_route(name: str, engine: VllmEngine, ks: list[int]) -> None:
        await engine.start()
        try:
            await decode_rate(engine, ps[60:61], 16)  # warm-up
            rows = []
            for k in ks:
                if engine.spec.enabled:
                    await engine.set_spec_schedule([[1, engine.max_seqs, k]])
                for batch, groups in batches.items():
                    runs = [await decode_rate(engine, g, max_tokens) for g in groups]
                    tokens = sum(r["tokens"] for r in runs)
                    seconds = sum(r["seconds"] for r in runs)
                    drafted = sum(r["draft_tokens"] for r in runs)
                    accepted = sum(r["accepted_tokens"] for r in runs)
                    row = {"k": k, "batch": batch, "tokens_per_s": tokens / seconds, "tokens": tokens,
                           "draft_tokens": drafted, "accepted_tokens": accepted,
                           "acceptance_rate": accepted / drafted if drafted else None,
                           "mean_acceptance_length": sum(r["mean_acceptance_length"] for r in runs) / len(runs),
                           "acceptance_by_position": runs[-1]["acceptance_by_position"]}
                    rows.append(row)
                    print(f"  {name:<12} K={k} batch {batch}: {row['tokens_per_s']:7.1f} tokens/s"
                          + (f", acceptance {row['acceptance_rate']:.2f}, length {row['mean_acceptance_length']:.2f}"
                             if drafted else ""), flush=True)
            out["routes"][name] = rows
        finally:
            await engine.close()

    kmax = 4
    ks = [1, 2, 3, 4] if not args.quick else [2, 4]
    common = dict(max_seqs=16, max_model_len=1024, cpu_bind="0")
    await run_route("off", VllmEngine("off", target, **common), [0])
    await run_route("draft-alone", VllmEngine("draft", draft, **common), [0])
    await run_route("draft_model", VllmEngine("dm", target, **common, spec={
        "method": "draft_model", "model": draft, "num_speculative_tokens": kmax, "schedule": [[1, 16, kmax]]}), ks)
    await run_route("draft_greedy", VllmEngine("dg", target, **common, spec={
        "method": "draft_model", "model": draft, "num_speculative_tokens": kmax, "schedule": [[1, 16, kmax]],
        "draft_sample_method": "greedy"}), ks)
    await run_route("ngram", VllmEngine("ng", target, **common, spec={
        "method": "ngram", "num_speculative_tokens": kmax, "schedule": [[1, 16, kmax]]}), ks)

    off1 = next(r for r in out["routes"]["off"] if r["batch"] == 1)["tokens_per_s"]
    draft1 = next(r for r in out["routes"]["draft-alone"] if r["batch"] == 1)["tokens_per_s"]
    out["step_seconds_target"] = 1 / off1
    out["step_seconds_draft"] = 1 / draft1
    out["draft_cost_ratio"] = off1 / draft1
    out["best"] = {}
    for batch in batches:
        base = next(r for r in out["routes"]["off"] if r["batch"] == batch)["tokens_per_s"]
        for route in ("draft_model", "draft_greedy", "ngram"):
            best = max((r for r in out["routes"][route] if r["batch"] == batch), key=lambda r: r["tokens_per_s"])
            out["best"][f"{route}@{batch}"] = {"k": best["k"], "speedup": best["tokens_per_s"] / base}
    return out


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, batch in zip(axes, (1, 4)):
        base = next(r for r in out["routes"]["off"] if r["batch"] == batch)["tokens_per_s"]
        ax.axhline(base, color="k", ls="--", label="no speculation")
        for route in ("draft_model", "draft_greedy", "ngram"):
            rows = [r for r in out["routes"][route] if r["batch"] == batch]
            ax.plot([r["k"] for r in rows], [r["tokens_per_s"] for r in rows], "o-", label=route)
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
    p.add_argument("--quick", action="store_true")
    p.add_argument("--report", help="output directory")
    args = p.parse_args(argv)
    out = asyncio.run(measure(args))
    out["command"] = "python -m load_tests.spec_routes" + (" --quick" if args.quick else "")
    print(json.dumps({k: out[k] for k in ("draft_cost_ratio", "step_seconds_target", "step_seconds_draft", "best")}, indent=2))
    if args.report:
        d = Path(args.report)
        d.mkdir(parents=True, exist_ok=True)
        (d / "spec_routes.json").write_text(json.dumps(out, indent=2))
        plot(out, d / "spec_routes.png")
        print(f"report: {d / 'spec_routes.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
