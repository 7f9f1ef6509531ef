"""Online prediction of response lengths (tokens), as a distribution.

Signals, strongest first:
  1. finished siblings of the same GRPO group (the first to finish doubles as
     the group's early probe: Seer), scaled by how much longer the other
     samples of recently completed groups were than their group's first
     finished one (siblings' lengths are correlated: a group whose first
     sample ends early is a short group);
  2. the same prompt's lengths in earlier steps (same `prompt_id`);
  3. what finished recently for prompts of a similar length (global).
The prediction for an in-flight request is conditioned on what it has
already generated: the remaining length is drawn from the candidate lengths
that exceed it (and, when none does, the heavy-tail rule that a response
that has run g tokens has about g more to go).
"""
from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from dataclasses import dataclass

from rollout_service.lifecycle.types import Request


@dataclass(slots=True, frozen=True)
class LengthEstimate:
    """Remaining tokens: median and a high quantile (p90)."""

    median: float
    high: float


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class LengthPredictor:
    def __init__(self, default_length: float = 256.0, history_per_prompt: int = 64, global_window: int = 256,
                 remembered_prompts: int = 100_000) -> None:
        self.default_length = default_length
        self._per_prompt: OrderedDict[str, deque[int]] = OrderedDict()
        self._history = history_per_prompt
        self._remembered = remembered_prompts
        self._siblings: dict[str, list[int]] = {}
        # Recent lengths by prompt-length bucket (powers of two), kept small:
        # predictions run on every placement and rebalancing tick.
        self._window = global_window
        self._by_bucket: dict[int, deque[int]] = {}
        # Completed groups: each later sample's length over the group's first finished one.
        self._ratios: deque[float] = deque(maxlen=global_window)
        # Per group: (finished siblings, observations, sorted candidate lengths).
        self._fresh: dict[str, tuple[int, int, list[float]]] = {}
        self._observed = 0
        self.refresh_every = 16

    # -- learning -------------------------------------------------------------

    def observe(self, req: Request, length: int, group_done: bool) -> None:
        """A sample finished with `length` response tokens."""
        spec = req.group.spec
        self._observed += 1
        bucket = max(1, len(spec.prompt_token_ids)).bit_length()
        self._by_bucket.setdefault(bucket, deque(maxlen=self._window)).append(length)
        if spec.prompt_id:
            hist = self._per_prompt.setdefault(spec.prompt_id, deque(maxlen=self._history))
            hist.append(length)
            self._per_prompt.move_to_end(spec.prompt_id)
            while len(self._per_prompt) > self._remembered:
                self._per_prompt.popitem(last=False)
        if group_done:
            done = self._siblings.pop(spec.group_id, None)
            if done:
                first = max(1, done[0])
                self._ratios.extend(n / first for n in (*done[1:], length))
            self._fresh.pop(spec.group_id, None)
        else:
            self._siblings.setdefault(spec.group_id, []).append(length)
        if len(self._fresh) > 100_000:
            self._fresh.clear()

    def forget_group(self, group_id: str) -> None:
        """Drop a group's state: it was given up before it completed."""
        self._siblings.pop(group_id, None)
        self._fresh.pop(group_id, None)

    # -- predicting -------------------------------------------------------------

    def _candidates(self, req: Request) -> list[float]:
        spec = req.group.spec
        siblings = self._siblings.get(spec.group_id, ())
        out: list[float] = list(siblings)
        scaled = [siblings[0] * r for r in self._ratios] if siblings else []  # the group's scale, the fleet's spread
        if spec.prompt_id and spec.prompt_id in self._per_prompt:
            out += self._per_prompt[spec.prompt_id]
        if len(out) >= 2:
            return out + scaled
        out += scaled
        if self._by_bucket:
            # Recent lengths of prompts of a similar size (within about a factor of 2).
            bucket = max(1, len(spec.prompt_token_ids)).bit_length()
            near = [n for b in (bucket - 1, bucket, bucket + 1) for n in self._by_bucket.get(b, ())]
            out += near if len(near) >= 8 else [n for d in self._by_bucket.values() for n in d]
        return out

    def predict(self, req: Request) -> LengthEstimate:
        """Remaining tokens of `req`, given what it has generated so far."""
        done = len(req.token_ids)
        budget = req.remaining_tokens
        gid = req.group.group_id
        siblings = len(self._siblings.get(gid, ()))
        # Placement and rebalancing ask for every request on every tick; the
        # candidates only change when a sibling finishes, or slowly as other
        # prompts finish: keep them sorted per group.
        hit = self._fresh.get(gid)
        if hit is None or hit[0] != siblings or self._observed - hit[1] >= self.refresh_every:
            hit = (siblings, self._observed, sorted(self._candidates(req)))
            self._fresh[gid] = hit
        return self._estimate(hit[2], done, budget)

    def _estimate(self, ordered: list[float], done: int, budget: int) -> LengthEstimate:
        candidates = ordered[bisect.bisect_right(ordered, done):]
        if candidates:
            med = _quantile(candidates, 0.5) - done
            high = _quantile(candidates, 0.9) - done
        elif done:
            med, high = float(done), 3.0 * done  # past every known length: heavy tail
        else:
            med, high = self.default_length, 4.0 * self.default_length
        return LengthEstimate(min(med, budget), min(high, budget))

    def informed(self, req: Request) -> bool:
        """Does the prediction rest on the request's own group or prompt
        (a finished sibling, the prompt's history), not only on other prompts?"""
        spec = req.group.spec
        return bool(self._siblings.get(spec.group_id)) or bool(spec.prompt_id and spec.prompt_id in self._per_prompt)

    @property
    def open_groups(self) -> int:
        """Groups with per-group state here (a finished sibling or cached
        candidates): bounded by the groups in flight, since a group's state
        goes when it completes or is given up (`forget_group`)."""
        return len(self._siblings.keys() | self._fresh.keys())


__all__ = ["LengthEstimate", "LengthPredictor"]
