"""A cumulative histogram (Prometheus semantics) with fixed buckets."""
from __future__ import annotations

import bisect

LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, cumulative count) rows, ending with +Inf."""
        out, total = [], 0
        for le, n in zip([*map(str, self.buckets), "+Inf"], self.counts):
            total += n
            out.append((le, total))
        return out
