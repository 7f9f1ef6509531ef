"""The tiny-reasoner task: real prompts the bundled model was trained on.

Each group is one problem of `rollout_service.tasks` (addition, sorting,
Collatz, with long-tailed solution lengths). On a real engine the model
writes the responses and `verify` scores them; on a simulated engine every
sample is as long as the reference solution (prompt and response token ids
come from the task's tokenizer either way).
"""
from __future__ import annotations

from rollout_service.bench.workloads import GroupShape, Workload


def generate(steps: int, groups_per_step: int, seed: int = 0, samples_per_group: int = 8,
             difficulty: str = "default") -> Workload:
    from rollout_service.tasks import VOCAB_SIZE, generate_problems, prompt_token_ids, response_token_ids

    problems = generate_problems(steps * groups_per_step, seed=seed, difficulty=difficulty)
    groups = []
    for p in problems:
        ids = prompt_token_ids(p)
        length = len(response_token_ids(p))  # the reference solution with its end token
        groups.append(GroupShape(len(ids), [length] * samples_per_group, prompt_token_ids=ids, problem=p))
    longest = max(g.output_lens[0] for g in groups)
    step_groups = [groups[s * groups_per_step:(s + 1) * groups_per_step] for s in range(steps)]
    # Room for a model that rambles past the reference solution.
    budget = max(64, 2 * longest)
    return Workload("tiny-reasoner", step_groups, max_tokens=budget,
                    source=f"rollout_service.tasks problems (difficulty {difficulty}, seed {seed})",
                    params={"difficulty": difficulty, "seed": seed}, vocab_size=VOCAB_SIZE)


def score(problem, response_token_ids: list[int]) -> float:
    """The task's reward of a response (1.0 correct and complete, else 0.0)."""
    from rollout_service.tasks import decode, verify

    return verify(problem, decode(response_token_ids))
