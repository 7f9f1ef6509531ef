"""Does the online drafter keep up with a training policy? The acceptance
length of a frozen drafter and of online-trained ones over successive policy
versions, side by side on real vLLM CPU engines.

    python -m research.drafter_adaptation --drift rft --report reports/drafter-adaptation   # ~25 min
    python -m research.drafter_adaptation --quick --report reports/drafter-adaptation-quick

One engine per drafter (`--drafters`, default all three) serves the bundled
tiny reasoner and speculates at every batch size (K=3 unless `--k`, greedy
drafts unless `--draft-sampling probabilistic`):

- `frozen`: the bundled drafter, never updated;
- `samples`: trained online (`DrafterTrainer`, its own process) on the
  samples of the newest two policy versions, through its core's sample tap;
- `policy`: distilled online from each pushed policy (`teacher = "policy"`):
  the push reaches its trainer through the core's weight tap, and the round
  fits the drafter to the new version's next-token distributions on the
  newest samples' prefixes, before that version samples anything.

An entry `TEACHER@DIR` starts that drafter from the model in DIR instead of
`--draft`, e.g. a deeper one (`rollout-service build-model --preset drafter
--out DIR`) beside the bundled one: `--drafters frozen,policy,policy@DIR`.
Where DIR holds an EAGLE head (`rollout-service build-eagle --out DIR`) its
engine speculates with `method = "eagle"`: `frozen@DIR` keeps the head as
built, `policy@DIR` distils it from each pushed policy (an EAGLE head reads
the policy's hidden states, so it has no `samples` variant).

Each policy version:

1. one rollout step on each engine: the same GRPO groups of tiny-reasoner
   problems, temperature 1.0;
2. each engine's acceptance over the step is recorded (mean acceptance
   length: tokens per verify step of one request, bonus token included),
   and, on the step's samples, the policy's entropy and the acceptance
   ceiling of greedy drafts (the mean probability of its top token);
3. the policy trains: a few optimizer steps of the target, pushed to every
   core with `RolloutCore.update_weights`. `--drift shifted` (default):
   on shifted data, the step's reference solutions with ";" between lines,
   a style the policy adopts over the versions (a stand-in for what RL
   changes: systematic, and unknown to the bundled drafter); `--drift rft`:
   on its own correct samples (rejection-sampling fine-tuning);
4. each online drafter trains one round (same steps and learning rate) and
   is pushed to its own engine, before the next rollout step.

Sampling is exact on every engine, so they serve the same policy; only the
drafters differ. Writes DIR/drafter_adaptation.json and .png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from research.report import save_json

# frozen, then the online drafters by what they learn from (`[engine.spec.trainer] teacher`).
DRAFTERS = ("frozen", "samples", "policy")
STYLE = {"frozen": "s--", "samples": "o-", "policy": "^-"}
LABEL = {"frozen": "frozen (bundled) drafter", "samples": "online, trained on samples",
         "policy": "online, distilled from the pushed policy"}


def _staged(state: dict):
    import torch

    from rollout_service.engines.weights import StagedWeights, WeightTensor

    tensors = [WeightTensor(k, "float32", tuple(v.shape), memoryview(v.detach().contiguous().view(-1).view(torch.uint8).numpy()))
               for k, v in state.items()]
    return StagedWeights(tensors)


def _policy_sharpness(model, samples, limit: int = 64) -> dict:
    """On (up to `limit` of) a step's samples, under the policy that sampled
    them: its mean next-token entropy (nats) and the mean probability of its
    most likely token, which is the per-token acceptance a perfect drafter
    reaches with greedy drafts (sampled drafts from a perfect drafter are
    always accepted)."""
    import torch

    from rollout_service.drafter.training import collate

    entropy, top, count = 0.0, 0.0, 0
    pairs = [(s.prompt_token_ids, s.response_token_ids) for s in samples[:limit]]
    with torch.no_grad():
        for i in range(0, len(pairs), 16):
            input_ids, labels, mask = collate(pairs[i:i + 16], 1024, 0)
            logp = torch.log_softmax(model(input_ids=input_ids, attention_mask=mask).logits[:, :-1], -1)
            valid = labels[:, 1:] != -100
            entropy += float(-(logp.exp() * logp).sum(-1)[valid].sum())
            top += float(logp.max(-1).values.exp()[valid].sum())
            count += int(valid.sum())
    return {"policy_entropy": entropy / count, "greedy_draft_ceiling": top / count}


def _policy_state(model) -> dict:
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


def _fine_tune(model, optimizer, examples, steps: int, batch_size: int, rng) -> float:
    """Optimizer steps of the policy on (prompt, response) pairs (loss on
    response tokens); returns the mean loss."""
    from rollout_service.drafter.training import collate

    model.train()
    losses = []
    for _ in range(steps):
        batch = [examples[i] for i in rng.choice(len(examples), size=min(batch_size, len(examples)), replace=False)]
        input_ids, labels, mask = collate(batch, 1024, 0)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    model.eval()
    return float(np.mean(losses))


async def _rollout(core, specs, tag: str) -> list:
    core.submit(specs)
    want = sum(s.num_samples for s in specs)
    samples = []
    async for entry in core.delivery.stream(tag):
        core.delivery.ack(tag, entry.cursor)
        if entry.sample.group_id.startswith(tag):
            samples.append(entry.sample)
            if len(samples) == want:
                return samples
    return samples


def _spec_delta(monitor, before) -> dict:
    steps = monitor.spec_steps - before[2]
    drafted = monitor.draft_tokens - before[1]
    accepted = monitor.accepted_tokens - before[0]
    return {
        "mean_acceptance_length": 1 + accepted / steps if steps else 1.0,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_by_position": [(a - a0) / (d - d0) if d > d0 else 0.0 for a, a0, d, d0 in
                                   zip(monitor.accepted_per_pos, before[3], monitor.drafted_per_pos, before[4])],
        "draft_tokens": drafted,
    }


def _snapshot(monitor) -> tuple:
    return (monitor.accepted_tokens, monitor.draft_tokens, monitor.spec_steps,
            list(monitor.accepted_per_pos), list(monitor.drafted_per_pos))


async def run(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_service.assets import tiny_draft_path, tiny_model_path
    from rollout_service.core.clock import Clock
    from rollout_service.core.rollout import RolloutCore
    from rollout_service.engines.types import SamplingParams
    from rollout_service.lifecycle.types import GroupSpec
    from rollout_service.drafter import DrafterTrainer, TrainerConfig, eagle
    from rollout_service.engines.vllm import VllmEngine
    from rollout_service.scheduling import make_placement
    from rollout_service.tasks import EOS_ID, decode, encode, generate_problems, prompt_token_ids, verify

    target = args.model or str(tiny_model_path())
    draft = args.draft or str(tiny_draft_path())
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    rng = np.random.default_rng(args.seed)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": args.k, "schedule": [[1, 64, args.k]],
            "draft_sample_method": args.draft_sampling}
    # One core (and one engine) per drafter, fed the same prompts: the engines
    # serve the same policy and sample exactly from it, only the drafters differ.
    cpus = max(1, len(os.sched_getaffinity(0)))
    cores = {}
    for i, name in enumerate(args.drafters):
        method = "eagle" if eagle.is_head_dir(_initial(name, draft)) else "draft_model"
        engine = VllmEngine(name, target, max_seqs=64, max_model_len=1024, cpu_bind=str(i % cpus), seed=i,
                            spec=dict(spec, method=method, model=_initial(name, draft)))
        cores[name] = RolloutCore([engine], make_placement("least-assigned"), Clock())
    await asyncio.gather(*(core.start() for core in cores.values()))
    trainers = {}
    for name in args.drafters:
        if _teacher(name) == "frozen":
            continue
        core = cores[name]
        trainers[name] = DrafterTrainer(core.engines.values(), TrainerConfig(
            steps_per_round=args.draft_steps, lr=args.draft_lr, versions_kept=args.draft_versions, seed=args.seed,
            min_new_samples=10**9, teacher=_teacher(name)), _initial(name, draft), lambda core=core: core.policy_version,
            policy_model_dir=target if _teacher(name) == "policy" else None)
        core.sample_taps.append(trainers[name].observe)
        await core.add_weight_tap(trainers[name].policy_updated)
    policy = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.policy_lr, weight_decay=0.0)
    versions = []
    problems = generate_problems(args.versions * args.groups, seed=args.seed + 1)
    first = next(iter(cores.values()))
    try:
        for v in range(args.versions):
            step = problems[v * args.groups:(v + 1) * args.groups]
            before = {name: _snapshot(next(iter(c.engines.values())).speculation.monitor) for name, c in cores.items()}
            t0 = time.perf_counter()
            results = await asyncio.gather(*(
                _rollout(core, [GroupSpec(f"{name}-v{v}-g{i}", prompt_token_ids(p), args.samples,
                                          SamplingParams(max_tokens=args.max_tokens, temperature=1.0))
                                for i, p in enumerate(step)], f"{name}-v{v}-")
                for name, core in cores.items()))
            rollout_s = time.perf_counter() - t0
            record = {"policy_version": first.policy_version, "rollout_s": rollout_s,
                      "drafter_versions": {name: t.draft_version for name, t in trainers.items()}}
            for name, core in cores.items():
                record[name] = _spec_delta(next(iter(core.engines.values())).speculation.monitor, before[name])
            samples = [s for batch in results for s in batch]
            record["tokens"] = sum(len(s.response_token_ids) for s in samples)
            rewards = [verify(step[int(s.group_id.rsplit("-g", 1)[1])], decode(s.response_token_ids)) for s in samples]
            record["reward_mean"] = float(np.mean(rewards))
            record.update(await asyncio.to_thread(_policy_sharpness, policy, samples))
            print(f"policy v{record['policy_version']}: acceptance length "
                  + ", ".join(f"{name} {record[name]['mean_acceptance_length']:.2f}" for name in cores)
                  + f"; policy entropy {record['policy_entropy']:.3f} nats, greedy-draft ceiling "
                  f"{record['greedy_draft_ceiling']:.3f}/token; reward {record['reward_mean']:.2f}; "
                  f"{record['tokens']} tokens in {rollout_s:.1f} s", flush=True)
            versions.append(record)
            if v == args.versions - 1:
                break  # nothing would measure a further policy or drafter
            if args.drift == "shifted":
                # The policy trains on the step's reference solutions written
                # with ";" between lines: a style it adopts version by version.
                examples = [(prompt_token_ids(p), encode(p.solution.replace("\n", ";")) + [EOS_ID]) for p in step]
            else:
                # The policy trains on its own correct samples (all of them if too few are correct).
                good = [(s.prompt_token_ids, s.response_token_ids) for s, r in zip(samples, rewards) if r > 0]
                examples = good if len(good) >= 8 else [(s.prompt_token_ids, s.response_token_ids) for s in samples]
            record["policy_loss"] = await asyncio.to_thread(_fine_tune, policy, optimizer, examples, args.policy_steps,
                                                            args.policy_batch, rng)
            record["policy_examples"] = len(examples)
            state = _policy_state(policy)
            # The push reaches the policy-taught trainers through the cores' weight taps.
            await asyncio.gather(*(core.update_weights(core.policy_version + 1, _staged(state)) for core in cores.values()))
            # Each online drafter trains one round before the new version samples:
            # "samples" on the newest versions' samples (the new version has none
            # yet), "policy" on the new version's distributions over their prefixes.
            rounds = await asyncio.gather(*(t.train_once() for t in trainers.values()))
            record["drafter_rounds"] = {
                name: {k: r[k] for k in ("loss_first", "loss_last", "seconds", "examples", "acceptance_before",
                                         "acceptance_after", "teacher_version") if k in r}
                for name, r in zip(trainers, rounds) if r is not None}
    finally:
        await asyncio.gather(*(t.stop() for t in trainers.values()))
        await asyncio.gather(*(core.stop() for core in cores.values()))
    return {
        "target": target, "draft": draft, "versions": versions,
        "config": {k: getattr(args, k) for k in ("drafters", "draft_sampling", "drift", "versions", "groups", "samples",
                                                 "max_tokens", "draft_steps", "k",
                                                 "draft_lr", "draft_versions",
                                                 "policy_steps", "policy_batch", "policy_lr", "seed")},
    }


def _teacher(name: str) -> str:
    """The drafter kind of a `--drafters` entry (TEACHER or TEACHER@DIR)."""
    return name.split("@", 1)[0]


def _initial(name: str, default: str) -> str:
    """The drafter an entry starts from: its @DIR, else `--draft`'s."""
    return name.split("@", 1)[1] if "@" in name else default


def _label(name: str) -> str:
    if "@" not in name:
        return LABEL[name]
    from rollout_service.drafter.eagle import is_head_dir

    path = Path(_initial(name, ""))
    if is_head_dir(path):
        return (f"frozen EAGLE head ({path.name})" if _teacher(name) == "frozen"
                else f"EAGLE head, distilled from the pushed policy ({path.name})")
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    return f"{LABEL[_teacher(name)]}, {layers}-layer drafter ({path.name})"


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vs = [r["policy_version"] for r in out["versions"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in out["config"]["drafters"]:
        style = STYLE[_teacher(name)][0] + ":" if "@" in name else STYLE[name]  # a drafter of its own: dotted
        ax.plot(vs, [r[name]["mean_acceptance_length"] for r in out["versions"]], style, label=_label(name))
    ax.set_xlabel("policy version")
    ax.set_ylabel("mean acceptance length (tokens / verify step)")
    ax.set_xticks(vs)
    ax.set_title(f"drafters as the policy drifts (K={out['config'].get('k', 3)}, {out['config']['draft_sampling']} drafts, "
                 f"drift: {out['config']['drift']})")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="target (policy) model directory (default: the bundled tiny reasoner)")
    p.add_argument("--draft", default="", help="initial drafter (default: the bundled drafter)")
    p.add_argument("--drafters", default=",".join(DRAFTERS),
                   help="drafters side by side, one engine each: frozen (the bundled drafter), samples (trained "
                        "online on the newest versions' samples), policy (distilled from each pushed policy on "
                        "those samples' prefixes, before it samples); TEACHER@DIR starts that one from the "
                        "drafter in DIR")
    p.add_argument("--draft-sampling", choices=["greedy", "probabilistic"], default="greedy",
                   help="draft tokens: the drafter's most likely ones, or sampled from it (engine.spec.draft_sample_method)")
    p.add_argument("--k", type=int, default=3,
                   help="draft tokens per verify step (the tail schedule uses 5 at one running sequence)")
    p.add_argument("--versions", type=int, default=8, help="policy versions to run")
    p.add_argument("--groups", type=int, default=48, help="GRPO groups per rollout step")
    p.add_argument("--samples", type=int, default=4, help="samples per group")
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument("--draft-steps", type=int, default=100, help="drafter optimizer steps per round")
    p.add_argument("--draft-lr", type=float, default=1e-3, help="drafter learning rate (engine.spec.trainer.lr)")
    p.add_argument("--draft-versions", type=int, default=2,
                   help="the drafter trains on the samples of the newest N policy versions (engine.spec.trainer.versions_kept)")
    p.add_argument("--drift", choices=["shifted", "rft"], default="shifted",
                   help="how the policy trains: on shifted data (reference solutions with ';' between lines) "
                        "or on its own correct samples (rejection-sampling fine-tuning)")
    p.add_argument("--policy-steps", type=int, default=12, help="policy optimizer steps per version")
    p.add_argument("--policy-batch", type=int, default=8)
    p.add_argument("--policy-lr", type=float, default=2e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="4 versions of 8 groups")
    p.add_argument("--report", help="output directory")
    args = p.parse_args(argv)
    args.drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    unknown = [d for d in args.drafters if _teacher(d) not in DRAFTERS]
    if unknown or not args.drafters:
        p.error(f"--drafters: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(DRAFTERS)}, "
                "each optionally @DIR")
    missing = [d for d in args.drafters if "@" in d and not (Path(_initial(d, "")) / "config.json").is_file()]
    if missing:
        p.error(f"--drafters: no drafter (config.json) in {', '.join(_initial(d, '') for d in missing)}")
    from rollout_service.drafter.eagle import is_head_dir

    taught_by_samples = [d for d in args.drafters if _teacher(d) == "samples" and is_head_dir(_initial(d, args.draft))]
    if taught_by_samples:
        p.error(f"--drafters: {', '.join(taught_by_samples)}: an EAGLE head trains from the policy; "
                "use policy@DIR (or frozen@DIR)")
    if args.k < 1:
        p.error(f"--k: {args.k}; draft at least 1 token per verify step")
    if len(set(args.drafters)) < len(args.drafters):
        p.error("--drafters: an entry is given twice")
    if args.quick:
        args.versions, args.groups, args.max_tokens = min(args.versions, 3), min(args.groups, 16), min(args.max_tokens, 200)
    out = asyncio.run(run(args))
    out["command"] = " ".join(["python -m research.drafter_adaptation", *(sys.argv[1:] if argv is None else argv)])
    later = out["versions"][1:]
    if later:
        out["summary"] = {
            f"{name}_mean_acceptance_length": float(np.mean([r[name]["mean_acceptance_length"] for r in later]))
            for name in args.drafters}
        out["summary"].update({f"{name}_last_acceptance_length": later[-1][name]["mean_acceptance_length"]
                               for name in args.drafters})
        print(json.dumps(out["summary"], indent=2))
    save_json(args.report, "drafter_adaptation.json", out, plot)
    return 0


if __name__ == "__main__":
    from research.interrupt import stop_on_sigterm

    stop_on_sigterm()
    raise SystemExit(main())
