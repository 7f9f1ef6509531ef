"""Synthetic, verifiable reasoning tasks with long-tailed response lengths.

>>> from rollout_service.tasks import generate_problems, verify
>>> p = generate_problems(1, seed=0)[0]
>>> verify(p, p.solution)
1.0

See :mod:`rollout_service.tasks.generator` for the families and the
difficulty presets, :mod:`~rollout_service.tasks.verifier` for scoring and
:mod:`~rollout_service.tasks.tokenizer` for the character-level tokenizer
the bundled models use.
"""

from .generator import (
    FAMILIES,
    PRESETS,
    Difficulty,
    Problem,
    collatz_trajectory,
    generate_problems,
    iter_problems,
    make_problem,
    reference_solution,
    resolve_difficulty,
)
from .tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    VOCAB_SIZE,
    decode,
    encode,
    prompt_token_ids,
    response_token_ids,
)
from .verifier import REASONS, Verdict, check, verify

__all__ = [
    "BOS_ID",
    "Difficulty",
    "EOS_ID",
    "FAMILIES",
    "PAD_ID",
    "PRESETS",
    "Problem",
    "REASONS",
    "VOCAB_SIZE",
    "Verdict",
    "check",
    "collatz_trajectory",
    "decode",
    "encode",
    "generate_problems",
    "iter_problems",
    "make_problem",
    "prompt_token_ids",
    "reference_solution",
    "resolve_difficulty",
    "response_token_ids",
    "verify",
]
