"""Fit the simulated engine's cost model to a real vLLM engine.

Measures, on one vLLM engine:

- decode-step time against the running batch size B (and the batch's
  context): B sequences decode T1 and then T2 tokens (end token ignored);
  the difference divided by T2 - T1 is one step at batch B, free of prefill;
- prefill time against prompt length: one prompt, one output token.

and fits `SimParams`' cost model by least squares

    step(B, ctx) = decode_base_s + decode_per_seq_s * B + decode_per_ctx_token_s * ctx
    prefill(P)   = prefill_per_token_s * P   (slope of one-token generations)

then writes the fit (and the raw measurements) to a JSON file and prints it.
Load tests use `load_tests/calibration/tiny_reasoner_cpu.json` for the
lower bound of real-engine runs; simulated fleets take the fit with
`--sim decode_base_s=... --sim decode_per_seq_s=...`.

    python -m load_tests.calibrate                       # the bundled tiny model, vLLM CPU, one core
    python -m load_tests.calibrate --model DIR --out fit.json --dtype bfloat16   # e.g. on a GPU

On a CPU it binds the engine to `--cores` (default: core 0, as one engine of
a fleet runs) and gives it `VLLM_CPU_KVCACHE_SPACE=1` GiB of KV cache; on a
GPU those settings are not used. Start-up takes ~20 s on a CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

DEFAULT_OUT = Path(__file__).resolve().parent / "calibration" / "tiny_reasoner_cpu.json"


def default_model() -> str:
    from rollout_service.assets import tiny_model_path

    return str(tiny_model_path())


def _prompts(n: int, length: int, vocab: int, rng: np.random.Generator) -> list[dict]:
    # Distinct random prompts: nothing for a prefix cache to share.
    return [{"prompt_token_ids": rng.integers(3, vocab, size=length).tolist()} for _ in range(n)]


def _timed(llm, prompts, max_tokens: int, repeats: int) -> float:
    from vllm import SamplingParams

    # No per-request seed: a seeded generator fails on the CPU backend when a prompt is prefilled in chunks.
    sp = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, temperature=1.0)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(llm, vocab: int, max_len: int, batches: list[int], repeats: int, quick: bool) -> dict:
    rng = np.random.default_rng(0)
    t1, t2 = (8, 40) if quick else (16, 144)
    prompt_short = 16
    prompt_long = min(448, max_len - t2 - 8)
    _timed(llm, _prompts(4, prompt_short, vocab, rng), t1, 1)  # warm-up

    decode = []
    for b, p in [(b, prompt_short) for b in batches] + [(16, prompt_long), (max(batches), prompt_long)]:
        prompts = _prompts(b, p, vocab, rng)
        short = _timed(llm, prompts, t1, repeats)
        long = _timed(llm, prompts, t2, repeats)
        step = (long - short) / (t2 - t1)
        ctx = b * (p + (t1 + t2) / 2)  # mean context of the batch over the extra steps
        decode.append({"batch": b, "prompt": p, "context_tokens": ctx, "step_s": step,
                       "tokens_per_s": b / step if step > 0 else None})
        print(f"  decode batch {b:>3} prompt {p:>4}: {step * 1e3:7.3f} ms/step, {b / step:8.0f} tokens/s", flush=True)

    prefill = []
    lengths = [32, 128, 256, 512, min(896, max_len - 8)]
    if quick:
        lengths = lengths[:3]
    for p in lengths:
        t = _timed(llm, _prompts(1, p, vocab, rng), 1, repeats)
        prefill.append({"prompt": p, "time_s": t})
        print(f"  prefill {p:>4} tokens: {t * 1e3:7.2f} ms", flush=True)
    return {"decode": decode, "prefill": prefill, "decode_tokens": [t1, t2]}


def fit(m: dict) -> dict:
    """Least-squares cost model from the measurements (negative terms dropped)."""
    d = m["decode"]
    y = np.array([x["step_s"] for x in d])
    cols = {"decode_base_s": np.ones(len(d)),
            "decode_per_seq_s": np.array([x["batch"] for x in d], float),
            "decode_per_ctx_token_s": np.array([x["context_tokens"] for x in d], float)}
    names = list(cols)
    while True:
        a = np.stack([cols[n] for n in names], axis=1)
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        negative = [n for n, c in zip(names, coef) if c < 0 and n != "decode_base_s"]
        if not negative:
            break
        names.remove(negative[0])
    params = {n: 0.0 for n in cols}
    params.update({n: float(c) for n, c in zip(names, coef)})
    pred = np.stack([cols[n] for n in names], axis=1) @ coef
    r2 = 1 - float(((y - pred) ** 2).sum() / max(((y - y.mean()) ** 2).sum(), 1e-30))
    p = np.array([x["prompt"] for x in m["prefill"]], float)
    t = np.array([x["time_s"] for x in m["prefill"]])
    slope = float(np.polyfit(p, t, 1)[0]) if len(p) > 1 else 0.0
    params["prefill_per_token_s"] = max(0.0, slope)
    return {"sim_params": params, "decode_fit_r2": r2,
            "max_relative_error": float(np.max(np.abs(pred - y) / y))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model directory (default: the bundled tiny reasoner)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="where to write the fit (JSON)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64", help="running batch sizes to measure")
    ap.add_argument("--cores", default="0", help="CPU only: cores the engine is bound to (VLLM_CPU_OMP_THREADS_BIND)")
    ap.add_argument("--kv-gib", default="1", help="CPU only: KV cache (VLLM_CPU_KVCACHE_SPACE, GiB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="fewer, shorter measurements")
    args = ap.parse_args(argv)

    model = args.model or default_model()
    config = json.loads((Path(model) / "config.json").read_text())
    max_len = min(int(config.get("max_position_embeddings", 2048)), 4096)
    batches = [int(b) for b in args.batches.split(",")]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", args.kv_gib)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", args.cores)

    from vllm import LLM
    from vllm.platforms import current_platform

    device = "cpu" if current_platform.is_cpu() else current_platform.device_name
    print(f"calibrating {model} on vLLM {device} ({args.dtype}); starting the engine...", flush=True)
    t0 = time.perf_counter()
    llm = LLM(model=model, dtype=args.dtype, enforce_eager=True, max_model_len=max_len,
              max_num_seqs=max(batches), enable_prefix_caching=False, seed=0)
    startup = time.perf_counter() - t0
    print(f"  engine up in {startup:.1f} s", flush=True)
    m = measure(llm, int(config["vocab_size"]), max_len, batches, args.repeats, args.quick)
    result = {
        "model": Path(model).name,
        "device": device,
        "dtype": args.dtype,
        "cores": args.cores if device == "cpu" else None,
        "kv_cache_gib": float(args.kv_gib) if device == "cpu" else None,
        "startup_s": startup,
        "load_average": list(os.getloadavg()),  # other work on the machine inflates the step times
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        **fit(m),
        "measurements": m,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("model", "device", "sim_params", "decode_fit_r2", "max_relative_error")}, indent=2))
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
