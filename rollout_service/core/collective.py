"""Collective weight pushes: the trainer broadcasts once, over a
`torch.distributed` group (NCCL on GPUs, gloo on CPUs), to every engine's
workers; this is the control plane's side of it (rollout.v1's
GetWeightTransferPlan, InitWeightTransfer, CollectiveUpdate).

The group: rank 0 is the trainer, then each live engine's receiving ranks in
fleet order, then (gloo) the service's stager rank, which writes the push to
a staging file as its bytes pass: the weights an engine that restarts is
brought up with, and what a failed push is rolled back to.

A push (`push`): version and manifest checked (every tensor's name, dtype
and shape, before a byte moves), then "accepted" (the trainer sends), every
member receives into its model while the serving version stays, then every
member makes the version live, and only then does any resume sampling with
it. A group with two ranks on one GPU (the trainer's and an engine
worker's, or two workers') is refused before any rank joins (`check_devices`:
NCCL would fail with "Duplicate GPU detected" once the group half formed).
A push while another applies is refused (FAILED_PRECONDITION); a push
that fails anywhere (a trainer that dies or stalls: the group's timeout)
puts the previous weights back on every member, leaves the group, and the
serving version stays.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable, Mapping

from rollout_proto.devices import RankDevice, shared_device
from rollout_service.core.fleet import Fleet
from rollout_service.core.weight_sync import WeightSync, WorkOps
from rollout_service.engines.collective import Stager, TransferInit, specs_of
from rollout_service.lifecycle.types import CoreError

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
DEVICE_REPORT_TIMEOUT_S = 30.0  # an engine's workers saying which GPU each uses


@dataclass(frozen=True)
class TransferPlan:
    backend: str
    world_size: int
    members: tuple[tuple[str, int, int], ...]  # (engine id, first rank, ranks)
    stager_rank: int  # -1: no stager

    @property
    def receivers(self) -> int:
        return self.world_size - 1


class CollectiveTransfer:
    def __init__(self, fleet: Fleet, weight_sync: WeightSync, stage: bool = True) -> None:
        self.fleet = fleet
        self.weight_sync = weight_sync
        self.stage = stage
        self.plan_in_force: TransferPlan | None = None
        self._incarnations: dict[str, int] = {}
        self._stager: Stager | None = None
        self._init_lock = asyncio.Lock()
        self.pushing: int | None = None  # the version being pushed

    def plan(self, backend: str, stage: bool | None = None) -> TransferPlan:
        """The group for `backend` over the live engines (`stage`: with the
        stager rank on gloo; None: as configured)."""
        if backend not in BACKENDS:
            raise CoreError("invalid", f"backend: must be one of {', '.join(BACKENDS)}, got {backend!r}")
        members, rank = [], 1
        for engine in self.fleet.live():
            n = engine.transfer_ranks()
            if n <= 0:
                raise CoreError("failed_precondition",
                                f"engine {engine.engine_id} ({engine.kind}) cannot join a collective transfer group")
            members.append((engine.engine_id, rank, n))
            rank += n
        if not members:
            raise CoreError("failed_precondition", "no engine is up to receive a collective push")
        stager = rank if (self.stage if stage is None else stage) and backend == "gloo" else -1
        return TransferPlan(backend, rank + (1 if stager >= 0 else 0), tuple(members), stager)

    async def check_devices(self, plan: TransferPlan, trainer: RankDevice | None) -> None:
        """Refuse the group (FAILED_PRECONDITION, naming both ranks and the
        GPU) if two of its ranks are on one physical GPU: the trainer's
        sending rank (as the trainer reports it) or any engine's workers (as
        they report it, `transfer_devices`). Ranks on CPUs never conflict."""
        ranks: list[tuple[int, str, RankDevice]] = [(0, "the trainer", trainer)] if trainer is not None else []
        engines = self.fleet.engines

        async def report(eid: str) -> list[RankDevice]:
            return list(await asyncio.wait_for(engines[eid].transfer_devices(), DEVICE_REPORT_TIMEOUT_S))

        reports = await asyncio.gather(*(report(eid) for eid, _, _ in plan.members), return_exceptions=True)
        for (eid, first, n), devices in zip(plan.members, reports):
            if isinstance(devices, BaseException):
                raise CoreError("unavailable", f"engine {eid} did not say which GPUs its workers use "
                                               f"({type(devices).__name__}: {devices}); try again")
            ranks += [(first + i, f"engine {eid} worker {i}", d) for i, d in enumerate(devices[:n])]
        why = shared_device(ranks)
        if why is not None:
            raise CoreError("failed_precondition", f"the transfer group cannot form: {why}")

    async def init(self, backend: str, address: str, port: int, world_size: int, timeout_s: float,
                   options: Mapping[str, object], trainer: RankDevice | None = None,
                   stage: bool | None = None) -> TransferPlan:
        if self.pushing is not None:
            raise CoreError("failed_precondition", f"a collective push (version {self.pushing}) is being applied")
        async with self._init_lock:
            plan = self.plan(backend, stage)
            if world_size != plan.world_size:
                raise CoreError("invalid", f"world_size: the group needs {plan.world_size} ranks (the trainer, "
                                           f"{plan.receivers} receiving), got {world_size}")
            await self.check_devices(plan, trainer)
            await self.close()
            base = TransferInit(backend, address, int(port), plan.world_size, 0, timeout_s, dict(options))
            engines = self.fleet.engines
            joins: list[Awaitable] = [engines[eid].init_weight_transfer(base.at(first)) for eid, first, _ in plan.members]
            stager = Stager(base.at(plan.stager_rank)) if plan.stager_rank >= 0 else None
            if stager is not None:
                joins.append(stager.join())
            results = await asyncio.gather(*joins, return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                self._stager, self.plan_in_force = stager, plan
                await self.close()
                raise CoreError("unavailable", f"the transfer group did not form: {failed[0]}")
            self._stager = stager
            self.plan_in_force = plan
            self._incarnations = {eid: self._incarnation(eid) for eid, _, _ in plan.members}
            log.info("collective transfer group formed: %s, %d ranks", backend, plan.world_size)
            return plan

    def _incarnation(self, engine_id: str) -> int:
        return int(getattr(self.fleet.engines[engine_id], "restarts", 0))

    def _check_group(self) -> TransferPlan:
        plan = self.plan_in_force
        if plan is None:
            raise CoreError("failed_precondition", "no transfer group: call InitWeightTransfer first")
        members = {eid for eid, _, _ in plan.members}
        live = {e.engine_id for e in self.fleet.live()}
        for eid in members:
            if eid not in live or self._incarnation(eid) != self._incarnations.get(eid):
                raise CoreError("failed_precondition",
                                f"engine {eid} restarted since the transfer group formed: call InitWeightTransfer again")
        if live - members:
            raise CoreError("failed_precondition", f"engine {sorted(live - members)[0]} is not in the transfer "
                                                   "group: call InitWeightTransfer again")
        return plan

    async def push(self, version: int, manifest: list[tuple[str, str, tuple[int, ...]]], work: WorkOps,
                   accepted: Callable[[], Awaitable[None]], received: Callable[[], Awaitable[None]]) -> int:
        """Receive a collective push on every member and make it live (see
        the module's docstring). `accepted` tells the trainer to send."""
        sync = self.weight_sync
        if self.pushing is not None or sync.lock.locked():
            raise CoreError("failed_precondition", "a weight push is being applied; push again once it is live")
        self.pushing = version
        try:
            plan = self._check_group()
            sync.check_weights(version, {name: (dtype, tuple(shape)) for name, dtype, shape in manifest})
            specs = specs_of(manifest)
            engines = [self.fleet.engines[eid] for eid, _, _ in plan.members]
            stager = self._stager

            async def receive_all():
                jobs = [e.receive_weights(version, specs) for e in engines]
                if stager is not None:
                    jobs.append(stager.receive(specs))
                results = await asyncio.gather(*jobs, return_exceptions=True)
                staged = results[-1] if stager is not None else None
                failed = [r for r in results if isinstance(r, BaseException)]
                if failed:
                    if stager is not None and not isinstance(staged, BaseException):
                        staged.cleanup()
                    raise failed[0]
                await received()
                return staged

            async def finish_all():
                await asyncio.gather(*(e.finish_received_weights(version) for e in engines))

            async def abandon_all():
                await asyncio.gather(*(e.abandon_received_weights(sync.last, sync.version) for e in engines),
                                     return_exceptions=True)
                await self.close()  # the group is unusable after a failed transfer

            return await sync.update_received(version, work, accepted, receive_all, finish_all, abandon_all)
        finally:
            self.pushing = None

    async def close(self) -> None:
        """Leave the group on every member (and the stager)."""
        plan, self.plan_in_force = self.plan_in_force, None
        stager, self._stager = self._stager, None
        if stager is not None:
            stager.close()
        if plan is not None:
            engines = self.fleet.engines
            await asyncio.gather(*(engines[eid].close_weight_transfer() for eid, _, _ in plan.members
                                   if eid in engines), return_exceptions=True)
