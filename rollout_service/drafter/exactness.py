"""Is speculative sampling lossless? A two-sample test on sampled sequences.

Speculative decoding with exact rejection sampling draws every token from
the target's sampling distribution (after temperature, top-k, top-p), so
short completions of one prompt must have the same joint distribution with
speculation on as off. `homogeneity_test` compares two samples of such
completions: a chi-square test of homogeneity on the 2 x C table of
completion counts, cells rarer than `min_expected` (expected count in
either sample) pooled into one, so the chi-square approximation holds.

`detectable_shift` states the power: the smallest probability mass moved
between two cells of a given mass that the test detects with the given
power at level `alpha`.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Hashable, Iterable


@dataclass(slots=True)
class HomogeneityResult:
    statistic: float
    dof: int
    p_value: float
    n_a: int
    n_b: int
    cells: int  # after pooling

    def __str__(self) -> str:
        return f"chi2={self.statistic:.1f} dof={self.dof} p={self.p_value:.3g} (n={self.n_a}+{self.n_b}, {self.cells} cells)"


def homogeneity_test(a: Iterable[Hashable], b: Iterable[Hashable], min_expected: float = 5.0) -> HomogeneityResult:
    """Pearson chi-square test that samples `a` and `b` (e.g. tuples of
    token ids) come from one distribution."""
    import numpy as np
    from scipy import stats

    ca, cb = Counter(a), Counter(b)
    na, nb = sum(ca.values()), sum(cb.values())
    if not na or not nb:
        raise ValueError("both samples must be non-empty")
    cells = sorted(set(ca) | set(cb), key=lambda c: -(ca[c] + cb[c]))
    frac_a = na / (na + nb)
    kept, pooled = [], [0, 0]
    for c in cells:
        total = ca[c] + cb[c]
        if total * min(frac_a, 1 - frac_a) >= min_expected:
            kept.append([ca[c], cb[c]])
        else:
            pooled[0] += ca[c]
            pooled[1] += cb[c]
    if sum(pooled) * min(frac_a, 1 - frac_a) >= min_expected:
        kept.append(pooled)
    elif kept and sum(pooled):
        kept[-1][0] += pooled[0]  # too small on its own: merge into the rarest kept cell
        kept[-1][1] += pooled[1]
    if len(kept) < 2:
        return HomogeneityResult(0.0, 0, 1.0, na, nb, len(kept))
    table = np.array(kept, dtype=float).T
    stat, p, dof, _ = stats.chi2_contingency(table, correction=False)
    return HomogeneityResult(float(stat), int(dof), float(p), na, nb, len(kept))


def detectable_shift(n_a: int, n_b: int, dof: int, cell_mass: float = 0.1, alpha: float = 1e-3,
                     power: float = 0.9) -> float:
    """Probability mass moved from one cell of mass `cell_mass` to another
    that the test detects with probability `power` at level `alpha`
    (noncentral chi-square; noncentrality n_a n_b / (n_a + n_b) * sum (p - q)^2 / p)."""
    from scipy import optimize, stats

    critical = stats.chi2.ppf(1 - alpha, dof)
    need = optimize.brentq(lambda lam: stats.ncx2.sf(critical, dof, lam) - power, 1e-6, 1e6)
    n_eff = n_a * n_b / (n_a + n_b)
    # Moving eps between two cells of mass m: sum (p - q)^2 / p = 2 eps^2 / m.
    return (need * cell_mass / (2 * n_eff)) ** 0.5
