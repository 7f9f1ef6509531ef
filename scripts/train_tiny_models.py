#!/usr/bin/env python
"""Train the bundled tiny reasoning model and its drafter from scratch.

    python scripts/train_tiny_models.py     # writes rollout_service/assets/tiny-reasoner{,-draft}

Both are Qwen2-architecture causal LMs (``Qwen2ForCausalLM``) over the
character-level tokenizer of :mod:`rollout_service.tasks.tokenizer`, trained
with teacher forcing on reference solutions of :mod:`rollout_service.tasks`
problems drawn from the ``train`` difficulty preset (loss on response tokens
only).

The target is trained for a fixed, deliberately small number of steps so
that it stays imperfect: sampled at temperature 1.0 it solves some problems
and fails others with wrong steps.  A small share of its training responses
(``--runaway-frac``) do not stop where they should -- the last step repeats
(for Collatz, the 4-2-1 cycle) and the text is cut off without an end token
-- so the model also fails by runaway length now and then, as RL policies
do.  The drafter is a one-layer model trained the same way for fewer steps.

Everything is seeded (data stream, initialisation, batching) and the number
of steps is fixed, so a rerun reproduces the same models (bit for bit with
the same thread count and torch build).  With the defaults it takes about
25 minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from rollout_service.tasks import generate_problems, iter_problems  # noqa: E402
from rollout_service.tasks.generator import Problem  # noqa: E402
from rollout_service.tasks.tokenizer import (  # noqa: E402
    BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, encode, save_tokenizer,
)

MAX_POSITIONS = 1024
#: How far past the solution a "never ends" training response runs before it
#: is cut (without an end token).
RUNAWAY_EXTRA_CHARS = 128

TARGET_ARCH = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=4)
DRAFT_ARCH = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=4)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_config(arch: dict):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=True,
        use_sliding_window=False,
        sliding_window=None,
        attention_dropout=0.0,
        initializer_range=0.02,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        use_cache=True,
        **arch,
    )


# --------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------


def runaway_text(problem: Problem, extra: int) -> str:
    """A response that does not stop where it should: all solution steps,
    then instead of the end (or the answer line) the last step again and
    again -- for Collatz, the 4-2-1 cycle -- for ``extra`` more characters,
    cut off there without an end token."""
    lines = problem.solution.split("\n")
    if problem.family == "collatz":
        steps, loop = lines, ["4", "2", "1"]
    else:
        steps, loop = lines[:-1], lines[-2:-1]
    head = "\n".join(steps)
    tail = "\n" + "\n".join(loop * (extra // 2 + 1))
    return head + tail[:extra]


def make_example(problem: Problem, rng: random.Random, runaway_frac: float,
                 max_len: int) -> tuple[list[int], int]:
    """(token ids, index of the first response token)."""
    prompt = [BOS_ID] + encode(problem.prompt)
    if runaway_frac > 0 and rng.random() < runaway_frac:
        response = encode(runaway_text(problem, RUNAWAY_EXTRA_CHARS))
    else:
        response = encode(problem.solution) + [EOS_ID]
    ids = (prompt + response)[:max_len]
    return ids, len(prompt)


def batch_stream(seed: int, difficulty: str, batch_tokens: int, runaway_frac: float,
                 pool_size: int = 512):
    """Length-bucketed batches (input ids, attention mask, labels)."""
    rng = random.Random(f"batches:{seed}")
    problems = iter_problems(seed=seed, difficulty=difficulty)
    while True:
        pool = [make_example(next(problems), rng, runaway_frac, MAX_POSITIONS)
                for _ in range(pool_size)]
        pool.sort(key=lambda e: len(e[0]))
        batches, cur = [], []
        for ex in pool:
            if cur and (len(cur) + 1) * len(ex[0]) > batch_tokens:
                batches.append(cur)
                cur = []
            cur.append(ex)
        if cur:
            batches.append(cur)
        rng.shuffle(batches)
        for b in batches:
            width = max(len(ids) for ids, _ in b)
            x = torch.full((len(b), width), PAD_ID, dtype=torch.long)
            m = torch.zeros((len(b), width), dtype=torch.long)
            y = torch.full((len(b), width), -100, dtype=torch.long)
            for i, (ids, start) in enumerate(b):
                t = torch.tensor(ids)
                x[i, :len(ids)] = t
                m[i, :len(ids)] = 1
                y[i, start:len(ids)] = t[start:]
            yield x, m, y


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------


def train(name: str, arch: dict, steps: int, lr: float, seed: int, batch_tokens: int,
          runaway_frac: float, warmup: int = 50):
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(make_config(arch))
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{name}: {n_params:,} parameters, {steps} steps, lr {lr}, "
        f"{batch_tokens} tokens/batch, runaway data {runaway_frac:.3f}")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.98), eps=1e-8)

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    data = batch_stream(seed, "train", batch_tokens, runaway_frac)
    t0 = time.time()
    tokens = 0
    loss_avg = None
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        x, m, y = next(data)
        out = model(input_ids=x, attention_mask=m, labels=y)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += int(m.sum())
        loss = float(out.loss)
        loss_avg = loss if loss_avg is None else 0.95 * loss_avg + 0.05 * loss
        if (step + 1) % 50 == 0 or step == 0 or step + 1 == steps:
            el = time.time() - t0
            log(f"{name} step {step + 1}/{steps} loss {loss_avg:.4f} lr {lr_at(step):.2e} "
                f"{tokens / el:,.0f} tok/s elapsed {el / 60:.1f} min")
    model.eval()
    return model, n_params, time.time() - t0


def save(model, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*"):
        if stale.is_file():
            stale.unlink()
    model.to(torch.float32).save_pretrained(str(directory), safe_serialization=True)
    cfg_path = directory / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["torch_dtype"] = "float32"
    cfg["dtype"] = "float32"
    cfg["architectures"] = ["Qwen2ForCausalLM"]
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen_cfg = {
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "do_sample": True,
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "max_length": MAX_POSITIONS,
    }
    (directory / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    save_tokenizer(directory, model_max_length=MAX_POSITIONS)


def quick_check(model, n: int, seed: int) -> None:
    from rollout_service.tasks.sampling import pass_rate, sample_responses

    problems = generate_problems(n, seed=seed, difficulty="default")
    t0 = time.time()
    samples = sample_responses(model, problems, temperature=1.0, seed=seed, batch_size=64,
                               max_new_tokens=MAX_POSITIONS - 32)
    fails: dict[str, int] = {}
    for s in samples:
        if s.failure:
            fails[s.failure] = fails.get(s.failure, 0) + 1
    lens = sorted(s.num_tokens for s in samples)
    log(f"check: pass rate {pass_rate(samples):.3f} over {n} (temperature 1.0), "
        f"failures {fails}, p50 {lens[len(lens) // 2]} max {lens[-1]} tokens "
        f"({time.time() - t0:.0f}s)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", type=Path, default=REPO / "rollout_service" / "assets")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1 is robust on a shared CPU; 2 is ~1.7x faster on an "
                         "idle 2-core machine but rounds differently)")
    ap.add_argument("--target-steps", type=int, default=6000)
    ap.add_argument("--draft-steps", type=int, default=1500)
    ap.add_argument("--target-lr", type=float, default=3e-3)
    ap.add_argument("--draft-lr", type=float, default=3e-3)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--runaway-frac", type=float, default=0.08,
                    help="fraction of training responses that never end")
    ap.add_argument("--only", choices=("target", "draft", "both"), default="both")
    ap.add_argument("--check-samples", type=int, default=128,
                    help="sample this many default-difficulty problems after training "
                         "the target and print its pass rate (0 to skip)")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t_start = time.time()
    summary: dict[str, object] = {"seed": args.seed}
    if args.only in ("target", "both"):
        model, n, secs = train("target", TARGET_ARCH, args.target_steps, args.target_lr,
                               args.seed, args.batch_tokens, args.runaway_frac)
        save(model, args.out_dir / "tiny-reasoner")
        log(f"target saved to {args.out_dir / 'tiny-reasoner'} ({secs / 60:.1f} min)")
        summary.update(target_params=n, target_train_s=round(secs, 1))
        if args.check_samples:
            quick_check(model, args.check_samples, seed=args.seed + 12345)
    if args.only in ("draft", "both"):
        model, n, secs = train("draft", DRAFT_ARCH, args.draft_steps, args.draft_lr,
                               args.seed + 1, args.batch_tokens, args.runaway_frac)
        save(model, args.out_dir / "tiny-reasoner-draft")
        log(f"draft saved to {args.out_dir / 'tiny-reasoner-draft'} ({secs / 60:.1f} min)")
        summary.update(draft_params=n, draft_train_s=round(secs, 1))
    summary["total_s"] = round(time.time() - t_start, 1)
    log("summary " + json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
