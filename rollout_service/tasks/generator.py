"""Synthetic, verifiable reasoning problems with long-tailed solution lengths.

Three families, each solved by writing every intermediate step on its own
line, so the number of lines a correct response needs grows with the
problem's size:

``add``
    Long addition, one digit of the sum per line from the right, carries
    written out.  Each line restates what is left of the operands after
    their last digits were consumed, the digits of the sum found so far and
    the carry: ``a // 10**k + b // 10**k  partial_sum  c<carry>``.  Every
    line is computed from the line above it (the prompt is line 0).
    ``add 4821+397`` is answered by::

        482+39 8 c0
        48+3 18 c1
        4+0 218 c1
        0+0 5218 c0
        answer 5218

``sort``
    Selection sort, one line per extracted minimum: the sorted prefix, a
    ``|`` and what is left, in its original order.  ``sort 5 3 8 3`` is
    answered by::

        3|5 8 3
        3 3|5 8
        3 3 5|8
        3 3 5 8|
        answer 3 3 5 8

``collatz``
    The Collatz trajectory of the start value down to 1, one value per line
    (halve even values, ``3n+1`` odd ones).  ``collatz 6`` is answered by
    ``3 10 5 16 8 4 2 1`` on eight lines.  The number of steps varies wildly
    with the start: 26 takes 10 steps, 27 takes 111.  The answer is the
    trajectory itself; its length (the step count) is ``Problem.answer``.

Every prompt is ``"<family> <arguments>\\n"`` and the response follows it
directly; the model ends it with its end token.  Problem size is drawn from a
difficulty distribution (see :class:`Difficulty`): a level in ``[0, 1]`` is
mapped to a number of digits, a list length or a number of Collatz steps.
Generation is deterministic for a given seed.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Iterator, Mapping, Sequence, Union

FAMILIES: tuple[str, ...] = ("add", "sort", "collatz")

#: Largest operand length (digits) of an ``add`` problem.
MAX_ADD_DIGITS = 10
#: Longest list of a ``sort`` problem.
MAX_SORT_LEN = 12
#: Collatz start values are drawn from ``2..MAX_COLLATZ_START``.
MAX_COLLATZ_START = 200


@dataclass(frozen=True)
class Problem:
    """One problem instance.

    ``prompt`` is the text the model is conditioned on (it ends with a
    newline); ``solution`` is the unique correct response (without the end
    token); ``answer`` is the final result (the sum, the sorted list, or the
    number of Collatz steps).  ``size`` is the family-specific size (digits,
    list length, Collatz steps) and ``level`` the difficulty level it was
    drawn from.
    """

    id: str
    family: str
    prompt: str
    solution: str
    answer: str
    size: int
    level: float
    args: tuple[int, ...] = field(default=())

    @property
    def num_steps(self) -> int:
        """Number of lines (reasoning steps) of the reference solution."""
        return self.solution.count("\n") + 1


# --------------------------------------------------------------------------
# Reference solutions
# --------------------------------------------------------------------------


def solve_add(a: int, b: int) -> tuple[str, str]:
    """Digit-by-digit addition; returns (solution text, answer)."""
    if a < 0 or b < 0:
        raise ValueError("add operands must be non-negative")
    carry = 0
    partial = ""
    lines = []
    while True:
        s = a % 10 + b % 10 + carry
        a, b, carry = a // 10, b // 10, s // 10
        partial = str(s % 10) + partial
        lines.append(f"{a}+{b} {partial} c{carry}")
        if a == 0 and b == 0 and carry == 0:
            break
    lines.append(f"answer {partial}")
    return "\n".join(lines), partial


def solve_sort(values: Sequence[int]) -> tuple[str, str]:
    """Selection sort written step by step; returns (solution, answer)."""
    if not values:
        raise ValueError("sort needs at least one value")
    done: list[int] = []
    rest = list(values)
    lines = []
    while rest:
        m = min(rest)
        rest.remove(m)
        done.append(m)
        lines.append(" ".join(map(str, done)) + "|" + " ".join(map(str, rest)))
    answer = " ".join(map(str, done))
    lines.append(f"answer {answer}")
    return "\n".join(lines), answer


def collatz_trajectory(n: int) -> list[int]:
    """Values after ``n`` down to and including 1."""
    if n < 2:
        raise ValueError("collatz start must be at least 2")
    out = []
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        out.append(n)
    return out


def solve_collatz(n: int) -> tuple[str, str]:
    traj = collatz_trajectory(n)
    return "\n".join(map(str, traj)), str(len(traj))


def make_problem(family: str, args: Sequence[int], *, id: str | None = None,
                 level: float = 0.0) -> Problem:
    """Build a problem of ``family`` from explicit arguments.

    ``add``: ``(a, b)``; ``sort``: the values (digits 0-9); ``collatz``:
    ``(start,)``.
    """
    args = tuple(int(x) for x in args)
    if family == "add":
        a, b = args
        prompt = f"add {a}+{b}\n"
        solution, answer = solve_add(a, b)
        size = max(len(str(a)), len(str(b)))
    elif family == "sort":
        if any(not 0 <= v <= 9 for v in args):
            raise ValueError("sort values must be digits 0-9")
        prompt = "sort " + " ".join(map(str, args)) + "\n"
        solution, answer = solve_sort(args)
        size = len(args)
    elif family == "collatz":
        (start,) = args
        prompt = f"collatz {start}\n"
        solution, answer = solve_collatz(start)
        size = int(answer)
    else:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    if id is None:
        id = f"{family}:" + "-".join(map(str, args))
    return Problem(id=id, family=family, prompt=prompt, solution=solution,
                   answer=answer, size=size, level=float(level), args=args)


def reference_solution(problem: Problem) -> str:
    """The unique correct response text (without the end token)."""
    return problem.solution


# --------------------------------------------------------------------------
# Difficulty
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Difficulty:
    """A distribution over families and difficulty levels.

    A problem's family is drawn with probability proportional to
    ``weights``; its level is ``lo + (hi - lo) * u ** skew`` with ``u``
    uniform in ``[0, 1)``, so ``skew > 1`` makes large (long) problems rare
    and gives the long-tailed length distribution of RL reasoning traces.
    """

    weights: Mapping[str, float]
    skew: float = 1.0
    lo: float = 0.0
    hi: float = 1.0

    def __post_init__(self) -> None:
        unknown = set(self.weights) - set(FAMILIES)
        if unknown:
            raise ValueError(f"unknown families {sorted(unknown)}")
        if not any(w > 0 for w in self.weights.values()):
            raise ValueError("at least one family weight must be positive")
        if not 0.0 <= self.lo <= self.hi <= 1.0:
            raise ValueError("need 0 <= lo <= hi <= 1")
        if self.skew <= 0:
            raise ValueError("skew must be positive")

    def sample(self, rng: random.Random) -> tuple[str, float]:
        fams = [f for f in FAMILIES if self.weights.get(f, 0) > 0]
        fam = rng.choices(fams, weights=[self.weights[f] for f in fams])[0]
        level = self.lo + (self.hi - self.lo) * rng.random() ** self.skew
        return fam, level


#: Named difficulty distributions.  ``default`` is the one the bundled model's
#: pass rate is quoted for; ``train`` is what it was trained on.
PRESETS: dict[str, Difficulty] = {
    "default": Difficulty({"add": 0.5, "sort": 1.0, "collatz": 1.5}, skew=2.5),
    "train": Difficulty({"add": 1.5, "sort": 1.5, "collatz": 1.0}, skew=1.5),
    "easy": Difficulty({"add": 1.0, "sort": 1.0, "collatz": 1.0}, skew=4.0),
    "hard": Difficulty({"add": 1.0, "sort": 1.0, "collatz": 1.0}, skew=1.0, lo=0.5),
}

DifficultySpec = Union[str, float, Difficulty]


def resolve_difficulty(difficulty: DifficultySpec) -> Difficulty:
    """A preset name, a fixed level in ``[0, 1]`` (all families), or a
    :class:`Difficulty`."""
    if isinstance(difficulty, Difficulty):
        return difficulty
    if isinstance(difficulty, str):
        try:
            return PRESETS[difficulty]
        except KeyError:
            raise ValueError(
                f"unknown difficulty {difficulty!r}; presets: {sorted(PRESETS)}"
            ) from None
    level = float(difficulty)
    if not 0.0 <= level <= 1.0:
        raise ValueError("a fixed difficulty level must be in [0, 1]")
    return Difficulty({f: 1.0 for f in FAMILIES}, lo=level, hi=level)


@lru_cache(maxsize=None)
def _collatz_by_steps() -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """Distinct step counts (sorted) and the start values having each."""
    by: dict[int, list[int]] = {}
    for n in range(2, MAX_COLLATZ_START + 1):
        by.setdefault(len(collatz_trajectory(n)), []).append(n)
    steps = tuple(sorted(by))
    return steps, tuple(tuple(by[s]) for s in steps)


def max_collatz_steps() -> int:
    return _collatz_by_steps()[0][-1]


def _sample_args(family: str, level: float, rng: random.Random) -> tuple[int, ...]:
    if family == "add":
        digits = 1 + round(level * (MAX_ADD_DIGITS - 1))
        other = rng.randint(1, digits)

        def number(d: int) -> int:
            return rng.randint(0, 9) if d == 1 else rng.randint(10 ** (d - 1), 10 ** d - 1)

        a, b = number(digits), number(other)
        return (a, b) if rng.random() < 0.5 else (b, a)
    if family == "sort":
        length = 2 + round(level * (MAX_SORT_LEN - 2))
        return tuple(rng.randint(0, 9) for _ in range(length))
    if family == "collatz":
        steps, starts = _collatz_by_steps()
        target = 1 + level * (steps[-1] - 1)
        # Nearest available step counts around the target (a few of them,
        # so every level still has some variety of start values).
        i = bisect.bisect_left(steps, target)
        cands = [j for j in range(max(0, i - 2), min(len(steps), i + 2))]
        cands.sort(key=lambda j: abs(steps[j] - target))
        j = cands[0] if rng.random() < 0.6 or len(cands) == 1 else rng.choice(cands[:3])
        return (rng.choice(starts[j]),)
    raise ValueError(f"unknown family {family!r}")


def iter_problems(seed: int = 0, difficulty: DifficultySpec = "default",
                  families: Sequence[str] | None = None) -> Iterator[Problem]:
    """An endless, deterministic stream of problems."""
    dist = resolve_difficulty(difficulty)
    if families is not None:
        dist = Difficulty({f: dist.weights.get(f, 0.0) or 1.0 for f in families},
                          skew=dist.skew, lo=dist.lo, hi=dist.hi)
    rng = random.Random(f"rollout-service-tasks:{seed}")
    i = 0
    while True:
        family, level = dist.sample(rng)
        args = _sample_args(family, level, rng)
        yield make_problem(family, args, id=f"{family}-s{seed}-{i}", level=level)
        i += 1


def generate_problems(n: int, seed: int = 0, difficulty: DifficultySpec = "default",
                      families: Sequence[str] | None = None) -> list[Problem]:
    """``n`` problems drawn from ``difficulty`` (a preset name, a fixed level
    in ``[0, 1]``, or a :class:`Difficulty`), deterministic in ``seed``.
    ``families`` restricts the mixture to the given families."""
    if n < 0:
        raise ValueError("n must be non-negative")
    it = iter_problems(seed, difficulty, families)
    return [next(it) for _ in range(n)]
