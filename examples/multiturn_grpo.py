"""Multi-turn GRPO on the bundled tiny reasoner: each sample is a trajectory
of turns with a tool call between them.

    python examples/multiturn_grpo.py                       # embedded service, 2 vLLM CPU engines
    python examples/multiturn_grpo.py --drive trainer       # the trainer answers each turn instead
    python examples/multiturn_grpo.py --address host:50051  # a running service (see below)

The policy writes one reasoning step per turn (a turn ends at its newline).
Between turns a tool checks the step against the task's reference solution:
a right step gets an empty observation (the trajectory goes on untouched),
a wrong one gets the right step as the observation, so the next turn starts
from a correct state. The observation tokens are in the response but carry
loss mask 0 and no policy version, so the policy gradient only sees what
the policy sampled. The reward is the fraction of the reference's steps the
policy got right by itself.

`--drive env` (the default) has the service call the tool: `step_tool`
below is an `[environments.steps]` entry point, awaited by the service
between turns, so tool time overlaps other trajectories' generation; on a
service of your own, configure

    [environments.steps]
    entry_point = "multiturn_grpo:step_tool"   # this file on the service's PYTHONPATH

`--drive trainer` answers each turn event from the trainer through
`RolloutClient.trajectory_groups(respond=...)` (the same check, run here).
Either way the trainer receives complete groups of trajectories with their
turns, loss masks and per-token versions, takes one clipped policy-gradient
step and pushes the new weights. A few minutes on a CPU with the defaults.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

import torch

from rollout_service.lifecycle.types import EnvReply, EnvRequest
from rollout_service.tasks import decode, encode, iter_problems, prompt_token_ids
from trainer_client import CompletedSample, MultiTurn, PromptGroup, RolloutClient

NEWLINE = encode("\n")[0]
ENVIRONMENT = "steps"


def check(reference: str, turn: int, wrote: str) -> tuple[bool, str]:
    """(was turn `turn`'s step right, the observation to append)."""
    steps = reference.splitlines()
    if turn >= len(steps):
        return False, ""
    right = wrote.strip() == steps[turn]
    return right, "" if right else steps[turn] + "\n"


async def step_tool(req: EnvRequest) -> EnvReply:
    """The environment: check the step the policy just wrote, answer with
    the right one when it was wrong; done after the last step."""
    reference = req.metadata["reference"]
    if req.turn + 1 >= len(reference.splitlines()):
        return EnvReply(done=True)
    _, observation = check(reference, req.turn, decode(req.turn_token_ids))
    return EnvReply(observation_token_ids=encode(observation))


def respond(sample: CompletedSample) -> list[int] | None:
    """The same tool, run by the trainer on a turn event (--drive trainer)."""
    reference = sample.metadata["reference"]
    turn = sample.turn_index
    if turn + 1 >= len(reference.splitlines()):
        return None
    last = sample.turns[-1]
    _, observation = check(reference, turn, decode(sample.response_token_ids[last.start:last.start + last.length]))
    return encode(observation)


def reward(sample: CompletedSample) -> float:
    """Share of the reference's steps the policy wrote right itself."""
    reference = sample.metadata["reference"]
    generated = [t for t in sample.turns if t.kind == "generated"]
    right = sum(check(reference, i, decode(sample.response_token_ids[t.start:t.start + t.length]))[0]
                for i, t in enumerate(generated))
    return right / len(reference.splitlines())


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", help="a running service (default: start one in this process)")
    p.add_argument("--token", default=os.environ.get("ROLLOUT_TOKEN") or None, help="bearer token")
    p.add_argument("--drive", choices=("env", "trainer"), default="env",
                   help="who answers each turn: the service's environment hook, or this trainer")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--engine-kind", choices=("vllm", "sim"), default="vllm",
                   help="sim: simulated engines (random tokens), to try the mechanics in seconds")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--groups-per-step", type=int, default=8)
    p.add_argument("--samples", type=int, default=4, help="GRPO group size")
    p.add_argument("--max-turns", type=int, default=12)
    p.add_argument("--turn-tokens", type=int, default=48, help="budget of one turn")
    p.add_argument("--families", default="add,sort")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--max-lag", type=int, default=1, help="mask tokens older than this many versions")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def grpo_loss(model, groups: list[list[CompletedSample]], version: int, args):
    """Clipped policy-gradient loss, group-normalised advantages, over the
    tokens the policy sampled (loss mask: observations and stale tokens 0)."""
    total, n = 0.0, 0
    for group in groups:
        rewards = [reward(s) for s in group]
        mean, std = statistics.mean(rewards), statistics.pstdev(rewards)
        if std == 0:
            continue
        for s, r in zip(group, rewards):
            mask = torch.tensor(s.loss_mask(version, args.max_lag), dtype=torch.float32)
            if not s.response_token_ids or mask.sum() == 0:
                continue
            ids = torch.tensor([s.prompt_token_ids + s.response_token_ids])
            logits = model(ids).logits[0, len(s.prompt_token_ids) - 1:-1].float()
            new_lp = torch.log_softmax(logits, -1).gather(1, ids[0, len(s.prompt_token_ids):, None])[:, 0]
            ratio = torch.exp(new_lp - torch.tensor(s.behaviour_logprobs))
            adv = (r - mean) / (std + 1e-6)
            surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - args.clip, 1 + args.clip) * adv)
            total = total - (surrogate * mask).sum() / mask.sum()
            n += 1
    return total / n if n else None


async def collect(client: RolloutClient, group_ids: set[str], drive: str) -> list[list[CompletedSample]]:
    """This step's complete groups of trajectories."""
    out = []
    async for group in client.trajectory_groups(respond=respond if drive == "trainer" else None):
        if group[0].group_id in group_ids:
            out.append(group)
            if len(out) == len(group_ids):
                return out


async def train(args) -> dict:
    from transformers import AutoModelForCausalLM

    from rollout_service.assets import tiny_model_path
    from rollout_service.engines.vllm import checkpoint_manifest

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    model_dir = str(tiny_model_path())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    names = set(checkpoint_manifest(model_dir))

    service = None
    address = args.address
    if address is None:
        from rollout_service.config import EngineConfig, ServiceConfig
        from rollout_service.service import RolloutService

        cfg = ServiceConfig(grpc_port=0, http_port=0, engine=EngineConfig(kind=args.engine_kind, num_engines=args.engines),
                            environments={ENVIRONMENT: {"entry_point": f"{Path(__file__).stem}:step_tool"}})
        print(f"starting the service on {args.engines} {args.engine_kind} engines ...", flush=True)
        service = RolloutService(cfg)
        await service.start()
        address = f"127.0.0.1:{service.grpc_port}"

    families = [f.strip() for f in args.families.split(",") if f.strip()]
    problems = iter_problems(seed=args.seed, families=families)
    history = []
    try:
        async with RolloutClient(address, consumer_id=f"mt-grpo-{args.seed}-{os.getpid()}", token=args.token) as client:
            await client.wait_ready()
            version = (await client.status()).policy_version
            for step in range(args.steps):
                t0 = time.perf_counter()
                batch = []
                for i in range(args.groups_per_step):
                    p = next(problems)
                    steps = p.solution.splitlines()
                    batch.append(PromptGroup(
                        prompt_token_ids=prompt_token_ids(p), num_samples=args.samples, max_tokens=args.turn_tokens,
                        temperature=1.0, stop_token_ids=[NEWLINE], group_id=f"mt-{args.seed}-{step}-{i}-{os.getpid()}",
                        prompt_id=p.id, metadata={"reference": p.solution},
                        multi_turn=MultiTurn(max_turns=min(args.max_turns, len(steps)),
                                             environment=ENVIRONMENT if args.drive == "env" else "")))
                ids = set(await client.submit(batch))
                groups = await collect(client, ids, args.drive)
                t_gen = time.perf_counter() - t0
                model.train()
                loss = grpo_loss(model, groups, version, args)
                if loss is not None:
                    optimizer.zero_grad()
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                version += 1
                await client.push_weights({k: v.detach() for k, v in model.state_dict().items() if k in names},
                                          version=version)
                samples = [s for g in groups for s in g]
                turns = [t for s in samples for t in s.turns if t.kind == "generated"]
                observations = [t for s in samples for t in s.turns if t.kind == "observation"]
                row = {
                    "step": step + 1, "reward": statistics.mean(reward(s) for s in samples),
                    "turns_per_trajectory": len(turns) / len(samples),
                    "trained_tokens": sum(sum(s.loss_mask()) for s in samples),
                    "observation_tokens": sum(t.length for t in observations),
                    "tool_s": statistics.mean(t.tool_seconds for t in observations) if observations else 0.0,
                    "generate_s": t_gen, "step_s": time.perf_counter() - t0,
                }
                history.append(row)
                print(f"step {row['step']:>2}  reward {row['reward']:.3f}  turns/trajectory "
                      f"{row['turns_per_trajectory']:.1f}  trained tokens {row['trained_tokens']}  "
                      f"observation tokens {row['observation_tokens']} (masked)  tool {1000 * row['tool_s']:.1f} ms  "
                      f"step {row['step_s']:.1f}s (generation {t_gen:.1f}s)", flush=True)
            st = await client.status()
            print("service counters: " + ", ".join(f"{k} {st.counters.get(k, 0)}" for k in (
                "turns_completed", "observations_appended", "observation_tokens", "trajectory_moves",
                "environment_errors")), flush=True)
    finally:
        if service is not None:
            await service.stop()
    return {"history": history}


if __name__ == "__main__":
    asyncio.run(train(parse_args()))
