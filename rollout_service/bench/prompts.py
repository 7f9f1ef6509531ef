"""A user's prompt file as a bench workload.

JSONL, one prompt group per line:

    {"prompt": "Solve 12 + 30.", "output_len": [120, 80, 410, 95]}
    {"prompt": [151644, 872, 198, 3838], "n": 8}

- `prompt` (or `prompt_token_ids`): text, or token ids of the target's model.
- `output_len` (or PolyTrace's `output`): the target response length of each
  sample (tokens), a list (its length is the group's size) or one number for
  every sample; without it the model decides, up to `max_tokens`.
- `n`: samples in the group when `output_len` is not a list (default
  `samples_per_group`).
"""
from __future__ import annotations

import json
from pathlib import Path

from rollout_service.bench.workloads import GroupShape, Workload


def is_prompt_file(path: Path) -> bool:
    """A JSONL file whose first record has a `prompt` (or `prompt_token_ids`)."""
    if not path.is_file():
        return False
    with open(path) as f:
        for line in f:
            if line.strip():
                try:
                    row = json.loads(line)
                except ValueError:
                    return False
                return isinstance(row, dict) and ("prompt" in row or "prompt_token_ids" in row)
    return False


def _group(row: dict, where: str, samples_per_group: int, max_tokens: int) -> tuple[GroupShape, bool]:
    prompt = row.get("prompt", row.get("prompt_token_ids"))
    if isinstance(prompt, str) and prompt:
        shape = GroupShape(0, [], prompt_text=prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt):
        shape = GroupShape(len(prompt), [], prompt_token_ids=list(prompt))
    else:
        raise ValueError(f"{where}: 'prompt' must be non-empty text or a list of token ids")
    lengths = row.get("output_len", row.get("output"))
    n = row.get("n", samples_per_group)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"{where}: 'n' must be a positive integer, got {n!r}")
    if lengths is None:
        shape.output_lens = [max_tokens] * n
        return shape, False
    if isinstance(lengths, int):
        lengths = [lengths] * n
    if not isinstance(lengths, list) or not lengths or not all(isinstance(x, int) and x >= 1 for x in lengths):
        raise ValueError(f"{where}: 'output_len' must be a positive integer or a list of them")
    shape.output_lens = list(lengths)
    return shape, True


def load_prompt_file(path: Path, samples_per_group: int = 8, groups_per_step: int = 64,
                     max_tokens: int = 256) -> Workload:
    """The file's groups in order, `groups_per_step` to a step. Target
    lengths must be given for every line or for none (`params["lengths"]`
    says which: "target" or "free", where `max_tokens` is each sample's cap)."""
    groups, with_lengths = [], set()
    for k, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{path}:{k}: not JSON ({exc})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{k}: each line must be a JSON object")
        shape, has = _group(row, f"{path}:{k}", samples_per_group, max_tokens)
        groups.append(shape)
        with_lengths.add(has)
    if not groups:
        raise ValueError(f"{path}: no prompts")
    if len(with_lengths) > 1:
        raise ValueError(f"{path}: give 'output_len' on every line or on none")
    target = with_lengths.pop()
    steps = [groups[i:i + groups_per_step] for i in range(0, len(groups), groups_per_step)]
    cap = max(L for g in groups for L in g.output_lens)
    return Workload(Path(path).stem, steps, max_tokens=cap, source=f"prompt file {Path(path).name}",
                    params={"lengths": "target" if target else "free"})
