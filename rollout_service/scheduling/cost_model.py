"""The one model of how long an engine takes to finish what it holds.

Time is counted in decode steps of a lone sequence (the per-step cost is
the unit). An engine needs as many steps as its longest remaining response,
and no fewer than its remaining tokens over `max_seqs` (a full batch) or its
remaining KV load over its KV capacity; every step costs more for each
sequence in it (`per_sequence_cost` per remaining token) and for each
context token it holds (`per_context_token_cost` per token-step of KV load);
each prefilled (or re-prefilled) token stalls the batch (`prefill_cost`).
Placement and the rebalancer both predict with it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class CostModel:
    per_sequence_cost: float = 0.04  # one more sequence in a step: this share of a lone step
    per_context_token_cost: float = 0.0  # one context token in a step: this share of a lone step
    prefill_cost: float = 0.02  # prefilling one token: this many lone steps

    def time(self, longest: float, tokens: float, max_seqs: int, kv_load: float = 0.0, kv_capacity: int = 0,
             prefill_tokens: float = 0.0) -> float:
        """Predicted lone decode steps until an engine with `max_seqs` slots
        and `kv_capacity` KV tokens (0: unknown) finishes `tokens` remaining
        tokens whose longest response has `longest` left, holding `kv_load`
        token-steps of KV, after prefilling `prefill_tokens`."""
        steps = max(longest, tokens / max(1, max_seqs))
        if kv_capacity > 0:
            steps = max(steps, kv_load / kv_capacity)
        return (steps + self.per_sequence_cost * tokens + self.per_context_token_cost * kv_load
                + self.prefill_cost * prefill_tokens)
