"""A generic search used by the packing policies and the load tests' bounds."""
from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")


def least_feasible(attempt: Callable[[float], T | None], lo: float, hi: float, rounds: int = 30) -> tuple[float, T]:
    """Bisection for the least T in (lo, hi] where `attempt(T)` is not None
    (it must not be None at `hi`, and once feasible stays so as T grows):
    returns (T, attempt(T)) after `rounds` halvings."""
    best = attempt(hi)
    for _ in range(rounds):
        mid = (lo + hi) / 2
        got = attempt(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    return hi, best
