"""Binary verifier for the synthetic reasoning tasks.

A response earns 1.0 only when every line is the correct step and the
response ends right after the last one.  Trailing whitespace and a literal
end-token string are tolerated; anything else after the final line, a
missing line, or a wrong line scores 0.0.  :func:`check` also says *why* a
response failed, which load tests and reports use for failure breakdowns.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .generator import Problem

END_TOKEN_TEXT = "<eos>"

# Well-formed (if not necessarily correct) step lines, per family.
_STEP_RE = {
    "add": re.compile(r"\d+\+\d+ \d+ c[01]"),
    "sort": re.compile(r"(\d( \d)*)?\|(\d( \d)*)?"),
    "collatz": re.compile(r"[1-9]\d*"),
}
_ANSWER_RE = re.compile(r"answer [\d ]+")

#: Reasons :func:`check` can return.
REASONS = ("correct", "empty", "wrong_step", "wrong_answer", "bad_format",
           "truncated", "extra_text")


@dataclass(frozen=True)
class Verdict:
    reward: float
    reason: str
    #: 0-based index of the first line that is wrong (None when correct).
    line: int | None = None

    @property
    def correct(self) -> bool:
        return self.reward == 1.0


def _normalise(response: str) -> str:
    text = response.rstrip()
    if text.endswith(END_TOKEN_TEXT):
        text = text[: -len(END_TOKEN_TEXT)].rstrip()
    return text


def check(problem: Problem, response: str) -> Verdict:
    """Score ``response`` against ``problem`` with a reason for the score."""
    text = _normalise(response)
    if not text:
        return Verdict(0.0, "empty", 0)
    ref = problem.solution.split("\n")
    got = text.split("\n")
    for i, (g, r) in enumerate(zip(got, ref)):
        if g == r:
            continue
        is_last_got = i == len(got) - 1
        if is_last_got and r.startswith(g):
            # The response stops in the middle of a correct line.
            return Verdict(0.0, "truncated", i)
        if g.startswith(r) and i == len(ref) - 1:
            return Verdict(0.0, "extra_text", i)
        is_answer = r.startswith("answer ")
        pattern = _ANSWER_RE if is_answer else _STEP_RE[problem.family]
        if not pattern.fullmatch(g):
            return Verdict(0.0, "bad_format", i)
        return Verdict(0.0, "wrong_answer" if is_answer else "wrong_step", i)
    if len(got) < len(ref):
        return Verdict(0.0, "truncated", len(got))
    if len(got) > len(ref):
        return Verdict(0.0, "extra_text", len(ref))
    return Verdict(1.0, "correct", None)


def verify(problem: Problem, response: str) -> float:
    """1.0 if ``response`` is a complete, correct solution, else 0.0."""
    return check(problem, response).reward
