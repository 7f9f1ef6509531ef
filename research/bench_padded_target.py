"""Step times of a padded target (`rollout-service build-model`) and of the
bundled drafter on vLLM CPU: is the padded target's batch-1 step memory-bound
and >= 10x a draft step, while a large batch still pays?

    python -m research.bench_padded_target                      # the `tail` preset, batches 1 and 64
    python -m research.bench_padded_target --layers 6 --intermediate 24576 --report out/

Each model runs in its own process on one vLLM CPU engine: float32,
enforce_eager, VLLM_CPU_KVCACHE_SPACE=1, bound to core `--cores` (default 0,
VLLM_CPU_OMP_THREADS_BIND). B random 16-token prompts decode greedily with
the end token ignored, `--tokens` (256) and then `--short` (32) tokens; the
step time is the difference divided by the extra tokens (prefill cancels),
and the wall time per token of the long run is shown beside it (with
`--repeats N`, the fastest of N runs of each). Other work
on the machine inflates the figures, so the load average is printed too.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT_LEN = 16


def worker(args) -> dict:
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.cores
    import numpy as np
    from vllm import LLM, SamplingParams

    config = json.loads((Path(args.worker) / "config.json").read_text())
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(model=args.worker, dtype="float32", enforce_eager=True, max_model_len=PROMPT_LEN + args.tokens + 16,
              max_num_seqs=max(batches), enable_prefix_caching=False, seed=0)
    rng = np.random.default_rng(0)

    def timed(b: int, tokens: int) -> float:
        return min(once(b, tokens) for _ in range(args.repeats))

    def once(b: int, tokens: int) -> float:
        prompts = [{"prompt_token_ids": rng.integers(3, config["vocab_size"], size=PROMPT_LEN).tolist()}
                   for _ in range(b)]
        sp = SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
        return elapsed

    once(2, 8)  # warm-up
    rows = []
    for b in batches:
        long, short = timed(b, args.tokens), timed(b, args.short)
        step = (long - short) / (args.tokens - args.short)
        rows.append({"batch": b, "step_ms": round(step * 1e3, 2), "wall_ms_per_step": round(long / args.tokens * 1e3, 2),
                     "tokens_per_s": round(b / step, 1)})
    return {"layers": config["num_hidden_layers"], "intermediate_size": config["intermediate_size"], "rows": rows}


def run_model(label: str, path: str, batches: str, args) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, __file__, "--worker", path, "--batches", batches, "--tokens", str(args.tokens),
           "--short", str(args.short), "--cores", args.cores, "--repeats", str(args.repeats)]
    load = os.getloadavg()[0]
    print(f"measuring {label} ({path}) at batch {batches} (load average {load:.2f}) ...", flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{label} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return {"model": label, "path": path, **json.loads(lines[-1][len("RESULT "):]),
            "load_average_1m": [load, os.getloadavg()[0]]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tail")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--intermediate", type=int)
    ap.add_argument("--model-dir", help="an already built padded target (default: build one in a temporary directory)")
    ap.add_argument("--batches", default="1,64", help="the padded target's batch sizes")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--short", type=int, default=32)
    ap.add_argument("--cores", default="0", help="VLLM_CPU_OMP_THREADS_BIND")
    ap.add_argument("--repeats", type=int, default=1, help="time each run this many times, keep the fastest "
                                                             "(other work on the machine only ever slows a run)")
    ap.add_argument("--no-bundled", action="store_true", help="skip the bundled (unpadded) target's reference row")
    ap.add_argument("--report", help="directory to write padded_target.json into")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0

    from rollout_service.assets import tiny_draft_path, tiny_model_path
    from rollout_service.tools.build_model import build

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="padded-") as tmp:
        target = args.model_dir
        if not target:
            target = tmp
            summary = build(tmp, preset=args.preset, layers=args.layers, intermediate=args.intermediate)
        else:
            summary = json.loads((Path(target) / "padding.json").read_text())
        results = [run_model("padded", target, args.batches, args)]
        results.append(run_model("drafter", str(tiny_draft_path()), "1", args))
        if not args.no_bundled:
            results.append(run_model("bundled", str(tiny_model_path()), args.batches, args))
    load_after = os.getloadavg()

    print(f"\n{'model':<10}{'layers':>7}{'interm.':>9}{'batch':>7}{'ms/step':>10}{'wall ms/tok':>13}{'tokens/s':>10}"
          f"{'load 1m':>14}")
    for r in results:
        for row in r["rows"]:
            print(f"{r['model']:<10}{r['layers']:>7}{r['intermediate_size']:>9}{row['batch']:>7}{row['step_ms']:>10.2f}"
                  f"{row['wall_ms_per_step']:>13.2f}{row['tokens_per_s']:>10.1f}"
                  f"{'{:.1f}-{:.1f}'.format(*r['load_average_1m']):>14}")
    padded = {row["batch"]: row for row in results[0]["rows"]}
    draft = results[1]["rows"][0]
    b1, bmax = padded[min(padded)], padded[max(padded)]
    gain = round(bmax["tokens_per_s"] / b1["tokens_per_s"], 2)
    ratios = {"padded_b1_over_draft_b1": round(b1["step_ms"] / draft["step_ms"], 2),
              "padded_batch_gain": gain, "padded_batch_gain_at": bmax["batch"],
              "padded_b1_gb_per_s": round(summary["bytes"] / (b1["step_ms"] / 1e3) / 1e9, 2)}
    print(f"\npadded target: {summary['parameters']:,} parameters, {summary['bytes'] / 1e6:.0f} MB; "
          f"batch-1 step = {ratios['padded_b1_over_draft_b1']}x a draft step; batch {bmax['batch']} gives "
          f"{gain}x the tokens/s of batch 1; "
          f"batch 1 streams the weights at {ratios['padded_b1_gb_per_s']} GB/s")
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} ({os.cpu_count()} cores)")
    report = {"padded": summary, "results": results, "ratios": ratios, "tokens": args.tokens, "short": args.short,
              "repeats": args.repeats,
              "cores": args.cores, "load_average_before": load_before, "load_average_after": load_after,
              "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    from research.report import save_json  # not at the top: workers run this file as a script

    save_json(args.report, "padded_target.json", report)
    return 0


if __name__ == "__main__":
    from research.interrupt import stop_on_sigterm

    stop_on_sigterm()
    sys.exit(main())
