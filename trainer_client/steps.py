"""Closed-loop GRPO steps with over-provisioning (partial rollout).

A step needs B complete groups. `StepRollout` keeps ceil(B * over_provision)
groups in flight, hands over the B oldest-submitted among those complete,
and leaves the rest generating: they are carried into the next policy
version instead of being discarded or blocking the step.
"""
from __future__ import annotations

import math
from typing import Iterator

from trainer_client.client import RolloutClient
from trainer_client.types import CompletedSample, PromptGroup


class StepRollout:
    """Usage::

        steps = StepRollout(client, prompt_groups(), groups_per_step=32, over_provision=2.0)
        for step in range(100):
            groups = await steps.next_step()          # 32 complete groups
            loss = train(groups)                      # mask or reweight stale tokens
            await client.push_weights(model.state_dict(), version=step + 1)
    """

    def __init__(
        self,
        client: RolloutClient,
        prompts: Iterator[PromptGroup],
        groups_per_step: int,
        over_provision: float = 1.0,
    ) -> None:
        if groups_per_step < 1:
            raise ValueError(f"groups_per_step must be >= 1, got {groups_per_step}")
        if over_provision < 1.0:
            raise ValueError(f"over_provision must be >= 1.0, got {over_provision}")
        self.client = client
        self.prompts = prompts
        self.groups_per_step = groups_per_step
        self.in_flight_target = math.ceil(groups_per_step * over_provision)
        self._order: dict[str, int] = {}  # group id -> submission number
        self._submitted = 0
        self._partial: dict[str, list[CompletedSample]] = {}
        self._complete: dict[str, list[CompletedSample]] = {}
        self._stream = None
        self.dropped: list[list[CompletedSample]] = []  # groups the service gave up
        self.exhausted = False

    @property
    def in_flight(self) -> int:
        return len(self._order) - len(self._complete)

    async def _top_up(self) -> None:
        batch = []
        # Complete groups not handed over yet count too, so they never pile up and age.
        while not self.exhausted and len(self._order) + len(batch) < self.in_flight_target:
            try:
                g = next(self.prompts)
            except StopIteration:
                self.exhausted = True
                break
            batch.append(g)
        if not batch:
            return
        ids = await self.client.submit(batch)
        for gid in ids:
            self._order[gid] = self._submitted
            self._submitted += 1

    async def next_step(self) -> list[list[CompletedSample]]:
        """The B oldest-submitted complete groups (fewer only when the prompts
        ran out), each ordered by sample index."""
        await self._top_up()
        if self._stream is None:
            self._stream = self.client.stream(ack_every=1 << 62).__aiter__()
        while len(self._complete) < self.groups_per_step and (self.in_flight > 0 or not self.exhausted):
            sample = await self._stream.__anext__()
            if sample.group_id not in self._order or sample.awaiting_observation:
                continue  # not ours, or a turn event (answered by trajectory_groups)
            self._partial.setdefault(sample.group_id, []).append(sample)
            if sample.group_complete:
                group = sorted(self._partial.pop(sample.group_id), key=lambda s: s.index)
                if any(s.drop_reason for s in group):
                    self.dropped.append(group)
                    del self._order[sample.group_id]
                    await self._top_up()
                else:
                    self._complete[sample.group_id] = group
        chosen = sorted(self._complete, key=self._order.__getitem__)[: self.groups_per_step]
        out = [self._complete.pop(gid) for gid in chosen]
        for gid in chosen:
            del self._order[gid]
        await self._ack()
        return out

    async def _ack(self) -> None:
        # Everything below the oldest sample still held here has been handed over.
        held = [s[0].cursor for s in self._partial.values()] + [min(x.cursor for x in g) for g in self._complete.values()]
        upto = (min(held) - 1) if held else self.client.last_cursor
        if upto > 0:
            await self.client.ack(upto)
