"""Train an EAGLE-style drafter head for a target, from the target alone.

    rollout-service build-eagle --out /tmp/eagle            # for the bundled reasoner: ~10 min on 2 idle cores
    # [engine.spec] method = "eagle", model = "/tmp/eagle"

The target samples `--samples` responses to generated problems at
temperature 1 (its own prefixes, what the engines will draft on); the head
(`rollout_service.drafter.eagle`) is distilled from the target's next-token
distributions on them and checked on `--held-out` more. No download: the
bundled reasoner (or `--target DIR`) is all it reads. The padded,
function-identical targets of `build-model` share the bundled reasoner's
last hidden state, embeddings and LM head, so a head built for the bundled
reasoner drafts for them unchanged.

Writes DIR/config.json and DIR/model.safetensors in vLLM's EAGLE layout
(its embeddings and LM head are the target's, shared by vLLM at load), the
tokenizer files, and DIR/eagle.json with the held-out acceptance per draft
depth and the tokens per verify step it implies.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

TOP_K = 256
#: Draft depths a built head is trained at: 5, the deepest the tail's depth
#: schedules draft (K=5 at one running sequence). A head trained at depth 3
#: accepts 0.92 of its drafts at depths 1-3 but 0.55 and 0.46 at 4 and 5
#: (4.18 tokens per verify step at K=5); trained at depth 5, 0.91-0.92 at
#: every depth (4.89), in about the same time. The online trainer's rounds
#: keep eagle.DEPTH (3): they are short and re-fit the depths that matter most.
BUILD_DEPTH = 5
#: Longest sampled response: as long as the longest the engines run (the
#: tiny-reasoner workload's budget is 876 tokens). The head's one decoder
#: layer learns positions only where it saw them: built on responses of at
#: most 300 tokens it accepted 0.81-0.91 of its drafts up to position 450
#: and 0.34 beyond 600, where the policy itself is as sure (0.95) as early
#: on. The tail of a rollout step is exactly those late positions.
MAX_TOKENS = 900


def build(out: str | Path, target: str | Path | None = None, samples: int = 256, held_out: int = 64,
          max_tokens: int = MAX_TOKENS, steps: int = 600, lr: float = 1e-3, depth: int = BUILD_DEPTH, seed: int = 0,
          threads: int = 0) -> dict:
    """Train and write a head; returns the summary written to DIR/eagle.json."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_service.assets import tiny_model_path
    from rollout_service.drafter import eagle
    from rollout_service.drafter.training import teacher_targets
    from rollout_service.tasks import generate_problems, prompt_token_ids

    for flag, value in (("--samples", samples), ("--held-out", held_out), ("--steps", steps), ("--depth", depth),
                        ("--max-tokens", max_tokens)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1; got {value}")
    if not lr > 0:
        raise ValueError(f"--lr must be positive; got {lr}")
    target_dir = Path(target) if target else tiny_model_path()
    if not (target_dir / "config.json").exists():
        raise FileNotFoundError(f"--target: no model in {target_dir} (config.json missing)")
    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    policy = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    policy.requires_grad_(False)
    prompts = [prompt_token_ids(p) for p in generate_problems(samples + held_out, seed=seed + 2)]
    print(f"build-eagle: sampling {len(prompts)} responses of {target_dir.name} at temperature 1 ...", flush=True)

    def sampled(done: int, total: int) -> None:
        print(f"  sampled {done}/{total} ({time.perf_counter() - t0:.0f} s)", flush=True)

    pairs = eagle.sample_responses(policy, prompts, max_tokens, seed, progress=sampled)
    train, held = pairs[:samples], pairs[samples:]
    train_targets = teacher_targets(policy, train, eagle.MAX_LEN, 0, TOP_K)
    held_targets = teacher_targets(policy, held, eagle.MAX_LEN, 0, TOP_K)
    print(f"build-eagle: distilling the head, {steps} steps at lr {lr:g} ...", flush=True)
    every = max(1, steps // 10)

    def trained(step: int, total: int, loss: float) -> None:
        if step % every == 0 or step == total:
            print(f"  step {step}/{total}: loss {loss:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)

    head, seconds, _ = eagle.train_head(policy, train, train_targets, lr, steps, depth, seed, progress=trained)
    acc = eagle.acceptance(head, policy, held, held_targets, 5)
    path = eagle.save(head, out, tokenizer_from=target_dir)

    summary = {
        "target": str(target_dir), "samples": samples, "held_out": held_out, "max_tokens": max_tokens,
        "steps": steps, "lr": lr, "depth": depth, "seed": seed, "train_seconds": round(seconds, 1),
        "held_out_acceptance": acc,
        "tokens_per_verify_greedy": {f"k{k}": round(eagle.tokens_per_verify(acc["greedy_by_depth"], k), 3) for k in (3, 5)},
        "tokens_per_verify_sampled": {f"k{k}": round(eagle.tokens_per_verify(acc["sampled_by_depth"], k), 3) for k in (3, 5)},
    }
    (path / "eagle.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"build-eagle: held-out acceptance by draft depth, greedy drafts "
          f"{' '.join(f'{a:.2f}' for a in acc['greedy_by_depth'])}; sampled "
          f"{' '.join(f'{a:.2f}' for a in acc['sampled_by_depth'])}", flush=True)
    print("build-eagle: held-out acceptance at depth 1 by response position (head / the policy's own ceiling): "
          + ", ".join(f"{r} {a['head']:.2f}/{a['policy_ceiling']:.2f}" for r, a in acc["greedy_by_position"].items()
                      if a["tokens"]), flush=True)
    print(f"build-eagle: wrote {path} in {time.perf_counter() - t0:.0f} s; tokens per verify step "
          f"(greedy) {summary['tokens_per_verify_greedy']['k3']} at K=3, "
          f"{summary['tokens_per_verify_greedy']['k5']} at K=5", flush=True)
    return summary
