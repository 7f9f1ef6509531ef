"""Fit the simulated engine's cost model to a real vLLM engine.

Measures, on one vLLM engine:

- decode-step time against the running batch size B (and the batch's
  context): B sequences decode T2 tokens (end token ignored), and the time
  between the tokens of the request prefilled last (vLLM's per-request
  timestamps) is one step at batch B, free of prefill, even when the
  batch's prefill takes many seconds (64 prompts of 448 tokens);
- prefill time against prompt length: one prompt, one output token.

and fits `SimParams`' cost model by least squares

    step(B, ctx) = max(decode_floor_s, decode_base_s + decode_per_seq_s * B) + decode_per_ctx_token_s * ctx
    prefill(P)   = prefill_per_token_s * P   (slope of one-token generations)

(the floor: the median step at batches up to 4, where a step is memory-bound
and flat; the linear terms: fitted to the steps above it);

then writes the fit (and the raw measurements) to a JSON file and prints it.
Load tests use `research/calibration/tiny_reasoner_cpu.json` for the
lower bound of real-engine runs; simulated fleets take the fit with
`--sim decode_base_s=... --sim decode_per_seq_s=...`.

    python -m research.calibrate                       # the bundled tiny model, vLLM CPU, one core
    python -m research.calibrate --model DIR --out fit.json --dtype bfloat16   # e.g. on a GPU

With `--draft DIR` (or `bundled`) it then starts a second engine of the
same model with that draft model attached and measures what speculation
costs and yields there:

- decode steps at K = 0 (every step of a draft-model engine outside the
  tail) and verify steps at K = `--spec-k` (engine steps counted from vLLM's
  own statistics, since a verify step yields more than one token);
- the acceptance per draft position on the tiny-reasoner task's prompts,
  drafting only while at most 4 sequences run, as the service does;

and fits `spec_draft_cost` and `spec_verify_cost` (the extra cost of a
verify step over a K = 0 step, `sim.SimParams`) and `spec_acceptance` (the
measured rates), which `research run --cost-model` and `predict` use:

    python -m research.calibrate --model DIR --draft bundled --out fit.json

With `--draft ngram` the engine drafts without a model (n-gram prompt
lookup matching a single token, on long random prompts, so that nearly
every step drafts): the same K = 0 and verify steps, and the tokens
drafted per sequence and step, fit `spec_ngram_draft_cost` (the proposer and
the verify step's own machinery, per draft token) and `spec_verify_cost`,
what the model-free routes (`ngram`, `siblings`) pay. Their acceptance is
the workload's, not measured here (a run's own goes to `predict --sim
spec_ngram_acceptance=...`). An n-gram engine at K = 0 steps as a plain
one (no draft model runs), so that one engine measures the plain steps too,
and the calibration starts one engine, not two.

On a CPU it binds the engine to `--cores` (default: core 0, as one engine of
a fleet runs) and gives it `VLLM_CPU_KVCACHE_SPACE=1` GiB of KV cache; on a
GPU those settings are not used. Start-up takes ~20 s on a CPU.

With `--engines N` it calibrates N engines side by side, one per core (engine
i on core i), each in a process of its own running the same schedule at the
same time (they wait for each other after start-up), as a fleet's engines
run: on a CPU they share the memory bus, and an engine alone may step
faster than one of two. The fit is of the mean step times over the engines; the
acceptance pools their drafts (each engine drafts on prompts of its own):

    python -m research.calibrate --model DIR --engines 2 --draft bundled --out fit.json

With `--service` it measures the same schedule through the rollout service:
`--engines` vLLM engines behind the gRPC server, started as `research run
--engine vllm` starts them, each shape B fixed-length requests per engine
(`min_tokens` = `max_tokens`) sent by the real client, each step timed on
the service's clock between the tokens of the request prefilled last. What
the fleet pays beyond the engines themselves (the service's processing of
every token, the stream to the client, on the same cores) is then in the
fit. Its engines are plain; the speculation terms are fitted to the draft
measurements of another calibration (`--draft-from`, one with `--draft`):

    python -m research.calibrate --model DIR --service --engines 2 --draft-from fit.json --out served.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from research import speed_reference

DEFAULT_OUT = Path(__file__).resolve().parent / "calibration" / "tiny_reasoner_cpu.json"


def default_model() -> str:
    from rollout_service.assets import tiny_model_path

    return str(tiny_model_path())


def _prompts(n: int, length: int, vocab: int, rng: np.random.Generator) -> list[dict]:
    # Distinct random prompts: nothing for a prefix cache to share.
    return [{"prompt_token_ids": rng.integers(3, vocab, size=length).tolist()} for _ in range(n)]


def _timed(llm, prompts, max_tokens: int, repeats: int) -> float:
    return _timed_steps(llm, prompts, max_tokens, repeats)[0]


def _engine_steps(llm) -> int:
    """Engine steps run so far (vLLM counts one `iteration_tokens_total`
    observation per step, prefill and decode alike)."""
    for m in llm.get_metrics():
        if m.name == "vllm:iteration_tokens_total":
            return int(m.count)
    raise RuntimeError("vLLM reports no vllm:iteration_tokens_total (start the engine with log stats on)")


def _draft_tokens(llm) -> int:
    """Draft tokens proposed so far (0 without speculation)."""
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_draft_tokens":
            return int(m.value)
    return 0


def _timed_steps(llm, prompts, max_tokens: int, repeats: int,
                 count_steps: bool = False) -> tuple[float, float, float]:
    """(median seconds, median engine steps, median draft tokens; both 0
    unless `count_steps`) of generating `max_tokens` for every prompt."""
    from vllm import SamplingParams

    # No per-request seed: a seeded generator fails on the CPU backend when a prompt is prefilled in chunks.
    sp = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, temperature=1.0)
    times, steps, drafts = [], [], []
    for _ in range(repeats):
        s0, d0 = (_engine_steps(llm), _draft_tokens(llm)) if count_steps else (0, 0)
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        times.append(time.perf_counter() - t0)
        steps.append(_engine_steps(llm) - s0 if count_steps else 0)
        drafts.append(_draft_tokens(llm) - d0 if count_steps else 0)
    return statistics.median(times), statistics.median(steps), statistics.median(drafts)


def _decode_step(llm, prompts, max_tokens: int, repeats: int) -> float:
    """One decode step at the batch of `prompts`, free of prefill: the time
    between the tokens of the request whose first token came last (by then
    every prompt is prefilled, so each of its steps decodes the whole batch
    but for the last few, after the first-prefilled requests end: as many as
    the prefill took steps); median over the repeats. vLLM's per-request
    timestamps need the engine's log stats on."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, temperature=1.0)
    steps = []
    for _ in range(repeats):
        outs = llm.generate(prompts, sp, use_tqdm=False)
        if any(o.metrics is None for o in outs):
            raise RuntimeError("vLLM returned no request timestamps (start the engine with log stats on)")
        last = max(outs, key=lambda o: o.metrics.first_token_ts)
        steps.append((last.metrics.last_token_ts - last.metrics.first_token_ts) / (max_tokens - 1))
    return statistics.median(steps)


def _decode_steps(llm, shapes, vocab: int, t1: int, t2: int, repeats: int, rng, label: str = "",
                  count_steps: bool = False) -> list[dict]:
    """One decode step's time at each (batch, prompt length): B sequences
    decode t2 tokens, timed between the tokens once all are prefilled
    (`_decode_step`). A speculative step yields more than one token, so with
    `count_steps` B sequences decode t1 and then t2 tokens, and the
    difference in time is divided by the difference in engine steps vLLM
    counted (short prompts: their prefill is one step either way)."""
    out = []
    for b, p in shapes:
        prompts = _prompts(b, p, vocab, rng)
        extra = {}
        if count_steps:
            (short, s1, d1), (long, s2, d2) = (_timed_steps(llm, prompts, t, repeats, True) for t in (t1, t2))
            step = (long - short) / max(s2 - s1, 1)
            ctx = b * (p + (t1 + t2) / 2)  # mean context of the batch over the extra steps
            tps = b * (t2 - t1) / (long - short) if long > short else None
            # Tokens drafted per sequence and step: K where every step drafts, less where some find nothing.
            extra["draft_tokens_per_seq_step"] = (d2 - d1) / max(s2 - s1, 1) / b
        else:
            step = _decode_step(llm, prompts, t2, repeats)
            ctx = b * (p + t2 / 2)  # mean context of the batch over the steps timed
            tps = b / step if step > 0 else None
        out.append({"batch": b, "prompt": p, "context_tokens": ctx, "step_s": step, "tokens_per_s": tps, **extra})
        print(f"  {label}decode batch {b:>3} prompt {p:>4}: {step * 1e3:7.3f} ms/step, "
              f"{out[-1]['tokens_per_s'] or 0:8.0f} tokens/s"
              + (f", {extra['draft_tokens_per_seq_step']:.2f} drafted per sequence" if extra else ""), flush=True)
    return out


def decode_tokens(quick: bool) -> tuple[int, int]:
    return (8, 40) if quick else (16, 144)


def schedule(batches: list[int], max_len: int, quick: bool) -> tuple[list[tuple[int, int]], list[int]]:
    """What a calibration measures: the decode shapes (batch, prompt
    length), short prompts at every batch, long ones at 16 and the
    largest (at the largest alone when it is below 16: the engine runs no
    more at once, and a batch of 16 would queue in waves of it), and
    (unless quick) a rollout tail's shape: 1 and 4 sequences deep into long
    responses; and the prompt lengths of the prefill measurements."""
    t2 = decode_tokens(quick)[1]
    prompt_long = min(448, max_len - t2 - 8)
    prompt_tail = min(TAIL_PROMPT, max_len - t2 - 8)
    largest = max(batches)
    shapes = [(b, 16) for b in batches] + [(b, prompt_long) for b in sorted({min(16, largest), largest})]
    if not quick and prompt_tail > prompt_long:
        shapes += [(1, prompt_tail), (FLOOR_BATCH, prompt_tail)]
    lengths = [32, 128, 256, 512, min(896, max_len - 8)]
    return shapes, lengths[:3] if quick else lengths


def measure(llm, vocab: int, max_len: int, batches: list[int], repeats: int, quick: bool) -> dict:
    rng = np.random.default_rng(0)
    t1, t2 = decode_tokens(quick)
    _timed(llm, _prompts(4, 16, vocab, rng), t2, 1)  # warm-up (a short one left batch 1 slower than 4)

    shapes, lengths = schedule(batches, max_len, quick)
    decode = _decode_steps(llm, shapes, vocab, t1, t2, repeats, rng)

    prefill = []
    for p in lengths:
        t = _timed(llm, _prompts(1, p, vocab, rng), 1, repeats)
        prefill.append({"prompt": p, "time_s": t})
        print(f"  prefill {p:>4} tokens: {t * 1e3:7.2f} ms", flush=True)
    return {"decode": decode, "prefill": prefill, "decode_tokens": [t1, t2],
            "decode_timing": "time between the tokens of the last-prefilled request, t2 tokens"}


def _spec_counters(llm) -> tuple[int, list[int]]:
    """(drafts so far, accepted draft tokens per position so far)."""
    drafts, per_pos = 0, []
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            drafts = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos = [int(v) for v in m.values]
    return drafts, per_pos


def _set_depth(llm, schedule: list[list[int]]) -> None:
    # The engine core's K per batch size (the plugin's utility, as the service sets it).
    llm.llm_engine.engine_core.call_utility("rollout_set_spec_schedule", schedule)


def measure_draft(llm, vocab: int, batches: list[int], verify_batches: list[int], k: int, max_seqs: int,
                  repeats: int, quick: bool, task_prompts: list[list[int]], samples: int, max_tokens: int,
                  tail_seqs: int = 4, model_free: bool = False, prompt: int = 16) -> dict:
    """With a draft model attached: decode steps at K = 0 (what every step
    of a draft-model engine pays outside the tail), verify steps at K = k
    (the drafts and the verification of k tokens per sequence), and the
    acceptance per draft position on the task's own prompts, drafting while
    at most `tail_seqs` sequences run.

    With model-free drafts (`model_free`: n-gram prompt lookup matching a
    single token, on `prompt`-token random prompts, so that nearly every
    step finds a match and drafts) the same K = 0 and verify steps, the
    tokens drafted per sequence and step counted; no acceptance: what random
    prompts draft says nothing about a workload's."""
    from vllm import SamplingParams

    rng = np.random.default_rng(1)
    t1, t2 = decode_tokens(quick)
    _set_depth(llm, [[1, max_seqs, 0]])
    _timed(llm, _prompts(4, 16, vocab, rng), t1, 1)  # warm-up
    # A model-free engine's K = 0 step is a plain one: measured only where it is compared with verify steps.
    k0_batches = set(verify_batches) if model_free else set(batches) | set(verify_batches)
    k0 = _decode_steps(llm, [(b, prompt) for b in sorted(k0_batches)], vocab, t1, t2, repeats, rng, label="K=0 ")
    _set_depth(llm, [[1, max_seqs, k]])
    _timed(llm, _prompts(4, 16, vocab, rng), t1, 1)
    kk = _decode_steps(llm, [(b, prompt) for b in verify_batches], vocab, t1, t2, repeats, rng, label=f"K={k} ",
                       count_steps=True)
    if model_free:
        print("  acceptance: not measured for model-free drafts (a run's own: `predict --sim "
              "spec_ngram_acceptance=...`)", flush=True)
        return {"k": k, "model_free": True, "prompt": prompt, "decode_k0": k0, "decode_k": kk, "acceptance": None}
    # Acceptance where the service speculates: in the tail, while at most
    # `tail_seqs` sequences run (the long responses, not the bulk's short ones).
    tail_seqs = min(tail_seqs, max_seqs)
    _set_depth(llm, [[1, tail_seqs, k]] + ([[tail_seqs + 1, max_seqs, 0]] if tail_seqs < max_seqs else []))
    d0, p0 = _spec_counters(llm)
    sp = SamplingParams(n=samples, max_tokens=max_tokens, temperature=1.0)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids} for ids in task_prompts], sp, use_tqdm=False)
    d1, p1 = _spec_counters(llm)
    drafts = d1 - d0
    accepted = [b - a for a, b in zip(p0 + [0] * (len(p1) - len(p0)), p1)][:k]
    rates, length = _acceptance(drafts, accepted)
    print(f"  acceptance on {len(task_prompts)} task prompts x {samples}, drafting at <= {tail_seqs} sequences "
          f"({time.perf_counter() - t0:.0f} s): "
          f"{length:.2f} tokens per verify, per position " + ", ".join(f"{r:.2f}" for r in rates), flush=True)
    return {"k": k, "decode_k0": k0, "decode_k": kk,
            "acceptance": {"drafts": drafts, "accepted_per_position": accepted, "rates": rates,
                           "mean_acceptance_length": length, "prompts": len(task_prompts), "samples": samples,
                           "max_tokens": max_tokens, "tail_seqs": tail_seqs}}


def _acceptance(drafts: int, accepted: list[int]) -> tuple[list[float], float]:
    """(acceptance rate per draft position, P(position i accepted | positions
    < i accepted); mean tokens per verify) from the drafts and the accepted
    tokens per position."""
    rates, before = [], drafts
    for a in accepted:
        rates.append(a / before if before else 0.0)
        before = a
    return rates, (1.0 + sum(accepted) / drafts if drafts else 1.0)


def _lstsq_dropping_negatives(cols: dict[str, np.ndarray], y: np.ndarray, keep: frozenset | set = frozenset()) -> dict:
    """Least squares of `y` on the named columns, refitted without the first
    negative coefficient (outside `keep`) until none is left or one column
    remains; dropped columns get 0."""
    names = list(cols)
    while True:
        coef, *_ = np.linalg.lstsq(np.stack([cols[n] for n in names], axis=1), y, rcond=None)
        negative = [n for n, c in zip(names, coef) if c < 0 and n not in keep]
        if not negative or len(names) == 1:
            break
        names.remove(negative[0])
    out = {n: 0.0 for n in cols}
    out.update({n: float(c) for n, c in zip(names, coef)})
    return out


FLOOR_BATCH = 4  # steps at this batch and below, short prompts: the memory-bound floor
TAIL_PROMPT = 768  # the context a rollout's tail decodes at (tiny-reasoner responses run to ~900 tokens)


def fit(m: dict) -> dict:
    """Least-squares cost model from the measurements (negative terms dropped).

    A step is memory-bound at small batches (flat: it streams the weights
    whatever the batch) and grows with the batch past that, so the fit is

        step(B, ctx) = max(decode_floor_s, decode_base_s + decode_per_seq_s * B) + decode_per_ctx_token_s * ctx

    with the floor the median step at batches <= FLOOR_BATCH (short
    prompts) and the linear terms fitted to the steps above 1.1x the floor.
    A step at those batches with a long context (a rollout's tail) is the
    floor plus its context's cost, and it is fitted as such.
    With fewer than three of those the linear terms are fitted to every step
    and there is no floor."""
    d = m["decode"]
    short = min(x["prompt"] for x in d)
    small = [x["step_s"] for x in d if x["batch"] <= FLOOR_BATCH and x["prompt"] == short]
    floor = float(statistics.median(small)) if small else 0.0
    on_floor = [x for x in d if x["batch"] <= FLOOR_BATCH and x["prompt"] > short] if floor else []
    rows = [x for x in d if x["step_s"] > 1.1 * floor and x["batch"] > FLOOR_BATCH]
    if len(rows) < 3 or floor == 0.0:
        rows, floor, on_floor = d, 0.0, []

    def columns(xs, linear: float = 1.0):
        """The fit's columns; `linear` 0 for steps on the floor (their context's cost alone)."""
        return {"decode_base_s": np.full(len(xs), linear),
                "decode_per_seq_s": linear * np.array([x["batch"] for x in xs], float),
                "decode_per_ctx_token_s": np.array([x["context_tokens"] for x in xs], float)}

    above, flat = columns(rows), columns(on_floor, linear=0.0)
    y = np.array([x["step_s"] for x in rows] + [x["step_s"] - floor for x in on_floor])
    params = _lstsq_dropping_negatives({c: np.concatenate([above[c], flat[c]]) for c in above}, y,
                                       keep={"decode_base_s"})
    params["decode_floor_s"] = floor
    cols = columns(d)
    y = np.array([x["step_s"] for x in d])
    pred = (np.maximum(floor, params["decode_base_s"] + params["decode_per_seq_s"] * cols["decode_per_seq_s"])
            + params["decode_per_ctx_token_s"] * cols["decode_per_ctx_token_s"])
    r2 = 1 - float(((y - pred) ** 2).sum() / max(((y - y.mean()) ** 2).sum(), 1e-30))
    p = np.array([x["prompt"] for x in m["prefill"]], float)
    t = np.array([x["time_s"] for x in m["prefill"]])
    slope = float(np.polyfit(p, t, 1)[0]) if len(p) > 1 else 0.0
    params["prefill_per_token_s"] = max(0.0, slope)
    return {"sim_params": params, "decode_fit_r2": r2,
            "max_relative_error": float(np.max(np.abs(pred - y) / y))}


def fit_draft(params: dict, d: dict) -> dict:
    """The simulated engine's speculation costs from `measure_draft`.

    A verify step at depth K, against a K = 0 step of the same engine and
    batch n, costs K drafts and the verification of K more tokens per
    sequence; `SimParams` prices them as

        extra(n) = K * spec_draft_cost * (decode_base_s + decode_per_seq_s * n)
                 + K * spec_verify_cost * decode_per_seq_s * n

    fitted by non-negative least squares. A K = 0 step of a draft-model
    engine costs (1 + spec_draft_cost) plain steps in the simulator: the
    measured K = 0 steps against the plain engine's show how far that holds.
    The acceptance per position is the measured one.

    With model-free drafts (`--draft ngram`) the draft term is
    `spec_ngram_draft_cost` (the proposer and the verify step's fixed
    machinery, per draft token), K is the number of tokens the steps drafted
    per sequence, and the acceptance is left to the run."""
    k = int(d["k"])
    model_free = bool(d.get("model_free"))
    base, per_seq = float(params["decode_base_s"]), float(params["decode_per_seq_s"])
    k0 = {x["batch"]: x["step_s"] for x in d["decode_k0"]}
    rows = [(x["batch"], x["step_s"] - k0[x["batch"]], x.get("draft_tokens_per_seq_step", k) if model_free else k)
            for x in d["decode_k"] if x["batch"] in k0]
    if not rows:
        raise ValueError("no verify step measured at a batch size measured at K = 0")
    n = np.array([r[0] for r in rows], float)
    y = np.array([r[1] for r in rows])
    kd = np.array([r[2] for r in rows], float)
    draft_term = "spec_ngram_draft_cost" if model_free else "spec_draft_cost"
    cols = {draft_term: kd * (base + per_seq * n), "spec_verify_cost": kd * per_seq * n}
    sim = {c: max(0.0, v) for c, v in _lstsq_dropping_negatives(cols, y).items()}
    pred = sum(sim[c] * cols[c] for c in cols)
    plain = [base + per_seq * x["batch"] for x in d["decode_k0"]]
    k0_ratio = [x["step_s"] / p for x, p in zip(d["decode_k0"], plain)]
    if d.get("acceptance"):
        sim["spec_acceptance"] = [round(float(r), 4) for r in d["acceptance"]["rates"]]
    out = {"sim_params": sim,
           "verify_extra_s": {int(b): float(v) for b, v in zip(n, y)},
           "verify_extra_fit_s": {int(b): float(v) for b, v in zip(n, pred)},
           "k0_over_plain": {x["batch"]: float(r) for x, r in zip(d["decode_k0"], k0_ratio)},
           "mean_acceptance_length": (d.get("acceptance") or {}).get("mean_acceptance_length")}
    if model_free:
        out["draft_tokens_per_seq_step"] = {int(b): float(v) for b, v in zip(n, kd)}
        # A verify step against a K = 0 step of the same batch: what a model-free draft costs in plain steps.
        out["verify_over_k0"] = {int(b): float((k0[int(b)] + v) / k0[int(b)]) for b, v in zip(n, y)}
    return out


def _shutdown(llm) -> None:
    with contextlib.suppress(RuntimeError, AttributeError):  # already gone
        llm.llm_engine.engine_core.shutdown()


def start_draft_engine(args, model: str, max_len: int, batches: list[int]):
    """An engine of the same model that speculates as `--draft` says, at
    K = 0 until told otherwise."""
    from vllm import LLM

    from rollout_service.engines.spec_config import SpecConfig

    model_free = args.draft == "ngram"
    if model_free:  # a match of the last token anywhere in a long prompt: nearly every step drafts
        spec = SpecConfig(method="ngram", num_speculative_tokens=args.spec_k, prompt_lookup_min=1,
                          prompt_lookup_max=4, schedule=[[1, 1 << 16, 0]])
        what = "model-free drafts (n-gram prompt lookup)"
    else:
        from rollout_service.drafter.eagle import is_head_dir

        method = "eagle" if is_head_dir(args.draft) else "draft_model"
        spec = SpecConfig(method=method, model="" if args.draft == "bundled" else args.draft,
                          num_speculative_tokens=args.spec_k, schedule=[[1, 1 << 16, 0]])
        what = f"{'EAGLE head' if method == 'eagle' else 'draft model'} {Path(spec.draft_model_path()).name}"
    max_seqs = max(batches)
    print(f"speculation: {what}, K=0 and K={args.spec_k}; starting the engine...", flush=True)
    return LLM(model=model, dtype=args.dtype, enforce_eager=True, max_model_len=max_len, max_num_seqs=max_seqs,
               enable_prefix_caching=False, seed=0, disable_log_stats=False,
               speculative_config=spec.vllm_speculative_config(max_seqs))


def calibrate_draft(args, model: str, vocab: int, max_len: int, batches: list[int], llm=None) -> dict:
    """`measure_draft` on an engine of the same model with the draft model
    attached (`llm`, or one started here), shut down after."""
    from rollout_service.bench.workloads.tiny_reasoner import generate

    model_free = args.draft == "ngram"
    max_seqs = max(batches)
    if llm is None:
        llm = start_draft_engine(args, model, max_len, batches)
        _barrier(args, "draft-up")
    workload = generate(1, args.task_groups, seed=args.seed, samples_per_group=4)
    prompts = [list(g.prompt_token_ids) for g in workload.steps[0]]
    try:
        return measure_draft(llm, vocab, batches, [int(b) for b in args.verify_batches.split(",")], args.spec_k,
                             max_seqs, args.repeats, args.quick, prompts, 4, workload.max_tokens,
                             model_free=model_free,
                             prompt=min(448, max_len - decode_tokens(args.quick)[1] - 8) if model_free else 16)
    finally:
        _shutdown(llm)


def _barrier(args, name: str, timeout_s: float = 900.0) -> None:
    """In a side-by-side calibration: wait until every engine has reached
    `name` (a file per engine in the shared directory), so that they measure
    at the same time."""
    if not args.barrier:
        return
    d = Path(args.barrier)
    (d / f"{name}.{args.index}").touch()
    deadline = time.monotonic() + timeout_s
    while len(list(d.glob(f"{name}.*"))) < args.of:
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout_s:.0f} s waiting for the other engines ({name})")
        time.sleep(0.05)


def _fitted(result: dict) -> dict:
    """`result` (its measurements and, with a draft model, draft
    measurements) with the fits added."""
    result.update(fit(result["measurements"]))
    if "draft_measurements" in result:
        spec = fit_draft(result["sim_params"], result["draft_measurements"])
        result["sim_params"].update(spec.pop("sim_params"))
        result["draft_fit"] = spec
    return result


def _mean_steps(runs: list[list[dict]]) -> list[dict]:
    """Decode steps of the same shapes measured on several engines: the mean step."""
    out = []
    for rows in zip(*runs):
        step = statistics.fmean(r["step_s"] for r in rows)
        tps = [r["tokens_per_s"] for r in rows if r["tokens_per_s"]]
        out.append({**rows[0], "step_s": step, "tokens_per_s": statistics.fmean(tps) if tps else None,
                    "step_s_per_engine": [r["step_s"] for r in rows]})
        if "draft_tokens_per_seq_step" in rows[0]:
            out[-1]["draft_tokens_per_seq_step"] = statistics.fmean(r["draft_tokens_per_seq_step"] for r in rows)
    return out


def merge(results: list[dict]) -> dict:
    """One calibration from the same schedule measured on engines side by
    side: mean step and prefill times, the acceptance of all their drafts."""
    ms = [r["measurements"] for r in results]
    m = {"decode": _mean_steps([x["decode"] for x in ms]),
         "prefill": [{**rows[0], "time_s": statistics.fmean(r["time_s"] for r in rows)} for rows in zip(*(x["prefill"] for x in ms))],
         "decode_tokens": ms[0]["decode_tokens"]}
    merged = {k: v for k, v in results[0].items() if k not in ("measurements", "draft_measurements")}
    merged.update(engines=len(results), cores=",".join(str(r["cores"]) for r in results),
                  load_average=list(os.getloadavg()), measured_at=time.strftime("%Y-%m-%d %H:%M:%S"),
                  startup_s=max(r["startup_s"] for r in results), measurements=m)
    if all("draft_measurements" in r for r in results):
        ds = [r["draft_measurements"] for r in results]
        acc = [d["acceptance"] for d in ds]
        merged["draft_measurements"] = {**{k: v for k, v in ds[0].items() if k not in ("decode_k0", "decode_k")},
                                        "decode_k0": _mean_steps([d["decode_k0"] for d in ds]),
                                        "decode_k": _mean_steps([d["decode_k"] for d in ds])}
        if all(acc):
            drafts = sum(a["drafts"] for a in acc)
            accepted = [sum(col) for col in zip(*(a["accepted_per_position"] for a in acc))]
            rates, length = _acceptance(drafts, accepted)
            merged["draft_measurements"]["acceptance"] = {
                **acc[0], "drafts": drafts, "accepted_per_position": accepted, "rates": rates,
                "mean_acceptance_length": length, "prompts": sum(a["prompts"] for a in acc),
                "samples": acc[0]["samples"], "mean_acceptance_length_per_engine": [a["mean_acceptance_length"] for a in acc]}
    merged = _fitted(merged)
    merged["per_engine"] = [{"cores": r["cores"], "sim_params": r["sim_params"],
                             "mean_acceptance_length": r.get("draft_fit", {}).get("mean_acceptance_length")}
                            for r in results]
    return merged


def _child_args(args) -> list[str]:
    """The options a side-by-side calibration's engines share."""
    out = ["--model", args.model or default_model(), "--dtype", args.dtype, "--batches", args.batches,
           "--kv-gib", args.kv_gib, "--repeats", str(args.repeats), "--spec-k", str(args.spec_k),
           "--verify-batches", args.verify_batches, "--task-groups", str(args.task_groups)]
    if args.quick:
        out.append("--quick")
    if args.draft:
        out += ["--draft", args.draft]
    return out


def side_by_side(args) -> dict:
    """`--engines N`: N calibrations at once, engine i bound to core i, each
    in a process of its own; their progress lines are prefixed with the
    engine. Returns the merged calibration."""
    import threading

    cores = os.cpu_count() or 1
    if args.engines > cores:
        print(f"warning: {args.engines} engines on {cores} cores: engines share cores", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="calibrate-") as tmp:
        procs, readers = [], []
        for i in range(args.engines):
            cmd = [sys.executable, "-m", "research.calibrate", *_child_args(args), "--cores", str(i % cores),
                   "--out", str(Path(tmp) / f"engine-{i}.json"), "--seed", str(args.seed + i),
                   "--barrier", tmp, "--index", str(i), "--of", str(args.engines)]
            env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}
            p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, bufsize=1)
            procs.append(p)

            def relay(p=p, i=i):
                for line in p.stdout:
                    print(f"[engine {i}] {line}", end="", flush=True)

            readers.append(threading.Thread(target=relay, daemon=True))
            readers[-1].start()
        try:  # until all are done or one fails (then the others are stopped)
            while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for t in readers:
                t.join(timeout=5)
        failed = [i for i, p in enumerate(procs) if p.wait() != 0]
        if failed:
            raise SystemExit(f"side-by-side calibration: engine(s) {', '.join(map(str, failed))} failed "
                             f"(exit {', '.join(str(procs[i].returncode) for i in failed)}); see their output above")
        return merge([json.loads((Path(tmp) / f"engine-{i}.json").read_text()) for i in range(args.engines)])


async def _service_steps(args, model: str, vocab: int, max_len: int, batches: list[int]) -> dict:
    """`measure`'s schedule through the rollout service: N vLLM engines
    behind the gRPC server, as `research run --engine vllm` starts them
    (least-assigned placement, a batch cap of the largest batch), talked to
    by the real client. A shape of batch B puts B one-sample groups of fixed
    length (`min_tokens` = `max_tokens` = t2) on each engine at once; its
    step is, per engine, the time between the first and the last token of
    the request whose first token came last, on the service's clock (what
    the service saw of the engine: its output processing and streaming to
    the client share the cores with the engines), the mean over the
    engines. Prefill: one prompt per engine, one token, submission to first
    token."""
    import asyncio

    from research.policies import parse_policy
    from research.targets import FleetSpec, grpc_fleet
    from trainer_client import PromptGroup

    rng = np.random.default_rng(args.seed)
    t1, t2 = decode_tokens(args.quick)
    n = args.engines
    spec = FleetSpec(engines=n, policy=parse_policy("least-assigned"), kind="vllm", max_seqs=max(batches), model=model,
                     kv_cache_gib=float(args.kv_gib))
    print(f"calibrating {model} through the service: {n} vLLM engine(s), batch cap {max(batches)}; starting...",
          flush=True)
    t0 = time.perf_counter()
    async with grpc_fleet(spec) as fleet:
        startup = time.perf_counter() - t0
        print(f"  service up in {startup:.1f} s", flush=True)
        client = fleet.target.client
        stream = fleet.target.completions()
        shape_no = iter(range(1 << 30))

        async def run(b: int, p: int, tokens: int) -> dict[str, list]:
            """b fixed-length requests per engine at once; their completions by engine."""
            tag = f"cal{next(shape_no)}"
            groups = [PromptGroup(prompt_token_ids=rng.integers(3, vocab, size=p).tolist(), num_samples=1,
                                  max_tokens=tokens, min_tokens=tokens, temperature=1.0, group_id=f"{tag}-{i}")
                      for i in range(b * n)]
            await client.submit(groups)
            by_engine: dict[str, list] = {}
            left = len(groups)
            while left:
                c = await asyncio.wait_for(stream.__anext__(), timeout=1800)
                if not c.group_id.startswith(f"{tag}-"):
                    continue  # redelivered from an earlier shape
                left -= 1
                if c.response_len != tokens or c.num_migrations:
                    raise RuntimeError(f"a calibration request came back with {c.response_len} tokens "
                                       f"(asked for {tokens}), {c.num_migrations} migrations")
                by_engine.setdefault(c.engines[-1], []).append(c)
            counts = sorted(len(v) for v in by_engine.values())
            if counts != [b] * n:
                raise RuntimeError(f"placement put {counts} requests on the engines, not {b} on each of {n}")
            return by_engine

        async def step(b: int, p: int) -> dict:
            per_engine: dict[str, list[float]] = {}
            for _ in range(args.repeats):
                for e, cs in (await run(b, p, t2)).items():
                    last = max(cs, key=lambda c: c.first_token_at)
                    per_engine.setdefault(e, []).append((last.finished_at - last.first_token_at) / (t2 - 1))
            steps = [statistics.median(v) for _, v in sorted(per_engine.items())]
            mean = statistics.fmean(steps)
            print(f"  decode batch {b:>3} x {n} engines, prompt {p:>4}: {mean * 1e3:7.3f} ms/step "
                  f"({', '.join(f'{x * 1e3:.1f}' for x in steps)})", flush=True)
            return {"batch": b, "prompt": p, "context_tokens": b * (p + t2 / 2), "step_s": mean,
                    "tokens_per_s": b / mean if mean > 0 else None, "step_s_per_engine": steps}

        await run(4, 16, t2)  # warm-up
        shapes, lengths = schedule(batches, max_len, args.quick)
        decode = [await step(b, p) for b, p in shapes]
        prefill = []
        for p in lengths:
            times = []
            for _ in range(args.repeats):
                times += [c.first_token_at - c.queued_at for cs in (await run(1, p, 1)).values() for c in cs]
            prefill.append({"prompt": p, "time_s": statistics.median(times)})
            print(f"  prefill {p:>4} tokens: {prefill[-1]['time_s'] * 1e3:7.2f} ms", flush=True)
        await stream.aclose()
    return {"startup_s": startup,
            "measurements": {"decode": decode, "prefill": prefill, "decode_tokens": [t1, t2],
                             "decode_timing": "through the service: the service's clock between the first and last "
                                              "token of the request prefilled last, per engine, mean over engines"}}


def through_service(args) -> dict:
    """`--service`: the plain costs measured through the rollout service
    (`_service_steps`); with `--draft-from FILE` the speculation terms are
    fitted to that calibration's draft measurements, against these costs."""
    import asyncio

    model = args.model or default_model()
    config = json.loads((Path(model) / "config.json").read_text())
    max_len = min(int(config.get("max_position_embeddings", 2048)), 4096)
    batches = [int(b) for b in args.batches.split(",")]
    measured = asyncio.run(_service_steps(args, model, int(config["vocab_size"]), max_len, batches))
    result = {"model": Path(model).name, "device": "cpu", "dtype": args.dtype, "engines": args.engines,
              "through_service": True, "kv_cache_gib": float(args.kv_gib),
              "load_average": list(os.getloadavg()), "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"), **measured}
    if args.draft_from:
        other = json.loads(Path(args.draft_from).read_text())
        if "draft_measurements" not in other:
            raise SystemExit(f"--draft-from {args.draft_from}: no draft measurements in it (calibrate with --draft)")
        result["draft_measurements"] = other["draft_measurements"]
        result["draft_measurements_from"] = str(args.draft_from)
    return _fitted(result)


def calibrate_one(args) -> dict:
    """The measurements of one engine (and of its draft-model twin)."""
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
    # An n-gram engine at K = 0 steps as a plain one: it measures both, started once.
    shared = args.draft == "ngram"
    llm = (start_draft_engine(args, model, max_len, batches) if shared else
           LLM(model=model, dtype=args.dtype, enforce_eager=True, max_model_len=max_len,
               max_num_seqs=max(batches), enable_prefix_caching=False, seed=0, disable_log_stats=False))
    startup = time.perf_counter() - t0
    print(f"  engine up in {startup:.1f} s", flush=True)
    _barrier(args, "up")
    m = measure(llm, int(config["vocab_size"]), max_len, batches, args.repeats, args.quick)
    draft = None
    if args.draft:
        if not shared:
            _shutdown(llm)
        draft = calibrate_draft(args, model, int(config["vocab_size"]), max_len, batches, llm if shared else None)
    result = {
        "model": Path(model).name,
        "device": device,
        "dtype": args.dtype,
        "engines": 1,
        "cores": args.cores if device == "cpu" else None,
        "kv_cache_gib": float(args.kv_gib) if device == "cpu" else None,
        "startup_s": startup,
        "load_average": list(os.getloadavg()),  # other work on the machine inflates the step times
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "measurements": m,
    }
    if draft is not None:
        result["draft_measurements"] = draft
    return _fitted(result)


def _speed_reference(args) -> dict:
    return speed_reference.measure_or_warn(args.model or default_model(), copies=min(args.engines, os.cpu_count() or 1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model directory (default: the bundled tiny reasoner)")
    ap.add_argument("--out", default="", help=f"where to write the fit (JSON; default {DEFAULT_OUT.name} in "
                                               "research/calibration, with --refit the file refitted)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64", help="running batch sizes to measure")
    ap.add_argument("--engines", type=int, default=1,
                    help="engines calibrated side by side at once, engine i on core i, as a fleet runs them "
                         "(CPU: they share the memory bus); the fit is of their mean step times")
    ap.add_argument("--cores", default="0", help="CPU only, one engine: cores it is bound to (VLLM_CPU_OMP_THREADS_BIND)")
    ap.add_argument("--kv-gib", default="1", help="CPU only: KV cache (VLLM_CPU_KVCACHE_SPACE, GiB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="fewer, shorter measurements")
    ap.add_argument("--draft", default="", metavar="DIR|bundled|ngram",
                    help="also calibrate speculation with this draft model or EAGLE head directory ('bundled': "
                         "the bundled drafter): "
                         "a second engine measures steps at K=0 and K=--spec-k and the acceptance on the task's prompts; "
                         "'ngram': model-free drafts (n-gram, siblings), their verify steps' cost only")
    ap.add_argument("--spec-k", type=int, default=4,
                    help="with --draft: the depth of the verify steps and of the acceptance measured (the service's largest K)")
    ap.add_argument("--verify-batches", default="1,2,4,16",
                    help="with --draft: batch sizes of the verify steps measured (the default schedule speculates up to 16)")
    ap.add_argument("--task-groups", type=int, default=16,
                    help="with --draft: tiny-reasoner prompts (x 4 samples) the acceptance is measured on")
    ap.add_argument("--refit", metavar="JSON",
                    help="measure nothing: fit the cost model again to the measurements stored in this calibration "
                         "file (with the current fit) and write it to --out")
    ap.add_argument("--service", action="store_true",
                    help="measure through the rollout service: --engines vLLM engines behind the gRPC server as a "
                         "load-test run starts them, steps timed on the service's clock (what the fleet pays "
                         "beyond the engines); the speculation terms come from --draft-from")
    ap.add_argument("--draft-from", metavar="JSON", default="",
                    help="with --service: fit the speculation terms to this calibration's draft measurements "
                         "(a calibration with --draft)")
    ap.add_argument("--seed", type=int, default=0,
                    help="with --draft: seed of the task's prompts (engine i of --engines N takes seed + i)")
    # The engines of a side-by-side calibration: a shared directory to meet in.
    ap.add_argument("--barrier", default="", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--of", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.draft and args.draft not in ("bundled", "ngram") and not (Path(args.draft) / "config.json").is_file():
        ap.error(f"--draft {args.draft}: not a model directory (no config.json); 'bundled' takes the bundled drafter, "
                 "'ngram' model-free drafts")
    if args.engines < 1:
        ap.error(f"--engines {args.engines}: at least 1")
    if args.model and not (Path(args.model) / "config.json").is_file():
        ap.error(f"--model {args.model}: not a model directory (no config.json)")

    if args.service and args.draft:
        ap.error("--service measures the plain costs only: take the speculation terms from a calibration with "
                 "--draft (--draft-from FILE)")
    if args.draft_from and not args.service:
        ap.error("--draft-from goes with --service")
    if args.draft_from and not Path(args.draft_from).is_file():
        ap.error(f"--draft-from {args.draft_from}: no such file")
    if args.refit:
        result = json.loads(Path(args.refit).read_text())
        result.pop("draft_fit", None)
        result = _fitted({**result, "refitted_at": time.strftime("%Y-%m-%d %H:%M:%S")})
    else:
        reference = None if args.barrier or not speed_reference.on_cpu() else _speed_reference(args)
        result = (through_service(args) if args.service
                  else side_by_side(args) if args.engines > 1 else calibrate_one(args))
        # The host's speed over the calibration: `predict` scales the fit by a run's own.
        reference = speed_reference.bracket(reference, _speed_reference(args) if reference is not None else None)
        if reference is not None:
            result["speed_reference"] = reference
            print(speed_reference.describe(reference), flush=True)
    out = Path(args.out or args.refit or DEFAULT_OUT)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    if args.barrier:
        return 0  # an engine of a side-by-side calibration: the parent prints the merged fit
    print(json.dumps({k: result[k] for k in ("model", "device", "sim_params", "decode_fit_r2", "max_relative_error")}, indent=2))
    for e in result.get("per_engine", []):
        p = e["sim_params"]
        print(f"  engine on core {e['cores']}: base {p['decode_base_s'] * 1e3:.1f} ms, "
              f"per sequence {p['decode_per_seq_s'] * 1e3:.2f} ms"
              + (f", acceptance {e['mean_acceptance_length']:.2f}" if e["mean_acceptance_length"] else ""))
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    from research.interrupt import stop_on_sigterm

    stop_on_sigterm()
    sys.exit(main())
