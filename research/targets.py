"""The two adapters of `RolloutTarget`, and the fleets behind them.

- `InProcessTarget` drives a `RolloutCore` directly. Under `run_virtual` it
  simulates hours of fleet time in seconds; the core, the placement policy
  and the engines are the service's own objects.
- `GrpcTarget` (`rollout_service.bench.targets`, shared with `rollout-service
  bench`) talks to a running service through `trainer_client.RolloutClient`
  over loopback.

Both fleets are built from the same `EngineConfig` by the service's own
factory (`make_engines`), so engine ids, seeds and cost models match. The
metrics read the engines' and the core's counters in process in both modes;
the driver itself only ever sees the adapter.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import AsyncIterator

import numpy as np

from rollout_service.bench.driver import Completion, GroupRequest
from rollout_service.bench.targets import DUMMY_STATE, GrpcTarget, completion
from research.policies import make_placement
from rollout_service.config import EngineConfig, ServiceConfig
from rollout_service.core.clock import Clock
from rollout_service.core.rollout import RolloutCore
from rollout_service.engines.types import SamplingParams
from rollout_service.lifecycle.types import GroupSpec, MultiTurnSpec
from rollout_service.drafter.mechanisms import mechanism_spec
from rollout_service.drafter.runtime import SpecRuntime
from rollout_service.factory import make_engines, model_info
from rollout_service.partial import CarryOverConfig
from rollout_service.scheduling import PolicySpec
from rollout_service.scheduling.rebalancer import RebalanceConfig

NO_MODEL = "(simulated)"  # an engine.model with no config.json: sim engines without a model


@dataclass(slots=True)
class FleetSpec:
    """The engines and policy of one run."""

    engines: int
    policy: PolicySpec
    kind: str = "sim"  # "sim" or "vllm" (real clock only)
    max_seqs: int = 64
    kv_tokens: int = 262_144  # per simulated engine
    sim: dict = field(default_factory=dict)  # SimParams overrides (cost model)
    model: str = ""  # vLLM: a model directory ("" = the bundled tiny reasoner)
    max_model_len: int = 0
    vocab_size: int = 0  # > 0: simulated engines accept this vocabulary (real prompts)
    kv_cache_gib: float = 1.0  # vLLM engines
    max_version_lag: int = -1  # partial rollout: staleness bound (-1: none)
    environments: dict = field(default_factory=dict)  # multi-turn: name -> environment hook (in process)
    spec: dict = field(default_factory=dict)  # `[engine.spec]` overrides, applied when the policy speculates

    @property
    def affinity(self) -> bool:
        """Session affinity (multi-turn): only with the `affinity` mechanism,
        so that `least-assigned` is the baseline placing every turn anew."""
        return self.policy.has("affinity")

    def rebalance(self) -> RebalanceConfig:
        return RebalanceConfig(enabled=self.policy.has("rebalance"), isolate_tail=self.policy.has("isolate"),
                               repack=self.policy.has("repack"))

    def carry_over(self) -> CarryOverConfig:
        return CarryOverConfig(max_version_lag=self.max_version_lag if self.policy.has("partial") else -1)

    def engine_config(self) -> EngineConfig:
        spec, others = mechanism_spec(self.policy.mechanisms)  # "spec", "spec-ngram" -> [engine.spec]
        if spec:  # overrides (a depth schedule, the tuner off) only where the policy speculates
            spec = {**spec, **self.spec, "method": spec["method"]}
        unknown = set(others) - {"rebalance", "isolate", "repack", "partial", "affinity"}
        if unknown:
            raise ValueError(f"policy {self.policy.name!r}: the load-test harness does not switch on {sorted(unknown)}")
        if self.kind == "sim":
            sim = {"kv_capacity_tokens": self.kv_tokens, **self.sim}
            if self.vocab_size:
                sim.setdefault("vocab_size", self.vocab_size)
            return EngineConfig(kind="sim", num_engines=self.engines, model=NO_MODEL, max_seqs=self.max_seqs,
                                max_model_len=self.max_model_len, sim=sim, spec=spec)
        return EngineConfig(kind=self.kind, num_engines=self.engines, model=self.model, max_seqs=self.max_seqs,
                            max_model_len=self.max_model_len, kv_cache_gib=self.kv_cache_gib, spec=spec)

    def service_config(self) -> ServiceConfig:
        return ServiceConfig(grpc_port=0, http_port=0, placement=self.policy.placement, log_level="WARNING",
                             engine=self.engine_config(), rebalance=self.rebalance(), carry_over=self.carry_over(),
                             session_affinity=self.affinity)


@dataclass(slots=True)
class Fleet:
    """A started fleet: the target the driver uses, and the in-process
    objects the metrics read."""

    target: "InProcessTarget | GrpcTarget"
    core: RolloutCore
    vocab_size: int
    max_model_len: int
    spec: SpecRuntime | None = None  # the depth tuner and online drafter, when the policy speculates

    @property
    def engines(self) -> dict:
        return self.core.engines


def _staged(state: dict):
    """A verified push of `state`, in the form `RolloutCore.update_weights` takes."""
    from rollout_service.engines import weights as w

    tensors = [w.WeightTensor(name, str(a.dtype), tuple(a.shape), memoryview(a.reshape(-1).view(np.uint8)))
               for name, a in state.items()]
    staged = getattr(w, "StagedWeights", None)
    return staged(tensors) if staged else {t.name: t for t in tensors}


class InProcessTarget:
    """`RolloutTarget` over a `RolloutCore` in this process (no network)."""

    def __init__(self, core: RolloutCore, consumer_id: str = "load-test", keep_tokens: bool = False) -> None:
        self.core = core
        self.consumer_id = consumer_id
        self.keep_tokens = keep_tokens

    async def submit(self, groups: list[GroupRequest]) -> None:
        self.core.submit([
            GroupSpec(g.group_id, g.prompt_token_ids, g.num_samples,
                      SamplingParams(max_tokens=g.max_tokens, temperature=g.temperature), metadata=g.metadata(),
                      multi_turn=MultiTurnSpec(max_turns=g.max_turns, environment="trace") if g.trajectories else None)
            for g in groups
        ])

    async def completions(self) -> AsyncIterator[Completion]:
        delivery = self.core.delivery
        async for entry in delivery.stream(self.consumer_id):
            s = entry.sample
            if getattr(s, "awaiting_observation", False):
                continue  # a turn event, not a finished trajectory
            yield completion(s, len(s.prompt_token_ids), self.keep_tokens)
            if entry.cursor % 256 == 0:
                delivery.ack(self.consumer_id, entry.cursor)  # frees what was consumed

    async def push_weights(self, version: int) -> None:
        await self.core.update_weights(version, _staged(DUMMY_STATE))

    def now(self) -> float:
        return self.core.clock.monotonic()


@contextlib.asynccontextmanager
async def in_process_fleet(spec: FleetSpec, keep_tokens: bool = False) -> AsyncIterator[Fleet]:
    """A core with the spec's engines and placement, on the running loop's clock."""
    cfg = spec.engine_config()
    info = model_info(cfg)
    rebalance = spec.rebalance()
    core = RolloutCore(make_engines(cfg, info), make_placement(spec.policy.placement), Clock(),
                       rebalance=rebalance if rebalance.enabled else None, carry_over=spec.carry_over(),
                       environments=spec.environments, affinity=spec.affinity)
    await core.start()
    drafter = SpecRuntime(core, cfg.spec)  # depth tuner, online drafter
    await drafter.start()
    try:
        yield Fleet(InProcessTarget(core, keep_tokens=keep_tokens), core, info.vocab_size, info.max_model_len, drafter)
    finally:
        await drafter.stop()
        await core.stop()


@contextlib.asynccontextmanager
async def grpc_fleet(spec: FleetSpec, keep_tokens: bool = False) -> AsyncIterator[Fleet]:
    """A real `RolloutService` on loopback (free ports) and a client to it."""
    from rollout_service.service import RolloutService
    from trainer_client import RolloutClient

    cfg = spec.service_config()
    info = model_info(cfg.engine)
    if info.path:
        cfg.weights_file_dirs = [info.path]  # where the checkpoint pushed as a file lies
    service = RolloutService(cfg)
    await service.start()
    try:
        weights_file = None
        if spec.kind != "sim" and info.path:
            from pathlib import Path

            candidate = Path(info.path) / "model.safetensors"
            weights_file = str(candidate) if candidate.exists() else None
        async with RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id="load-test") as client:
            await client.wait_ready()
            yield Fleet(GrpcTarget(client, weights_file, keep_tokens), service.core, info.vocab_size, info.max_model_len,
                        service.spec_runtime)
    finally:
        await service.stop()
