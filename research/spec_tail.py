"""The tail of a rollout step on real vLLM CPU engines, with speculation off,
with the frozen (bundled) drafter, with the online-trained drafter, with
n-gram drafts, with drafts from sibling responses, and with an EAGLE head
(`--eagle DIR`, built by `rollout-service build-eagle`).

    python -m research.spec_tail --report reports/spec-tail            # ~10 min on 2 cores
    python -m research.spec_tail --quick --report reports/spec-tail-quick

Each route gets a fresh fleet (2 engines, one core each, the bundled tiny
reasoner) and runs the same tiny-reasoner GRPO steps: warm-up steps (their
samples, 256 by default, train the adaptive drafter: one round pushed before
the measured steps), then the measured steps. Speculation runs only in the tail: K=3
(`--k`) while an engine runs at most 4 sequences (`--tail-seqs`), none above;
`--schedule` sets a depth per running batch size instead (one sequence can
verify more drafted tokens than four for the same step cost), and `--tune`
lets the depth tuner choose.

Per step: makespan (submit to last sample), tokens/s over the step, and the
tail: from the moment the fleet runs at most 4 sequences per engine to the
end, tokens generated in it per second, and per second per running sequence
(each sequence's pace, which does not depend on how many sequences a
step's tail happens to hold). Token counts are sampled every 20 ms
from the core's counter. Writes DIR/spec_tail.json and DIR/spec_tail.png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import numpy as np

TAIL = [[1, 4, 3], [5, 1 << 16, 0]]  # (batch from, batch to, K): the defaults of --tail-seqs and --k


def tail_schedule(args) -> list[list[int]]:
    """K = `--k` while an engine runs at most `--tail-seqs` sequences, 0
    above; or `--schedule`, a depth per batch-size range."""
    if args.schedule:
        from rollout_service.engines.spec_config import normalize_schedule

        try:
            schedule = json.loads(args.schedule)
            return [list(e) for e in normalize_schedule(schedule, 1 << 16, 16)]
        except (json.JSONDecodeError, TypeError, ValueError) as e:
            raise SystemExit(f"--schedule {args.schedule!r}: {e} (expected JSON like [[1,1,5],[2,4,3],[5,65536,0]])")
    return [[1, args.tail_seqs, args.k], [args.tail_seqs + 1, 1 << 16, 0]]


ROUTES = {
    "off": None,
    "frozen": {"method": "draft_model"},
    "adaptive": {"method": "draft_model", "train": True},
    "ngram": {"method": "ngram"},
    "siblings": {"method": "siblings"},
    "eagle": {"method": "eagle"},  # the head directory comes from --eagle
}


async def run_step(core, groups, tag: str, tail_per_engine: int) -> dict:
    from rollout_service.engines.types import SamplingParams
    from rollout_service.lifecycle.types import GroupSpec

    specs = [GroupSpec(f"{tag}-g{i}", list(g.prompt_token_ids), g.num_samples,
                       SamplingParams(max_tokens=groups.max_tokens, temperature=1.0)) for i, g in enumerate(groups.groups)]
    total = sum(s.num_samples for s in specs)
    probe: list[tuple[float, int, int]] = []
    t0 = time.perf_counter()
    core.submit(specs)
    done = 0
    consumer = f"tail-{tag}"

    async def sample_counters():
        while True:
            probe.append((time.perf_counter() - t0, core.counters["tokens_generated"], len(core.running) + len(core.queue)))
            await asyncio.sleep(0.02)

    prober = asyncio.create_task(sample_counters())
    tokens = 0
    async for entry in core.delivery.stream(consumer):
        core.delivery.ack(consumer, entry.cursor)
        if entry.sample.group_id.startswith(f"{tag}-"):
            done += 1
            tokens += len(entry.sample.response_token_ids)
            if done == total:
                break
    makespan = time.perf_counter() - t0
    prober.cancel()
    probe.append((makespan, core.counters["tokens_generated"], 0))
    return {"makespan_s": makespan, "tokens": tokens, "tokens_per_s": tokens / makespan,
            **tail_figures(probe, tail_per_engine * len(core.engines))}


def tail_figures(probe: list[tuple[float, int, int]], threshold: int) -> dict:
    """The tail of a step from its probe [(seconds, tokens so far, sequences
    running or queued), ...] (the last entry at the step's end): from the
    first moment at most `threshold` sequences run to the end, its tokens,
    seconds, tokens/s, and tokens per sequence-second, each sequence's pace,
    whatever number of sequences the tail happens to hold."""
    start = next((i for i, (t, _, n) in enumerate(probe) if n <= threshold and t > 0.1), len(probe) - 1)
    t_tail, tok_tail, _ = probe[start]
    tail_tokens = probe[-1][1] - tok_tail
    tail_s = probe[-1][0] - t_tail
    seq_s = sum(n * (probe[i + 1][0] - t) for i, (t, _, n) in enumerate(probe[start:-1], start))
    return {"tail_start_s": t_tail, "tail_s": tail_s, "tail_tokens": tail_tokens,
            "tail_tokens_per_s": tail_tokens / tail_s if tail_s > 0 else 0.0,
            "tail_seq_s": seq_s, "tail_tokens_per_seq_s": tail_tokens / seq_s if seq_s > 0 else 0.0}


class _Step:
    def __init__(self, groups, max_tokens):
        self.groups, self.max_tokens = groups, max_tokens


async def run_route(name: str, args, workload) -> dict:
    from rollout_service.config import EngineConfig
    from rollout_service.core.clock import Clock
    from rollout_service.core.rollout import RolloutCore
    from rollout_service.drafter import SpecRuntime
    from rollout_service.factory import make_engines, model_info
    from rollout_service.engines.spec_config import SpecConfig
    from rollout_service.scheduling import make_placement

    spec = dict(ROUTES[name] or {"method": "off"})
    if spec["method"] != "off":
        schedule = tail_schedule(args)
        spec.update(num_speculative_tokens=max(1, *(k for _, _, k in schedule)), schedule=schedule, tune=args.tune)
        if spec["method"] == "draft_model" and args.draft:
            spec["model"] = args.draft
        if spec["method"] == "eagle":
            spec["model"] = args.eagle
        if spec.get("train"):
            spec["trainer"] = {"min_new_samples": 10**9, "steps_per_round": args.draft_steps}
    cfg = EngineConfig(kind="vllm", num_engines=args.engines, model=args.model, max_seqs=args.max_seqs, spec=spec)
    info = model_info(cfg)
    core = RolloutCore(make_engines(cfg, info), make_placement("least-assigned"), Clock())
    await core.start()
    runtime = SpecRuntime(core, SpecConfig.from_dict(spec))
    await runtime.start()
    steps = []
    try:
        for s, groups in enumerate(workload.steps):
            step = _Step(groups, workload.max_tokens)
            result = await run_step(core, step, f"{name}-s{s}", 4)
            result["warm_up"] = s < args.warmup_steps
            status = runtime.status().engines
            result["mean_acceptance_length"] = {eid: st.mean_acceptance_length for eid, st in status.items()}
            steps.append(result)
            print(f"  [{name}] step {s}{' (warm-up)' if result['warm_up'] else ''}: makespan {result['makespan_s']:.1f} s, "
                  f"{result['tokens_per_s']:.0f} tokens/s; tail {result['tail_s']:.1f} s at "
                  f"{result['tail_tokens_per_s']:.0f} tokens/s, {result['tail_tokens_per_seq_s']:.1f} per sequence", flush=True)
            if s == args.warmup_steps - 1 and runtime.trainer is not None:
                record = await runtime.trainer.train_once()
                print(f"  [{name}] drafter trained on {record['examples']} samples: agreement "
                      f"{record['agreement_before']:.2f} -> {record['agreement_after']:.2f}", flush=True)
        final = runtime.status()
    finally:
        await runtime.stop()
        await core.stop()
    measured = [r for r in steps if not r["warm_up"]]
    return {
        "spec": spec,
        "steps": steps,
        "makespan_s": float(np.mean([r["makespan_s"] for r in measured])),
        "tokens_per_s": float(np.mean([r["tokens_per_s"] for r in measured])),
        # Pooled over the measured steps (a step whose tail is a blink must not count as much as a long one).
        "tail_tokens_per_s": sum(r["tail_tokens"] for r in measured) / max(sum(r["tail_s"] for r in measured), 1e-9),
        "tail_tokens_per_seq_s": sum(r["tail_tokens"] for r in measured) / max(sum(r["tail_seq_s"] for r in measured), 1e-9),
        "tail_s": float(np.mean([r["tail_s"] for r in measured])),
        "spec_status": final.to_dict(),
    }


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(out["routes"])
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].bar(names, [out["routes"][n]["tail_tokens_per_s"] for n in names], color="tab:blue")
    axes[0].set_ylabel("tokens/s in the tail (<= 4 sequences per engine)")
    axes[1].bar(names, [out["routes"][n].get("tail_tokens_per_seq_s", 0.0) for n in names], color="tab:green")
    axes[1].set_ylabel("tail tokens/s per running sequence")
    axes[2].bar(names, [out["routes"][n]["makespan_s"] for n in names], color="tab:orange")
    axes[2].set_ylabel("step makespan (s)")
    fig.suptitle(f"tiny-reasoner steps on {out.get('engines', 2)} vLLM CPU engines, target {out.get('model', 'tiny-reasoner')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from rollout_service.bench.workloads.tiny_reasoner import generate

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--routes", default=",".join(ROUTES), help=f"comma list of {list(ROUTES)}")
    p.add_argument("--model", default="", help="target model directory (default: the bundled tiny reasoner)")
    p.add_argument("--draft", default="", help="draft model directory (default: the bundled drafter)")
    p.add_argument("--eagle", default="", help="EAGLE head directory for the `eagle` route (rollout-service build-eagle)")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--max-seqs", type=int, default=64)
    p.add_argument("--steps", type=int, default=4, help="steps per route, warm-up steps included")
    p.add_argument("--warmup-steps", type=int, default=2,
                   help="steps before the measured ones; their samples train the adaptive drafter")
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--draft-steps", type=int, default=60, help="optimizer steps of the adaptive drafter's round")
    p.add_argument("--k", type=int, default=TAIL[0][2], help="speculative depth in the tail")
    p.add_argument("--tail-seqs", type=int, default=TAIL[0][1],
                   help="the tail: an engine running at most this many sequences")
    p.add_argument("--schedule", default="",
                   help="depth per running batch size, JSON [[first, last, K], ...] (instead of --k/--tail-seqs), "
                        "e.g. [[1,1,5],[2,2,3],[3,4,1],[5,65536,0]]")
    p.add_argument("--tune", action="store_true", help="let the depth tuner choose K per batch size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="2 steps of 8 groups x 4 samples")
    p.add_argument("--report", help="output directory")
    args = p.parse_args(argv)
    routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    unknown = [r for r in routes if r not in ROUTES]
    if unknown:
        p.error(f"--routes: unknown route(s) {unknown}; choose from {list(ROUTES)}")
    if "eagle" in routes:
        from rollout_service.drafter.eagle import is_head_dir

        if not args.eagle:
            p.error("--eagle: the eagle route needs an EAGLE head directory (rollout-service build-eagle --out DIR)")
        if not is_head_dir(args.eagle):
            p.error(f"--eagle {args.eagle!r}: not an EAGLE head directory (rollout-service build-eagle --out DIR)")
    if args.quick:
        args.steps, args.warmup_steps, args.groups, args.samples = 2, 1, min(args.groups, 8), min(args.samples, 4)
    workload = generate(args.steps, args.groups, seed=args.seed, samples_per_group=args.samples)
    out = {"command": "python -m research.spec_tail " + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
           "model": Path(args.model).name if args.model else "tiny-reasoner",
           "engines": args.engines, "max_seqs": args.max_seqs, "steps": args.steps, "groups": args.groups,
           "samples": args.samples, "warmup_steps": args.warmup_steps, "max_tokens": workload.max_tokens, "tail_schedule": tail_schedule(args), "tune": args.tune,
           "routes": {}}
    for name in routes:
        out["routes"][name] = asyncio.run(run_route(name, args, workload))
    print(f"{'route':<10} {'makespan s':>11} {'tokens/s':>9} {'tail s':>7} {'tail tokens/s':>14} {'per sequence':>13}")
    for name, r in out["routes"].items():
        print(f"{name:<10} {r['makespan_s']:>11.1f} {r['tokens_per_s']:>9.0f} {r['tail_s']:>7.1f} "
              f"{r['tail_tokens_per_s']:>14.0f} {r['tail_tokens_per_seq_s']:>13.2f}")
    if args.report:
        d = Path(args.report)
        d.mkdir(parents=True, exist_ok=True)
        (d / "spec_tail.json").write_text(json.dumps(out, indent=2, default=float))
        plot(out, d / "spec_tail.png")
        print(f"report: {d / 'spec_tail.json'}")
    return 0


if __name__ == "__main__":
    from research.interrupt import stop_on_sigterm

    stop_on_sigterm()
    raise SystemExit(main())
