#!/usr/bin/env python
"""Measure the bundled tiny reasoning model and its drafter.

    VLLM_CPU_KVCACHE_SPACE=1 python scripts/measure_tiny_models.py            # vLLM
    python scripts/measure_tiny_models.py --engine hf                         # transformers only

Samples one response at temperature 1.0 for each of ``--n`` (256) held-out
problems of the ``default`` difficulty and reports the pass rate, the
failure breakdown (wrong step / runaway length / other), the response-length
distribution (p50 / p90 / max, slot utilisation, share of tokens in the
longest 10 %), and the drafter's greedy agreement with the target on those
samples.  Writes ``docs/tiny_reasoner_stats.json`` and a histogram + CDF of
response lengths to ``docs/tiny_reasoner_lengths.png``.

Definitions:

* response length: generated tokens, the end token included;
* runaway: the response hit the token limit (1024 positions minus the
  prompt) without emitting the end token;
* slot utilisation: mean / max response length, i.e. the share of decode
  slot-steps doing useful work when a batch waits for its longest response;
* drafter greedy agreement: over every response position of the target's
  samples, the fraction where the drafter's argmax (given the target's
  prefix) equals the target's argmax.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from rollout_service.assets import tiny_draft_path, tiny_model_path  # noqa: E402
from rollout_service.tasks import FAMILIES, check, decode, generate_problems  # noqa: E402
from rollout_service.tasks.tokenizer import EOS_ID, PAD_ID, prompt_token_ids  # noqa: E402
from rollout_service.tasks.verifier import Verdict  # noqa: E402

MAX_MODEL_LEN = 1024
#: Held-out problems: training draws from other seeds.
EVAL_SEED = 20240601

WRONG_STEP = ("wrong_step", "wrong_answer")


@dataclass
class Rollout:
    problem: object
    prompt_ids: list
    token_ids: list
    finished: bool
    verdict: Verdict

    @property
    def failure(self):
        if self.verdict.correct:
            return None
        if not self.finished:
            return "runaway"
        if self.verdict.reason in WRONG_STEP:
            return "wrong_step"
        return "other"


def sample_vllm(model_path: Path, problems, seed: int):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model_path), dtype="float32", enforce_eager=True,
              max_model_len=MAX_MODEL_LEN, seed=seed)
    prompts = [prompt_token_ids(p) for p in problems]
    # The engine's own tokenizer must agree with the task's ids, so text
    # prompts sent to the engine mean the same thing.
    tok = llm.get_tokenizer()
    for p, ids in zip(problems, prompts):
        if list(tok.encode(p.prompt)) != ids:
            raise RuntimeError(f"vLLM tokenizer disagrees on {p.prompt!r}: {tok.encode(p.prompt)}")
    params = [SamplingParams(temperature=1.0, top_p=1.0, top_k=0,
                             max_tokens=MAX_MODEL_LEN - len(ids), seed=seed + i)
              for i, ids in enumerate(prompts)]
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    rollouts = []
    for p, ids, o in zip(problems, prompts, outs):
        c = o.outputs[0]
        toks = list(c.token_ids)
        finished = c.finish_reason == "stop"
        if finished and (not toks or toks[-1] != EOS_ID):
            toks.append(EOS_ID)  # count the end token as the transformers path does
        text = decode(toks)
        if c.text != text:
            raise RuntimeError(f"vLLM detokenisation differs: {c.text!r} != {text!r}")
        verdict = check(p, text)
        if not finished and verdict.correct:
            verdict = Verdict(0.0, "truncated")
        rollouts.append(Rollout(p, ids, toks, finished, verdict))
    del llm
    return rollouts


def sample_hf(model, problems, seed: int):
    from rollout_service.tasks.sampling import sample_responses

    width = max(len(prompt_token_ids(p)) for p in problems)
    samples = sample_responses(model, problems, temperature=1.0, seed=seed,
                               max_new_tokens=MAX_MODEL_LEN - width, batch_size=64)
    return [Rollout(s.problem, prompt_token_ids(s.problem), list(s.token_ids), s.finished,
                    s.verdict) for s in samples]


def drafter_agreement(target, draft, rollouts, batch_size: int = 16):
    """Greedy agreement and expected speculative acceptance (temperature 1)."""
    import torch

    agree = total = 0
    accept_sum = 0.0
    sampled_agree = 0
    for start in range(0, len(rollouts), batch_size):
        batch = rollouts[start:start + batch_size]
        seqs = [r.prompt_ids + r.token_ids for r in batch]
        width = max(len(s) for s in seqs)
        x = torch.full((len(seqs), width), PAD_ID, dtype=torch.long)
        m = torch.zeros_like(x)
        for i, s in enumerate(seqs):
            x[i, :len(s)] = torch.tensor(s)
            m[i, :len(s)] = 1
        with torch.inference_mode():
            lt = target(input_ids=x, attention_mask=m).logits.float()
            ld = draft(input_ids=x, attention_mask=m).logits.float()
        for i, r in enumerate(batch):
            a = len(r.prompt_ids) - 1          # position predicting the first response token
            b = len(seqs[i]) - 1               # last position predicting a response token
            if b <= a:
                continue
            pt, pd = lt[i, a:b], ld[i, a:b]
            gt, gd = pt.argmax(-1), pd.argmax(-1)
            agree += int((gt == gd).sum())
            sampled = torch.tensor(r.token_ids[: b - a])
            sampled_agree += int((gd == sampled).sum())
            accept_sum += float(torch.minimum(pt.softmax(-1), pd.softmax(-1)).sum(-1).sum())
            total += b - a
    return {
        "positions": total,
        "greedy_agreement": agree / total,
        "draft_argmax_equals_sampled_token": sampled_agree / total,
        "expected_acceptance_t1": accept_sum / total,
    }


def length_stats(lengths):
    import numpy as np

    arr = np.sort(np.asarray(lengths, dtype=float))
    n = len(arr)
    top = arr[int(np.floor(0.9 * n)):]
    return {
        "n": n,
        "mean": float(arr.mean()),
        "p50": float(np.percentile(arr, 50)),
        "p90": float(np.percentile(arr, 90)),
        "p99": float(np.percentile(arr, 99)),
        "max": int(arr.max()),
        "max_over_median": float(arr.max() / np.median(arr)),
        "slot_utilisation": float(arr.mean() / arr.max()),
        "top10_token_share": float(top.sum() / arr.sum()),
    }


def batch_utilisation(lengths, batch: int):
    import numpy as np

    vals = []
    for i in range(0, len(lengths) - batch + 1, batch):
        chunk = np.asarray(lengths[i:i + batch], dtype=float)
        vals.append(chunk.mean() / chunk.max())
    return {"batch": batch, "mean": float(np.mean(vals)), "max": float(np.max(vals)),
            "min": float(np.min(vals))}


def plot(lengths, stats, path: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    arr = np.sort(np.asarray(lengths))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    bins = np.logspace(np.log10(max(1, arr.min())), np.log10(arr.max() + 1), 40)
    ax1.hist(arr, bins=bins, color="#4477aa", edgecolor="white")
    ax1.set_xscale("log")
    ax1.set_xlabel("response length (tokens, log scale)")
    ax1.set_ylabel("responses")
    ax1.set_title("histogram")
    ax2.plot(arr, np.arange(1, len(arr) + 1) / len(arr), color="#4477aa", lw=2,
             label="share of responses")
    ax2.plot(arr, np.cumsum(arr) / arr.sum(), color="#cc6677", lw=2, ls="--",
             label="share of tokens")
    ax2.set_xscale("log")
    ax2.set_xlabel("response length (tokens, log scale)")
    ax2.set_ylabel("cumulative share")
    ax2.set_title("CDF")
    ax2.legend(loc="upper left")
    for ax in (ax1, ax2):
        for key, style in (("p50", ":"), ("p90", "-."), ("max", "-")):
            ax.axvline(stats[key], color="gray", ls=style, lw=1)
            ax.text(stats[key], ax.get_ylim()[1] * 0.97, f" {key} {stats[key]:.0f}",
                    rotation=90, va="top", ha="right", fontsize=8, color="gray")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("vllm", "hf"), default="vllm")
    ap.add_argument("--model", type=Path, default=tiny_model_path())
    ap.add_argument("--draft", type=Path, default=tiny_draft_path())
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--seed", type=int, default=EVAL_SEED)
    ap.add_argument("--difficulty", default="default")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out-json", type=Path, default=REPO / "docs" / "tiny_reasoner_stats.json")
    ap.add_argument("--out-png", type=Path, default=REPO / "docs" / "tiny_reasoner_lengths.png")
    args = ap.parse_args(argv)

    import torch

    from rollout_service.tasks.sampling import load_model

    torch.set_num_threads(args.threads)
    problems = generate_problems(args.n, seed=args.seed, difficulty=args.difficulty)
    t0 = time.time()
    if args.engine == "vllm":
        rollouts = sample_vllm(args.model, problems, args.seed)
        target = load_model(args.model)
    else:
        target = load_model(args.model)
        rollouts = sample_hf(target, problems, args.seed)
    sample_s = time.time() - t0
    print(f"sampled {len(rollouts)} responses with {args.engine} in {sample_s:.1f}s", flush=True)

    lengths = [len(r.token_ids) for r in rollouts]
    stats = length_stats(lengths)
    fails = {"wrong_step": 0, "runaway": 0, "other": 0}
    reasons: dict[str, int] = {}
    for r in rollouts:
        if r.failure:
            fails[r.failure] += 1
            key = "runaway" if r.failure == "runaway" else r.verdict.reason
            reasons[key] = reasons.get(key, 0) + 1
    per_family = {}
    for fam in FAMILIES:
        rs = [r for r in rollouts if r.problem.family == fam]
        if rs:
            per_family[fam] = {"n": len(rs), "pass_rate": sum(r.verdict.reward for r in rs) / len(rs),
                               "p50_tokens": sorted(len(r.token_ids) for r in rs)[len(rs) // 2],
                               "max_tokens": max(len(r.token_ids) for r in rs)}
    correct_lengths = [len(r.token_ids) for r in rollouts if r.verdict.correct]
    pass_rate = sum(r.verdict.reward for r in rollouts) / len(rollouts)

    draft = load_model(args.draft)
    t1 = time.time()
    agreement = drafter_agreement(target, draft, rollouts)
    agreement["seconds"] = round(time.time() - t1, 1)

    def n_params(m):
        return sum(p.numel() for p in m.parameters())

    result = {
        "engine": args.engine,
        "n": len(rollouts),
        "difficulty": args.difficulty,
        "seed": args.seed,
        "temperature": 1.0,
        "max_model_len": MAX_MODEL_LEN,
        "target_params": n_params(target),
        "draft_params": n_params(draft),
        "pass_rate": pass_rate,
        "failures": fails,
        "failure_reasons": reasons,
        "per_family": per_family,
        "response_tokens": stats,
        "correct_response_tokens_max": max(correct_lengths) if correct_lengths else 0,
        "slot_utilisation_batches_of_64": batch_utilisation(lengths, 64),
        "drafter": agreement,
        "sampling_seconds": round(sample_s, 1),
    }
    args.out_json.parent.mkdir(parents=True, exist_ok=True)
    args.out_json.write_text(json.dumps(result, indent=2) + "\n")
    plot(lengths, stats, args.out_png,
         f"tiny-reasoner: {len(lengths)} responses at temperature 1.0 "
         f"(pass rate {pass_rate:.0%}, slot utilisation {stats['slot_utilisation']:.2f})")

    print(f"pass rate          {pass_rate:.3f}")
    print(f"failures           {fails}  ({reasons})")
    print("per family         " + ", ".join(f"{k} {v['pass_rate']:.2f}" for k, v in per_family.items()))
    print(f"response tokens    p50 {stats['p50']:.0f}  p90 {stats['p90']:.0f}  max {stats['max']}  "
          f"max/p50 {stats['max_over_median']:.1f}")
    print(f"slot utilisation   {stats['slot_utilisation']:.3f} (mean/max over all); batches of 64: "
          f"mean {result['slot_utilisation_batches_of_64']['mean']:.3f}")
    print(f"top-10% token share {stats['top10_token_share']:.3f}")
    print(f"drafter            greedy agreement {agreement['greedy_agreement']:.3f}, "
          f"expected acceptance (T=1) {agreement['expected_acceptance_t1']:.3f}")
    print(f"wrote {args.out_json} and {args.out_png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
