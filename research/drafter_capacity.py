"""How close can the bundled drafter get to a policy that has drifted, given
all the training it wants? Offline, no engines: the per-token acceptance a
drafter reaches on held-out samples of a drifted policy, against what a
perfect drafter would reach, for several distillation budgets.

    python -m research.drafter_capacity --report reports/drafter-capacity   # ~25 min on 2 CPU cores

1. The bundled reasoner drifts as in `drafter_adaptation --drift shifted`:
   `--versions` x `--policy-steps` optimizer steps on the reference
   solutions of fresh problems written with ";" between lines.
2. The drifted policy samples `--train` and `--held-out` responses at
   temperature 1 (its own prefixes, as the engines would produce them).
3. The ceiling on the held-out prefixes: with greedy drafts a perfect
   drafter is accepted with the policy's top probability; a draft sampled
   from a perfect drafter is always accepted.
4. For each `--grid` point (lr x steps) the bundled drafter is distilled
   from the policy's distributions on the training prefixes (the loss of
   `[engine.spec.trainer] teacher = "policy"`), and once trained on the
   sampled tokens instead (the `teacher = "samples"` loss) at the first
   point. Held-out acceptance per token: greedy drafts, p(argmax q);
   sampled drafts, sum_x min(p, q). With K=3 a per-token acceptance a
   gives about 1 + a + a^2 + a^3 tokens per verify step.
5. With `--eagle`, an EAGLE-style head (`rollout_service.drafter.eagle`:
   it reads the policy's last hidden state) is distilled at each grid point
   the same way, and its acceptance is measured per draft depth (depth d:
   the head has fed its own output d-1 times), so its tokens per verify
   step are 1 + a1 + a1 a2 + ...

Writes DIR/drafter_capacity.json.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import numpy as np

from research.report import save_json

MAX_LEN = 1024


def _acceptance(model, examples, targets) -> dict:
    """Held-out per-token acceptance of greedy and of sampled drafts."""
    import torch

    from rollout_service.drafter.training import collate, expected_acceptance

    model.eval()
    greedy = count = 0.0
    with torch.no_grad():
        for i in range(0, len(examples), 16):
            input_ids, labels, mask = collate(examples[i:i + 16], MAX_LEN, 0)
            logits = model(input_ids=input_ids, attention_mask=mask).logits[:, :-1]
            shifted = labels[:, 1:] != -100
            for j, (p, ids) in enumerate(targets[i:i + 16]):
                draft = logits[j][shifted[j]].argmax(-1, keepdim=True)
                greedy += float((p * (ids.long() == draft)).sum())
                count += p.shape[0]
    sampled = expected_acceptance(model, examples, targets, MAX_LEN, 0)
    return {"greedy": greedy / count, "sampled": sampled}


def _train(base, train, targets, lr: float, steps: int, loss: str, seed: int) -> tuple:
    import torch

    from rollout_service.drafter.training import collate, distill_loss

    model = copy.deepcopy(base).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    for _ in range(steps):
        picks = rng.integers(0, len(train), 16)
        batch = [train[i] for i in picks]
        if loss == "policy":
            value = distill_loss(model, batch, [targets[i] for i in picks], MAX_LEN, 0)
        else:
            input_ids, labels, mask = collate(batch, MAX_LEN, 0)
            value = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return model, time.perf_counter() - t0


def run(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from research.drafter_adaptation import _fine_tune
    from rollout_service.assets import tiny_draft_path, tiny_model_path
    from rollout_service.drafter import eagle
    from rollout_service.drafter.eagle import tokens_per_verify
    from rollout_service.drafter.training import teacher_targets
    from rollout_service.tasks import EOS_ID, encode, generate_problems, prompt_token_ids

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    policy = AutoModelForCausalLM.from_pretrained(str(tiny_model_path()), dtype=torch.float32).eval()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.policy_lr, weight_decay=0.0)
    problems = generate_problems(args.versions * 48, seed=args.seed + 1)
    for v in range(args.versions):
        step = problems[v * 48:(v + 1) * 48]
        examples = [(prompt_token_ids(p), encode(p.solution.replace("\n", ";")) + [EOS_ID]) for p in step]
        _fine_tune(policy, optimizer, examples, args.policy_steps, 8, rng)
        print(f"policy v{v + 1}: drifted", flush=True)
    t0 = time.perf_counter()
    prompts = [prompt_token_ids(p) for p in generate_problems(args.train + args.held_out, seed=args.seed + 2)]
    pairs = eagle.sample_responses(policy, prompts, args.max_tokens, args.seed)
    train, held = pairs[:args.train], pairs[args.train:]
    print(f"sampled {len(pairs)} responses of the drifted policy in {time.perf_counter() - t0:.0f} s", flush=True)
    top_k = 256
    train_targets = teacher_targets(policy, train, MAX_LEN, 0, top_k)
    held_targets = teacher_targets(policy, held, MAX_LEN, 0, top_k)
    ceiling = float(np.mean(np.concatenate([p.max(-1).values.numpy() for p, _ in held_targets])))
    base = AutoModelForCausalLM.from_pretrained(args.draft or str(tiny_draft_path()), dtype=torch.float32)
    rows = [{"drafter": "bundled (frozen)" if not args.draft else "initial (frozen)",
             **_acceptance(base, held, held_targets)}]
    print(f"ceiling per token: greedy drafts {ceiling:.3f}, sampled drafts 1.000; frozen: greedy "
          f"{rows[0]['greedy']:.3f}, sampled {rows[0]['sampled']:.3f}", flush=True)
    plan = [("samples", *args.grid[0])] + [("policy", lr, steps) for lr, steps in args.grid]
    for loss, lr, steps in plan:
        model, seconds = _train(base, train, train_targets, lr, steps, loss, args.seed)
        row = {"drafter": f"{'distilled from the policy' if loss == 'policy' else 'trained on samples'}",
               "loss": loss, "lr": lr, "steps": steps, "seconds": seconds, **_acceptance(model, held, held_targets)}
        rows.append(row)
        print(f"{row['drafter']}, lr {lr:g}, {steps} steps: greedy {row['greedy']:.3f}, sampled {row['sampled']:.3f} "
              f"({seconds:.0f} s)", flush=True)
    if args.eagle:
        policy.requires_grad_(False)
        for lr, steps in args.grid:
            head, seconds, _ = eagle.train_head(policy, train, train_targets, lr, steps, args.eagle_depth, args.seed)
            row = {"drafter": "EAGLE-style head, distilled", "loss": "policy", "lr": lr, "steps": steps,
                   "seconds": seconds, **eagle.acceptance(head, policy, held, held_targets, 5)}
            rows.append(row)
            print(f"{row['drafter']}, lr {lr:g}, {steps} steps: greedy by depth "
                  f"{' '.join(f'{a:.3f}' for a in row['greedy_by_depth'])}, sampled by depth "
                  f"{' '.join(f'{a:.3f}' for a in row['sampled_by_depth'])} ({seconds:.0f} s)", flush=True)
    for row in rows:
        for kind in ("greedy", "sampled"):
            per_depth = row.get(f"{kind}_by_depth", row[kind])
            row[f"length_{kind}"], row[f"length_{kind}_k5"] = tokens_per_verify(per_depth, 3), tokens_per_verify(per_depth, 5)
    return {"ceiling": {"greedy": ceiling, "sampled": 1.0, "length_greedy": tokens_per_verify(ceiling, 3), "length_sampled": 4.0,
                        "length_greedy_k5": tokens_per_verify(ceiling, 5), "length_sampled_k5": 6.0},
            "rows": rows,
            "config": {k: getattr(args, k) for k in ("versions", "policy_steps", "policy_lr", "train", "held_out",
                                                     "max_tokens", "grid", "seed", "draft", "eagle",
                                                     "eagle_depth")}}


def _grid(text: str) -> list[tuple[float, int]]:
    try:
        points = [(float(lr), int(steps)) for lr, steps in (p.split("x") for p in text.split(",") if p.strip())]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--grid: expected LRxSTEPS[,LRxSTEPS...], e.g. 3e-4x300,1e-3x600; got {text!r}")
    if not points or any(lr <= 0 or steps < 1 for lr, steps in points):
        raise argparse.ArgumentTypeError(f"--grid: learning rates and steps must be positive; got {text!r}")
    return points


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--versions", type=int, default=4, help="policy versions of drift")
    p.add_argument("--policy-steps", type=int, default=12, help="policy optimizer steps per version")
    p.add_argument("--policy-lr", type=float, default=1e-3)
    p.add_argument("--train", type=int, default=384, help="training samples of the drifted policy")
    p.add_argument("--held-out", type=int, default=64, help="held-out samples of the drifted policy")
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument("--grid", type=_grid, default=_grid("3e-4x300,1e-3x300,1e-3x600,3e-3x300"),
                   help="drafter learning rates x optimizer steps, e.g. 3e-4x300,1e-3x600 (the first also "
                        "trains on samples)")
    p.add_argument("--draft", default="", help="initial drafter directory (default: the bundled drafter; "
                                                "`rollout-service build-model --source draft` pads it deeper)")
    p.add_argument("--eagle", action="store_true",
                   help="also distill an EAGLE-style head (reads the policy's last hidden state) at each grid point")
    p.add_argument("--eagle-depth", type=int, default=3,
                   help="draft depths the EAGLE head is trained at (it feeds itself depth-1 times)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", help="output directory")
    args = p.parse_args(argv)
    if args.eagle_depth < 1:
        p.error(f"--eagle-depth must be at least 1; got {args.eagle_depth}")
    out = run(args)
    out["command"] = " ".join(["python -m research.drafter_capacity", *(sys.argv[1:] if argv is None else argv)])
    print(json.dumps({r["drafter"] + (f" lr {r['lr']:g} x {r['steps']}" if "lr" in r else ""):
                      [round(r["greedy"], 3), round(r["sampled"], 3)] for r in out["rows"]}, indent=1))
    save_json(args.report, "drafter_capacity.json", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
