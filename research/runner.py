"""One load-test run: a workload, a fleet, a policy, a clock -> metrics.

    virtual clock: the in-process core + simulated engines on `run_virtual`
    real clock:    a `RolloutService` on loopback + `RolloutClient`

Both run the same driver (`rollout_service.bench.driver`) and report the same metrics
(`research.metrics`).
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from research import multiturn, speed_reference
from rollout_service.bench import driver
from research.metrics import CostModel, Counters, FleetProbe, host_cpu, host_cpu_share, step_metrics, summarise
from research.targets import FleetSpec, grpc_fleet, in_process_fleet
from rollout_service.bench.workloads import Workload
from rollout_service.core.clock import run_virtual
from rollout_service.drafter.drafter_trainer import DrafterTrainer
from rollout_service.drafter.runtime import SpecRuntime
from rollout_service.engines.sim import SimParams
from rollout_service.scheduling import PolicySpec

CALIBRATION = Path(__file__).resolve().parent / "calibration" / "tiny_reasoner_cpu.json"


@dataclass(slots=True)
class RunConfig:
    """Everything but the policy; `sim` overrides SimParams fields (the cost model)."""

    workload: Workload
    engines: int
    clock: str = "virtual"  # "virtual" or "real"
    engine_kind: str = "sim"  # "sim" or "vllm"
    max_seqs: int = 64
    kv_tokens: int = 262_144
    sim: dict = field(default_factory=dict)
    seed: int = 0
    mode: str = "closed"  # "closed" or "open"
    rate: float = 0.0  # open loop: groups per second
    need_groups: int | None = None  # closed loop: groups a step waits for (default: all)
    model: str = ""  # vLLM model directory ("" = the bundled tiny reasoner)
    progress: bool = True
    over_provision: float = 2.0  # policy "partial": groups in flight per group a step needs
    max_version_lag: int = 1  # policy "partial": staleness bound (-1: none)
    train_s: float = 0.0  # closed loop: the trainer stand-in's compute per step
    warmup_steps: int = 0  # closed loop: the workload's first steps run once, unmeasured, before the run
    spec: dict = field(default_factory=dict)  # `[engine.spec]` overrides for the policies that speculate

    def check(self) -> None:
        if self.clock not in ("virtual", "real"):
            raise ValueError(f"clock must be 'virtual' or 'real', got {self.clock!r}")
        if self.engine_kind not in ("sim", "vllm"):
            raise ValueError(f"engine must be 'sim' or 'vllm', got {self.engine_kind!r}")
        if self.clock == "virtual" and self.engine_kind != "sim":
            raise ValueError("virtual time needs simulated engines (--engine sim); real engines run on --clock real")
        if self.engines < 1:
            raise ValueError(f"engines must be >= 1, got {self.engines}")
        if self.mode not in ("closed", "open"):
            raise ValueError(f"mode must be 'closed' or 'open', got {self.mode!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.warmup_steps and self.mode != "closed":
            raise ValueError("warm-up steps are for the closed loop (--mode closed)")
        if self.train_s < 0:
            raise ValueError(f"train_s must be >= 0 seconds, got {self.train_s}")
        if self.mode == "open" and self.rate <= 0:
            raise ValueError("the open loop needs --rate > 0 (groups per second)")


@dataclass(slots=True)
class RunResult:
    policy: str
    summary: dict
    steps: list[dict]
    timeline: dict  # times (s from the first step's start), running (samples x engines), step starts
    records: list[driver.StepRecord] = field(default_factory=list, repr=False)  # every delivered sample
    drained: list[driver.Completion] = field(default_factory=list, repr=False)  # partial: delivered after the last step

    def measured_steps(self) -> dict[int, list[tuple[int, list[int]]]]:
        """What was generated, as a trace: per workload step, each group's
        prompt length and its samples' response lengths (in sample order).
        Group ids name the workload step and index they came from
        (`{policy}-s{step}-g{i}`), whichever step delivered them."""
        groups: dict[tuple[int, int], dict[int, driver.Completion]] = {}
        for c in [c for r in self.records for c in r.samples] + self.drained:
            _, step, index = c.group_id.rsplit("-", 2)
            groups.setdefault((int(step[1:]), int(index[1:])), {})[c.index] = c
        out: dict[int, list[tuple[int, list[int]]]] = {}
        for (step, _), samples in sorted(groups.items()):
            first = next(iter(samples.values()))
            out.setdefault(step, []).append((first.prompt_len, [samples[i].response_len for i in sorted(samples)]))
        return out


def fleet_spec(cfg: RunConfig, policy: PolicySpec, environments: dict | None = None) -> FleetSpec:
    w = cfg.workload
    longest_prompt = max(g.prompt_len for s in w.steps for g in s)
    sim = dict(cfg.sim)
    longest = w.max_tokens
    if w.multi_turn:
        # Prefill is charged only for context not in the engine's prefix cache.
        sim.setdefault("prefix_cache", True)
        longest = max(w.max_tokens, multiturn.longest_response(w))
    return FleetSpec(
        engines=cfg.engines,
        policy=policy,
        kind=cfg.engine_kind,
        max_seqs=cfg.max_seqs,
        kv_tokens=cfg.kv_tokens,
        sim=sim,
        model=cfg.model,
        # Simulated engines take any length; real ones keep their model's limit.
        max_model_len=longest_prompt + longest + 1 if cfg.engine_kind == "sim" else 0,
        vocab_size=w.vocab_size,
        max_version_lag=cfg.max_version_lag,
        environments=dict(environments or {}),
        spec=dict(cfg.spec),
    )


def cost_model(fleet, cfg: RunConfig) -> tuple[CostModel, str]:
    """The cost model of the fleet: the simulated engines' own, or the
    calibration of real engines (an estimate)."""
    engine = next(iter(fleet.engines.values()))
    params = getattr(engine, "params", None)
    if isinstance(params, SimParams):
        return CostModel.of(params, params.kv_capacity_tokens), "simulated engine cost model"
    base = SimParams(max_seqs=cfg.max_seqs)
    if CALIBRATION.exists():
        fit = json.loads(CALIBRATION.read_text())["sim_params"]
        base = SimParams(max_seqs=cfg.max_seqs, **{k: v for k, v in fit.items() if k in SimParams.__dataclass_fields__ and k != "max_seqs"})
        return CostModel.of(base), f"calibration {CALIBRATION.name}"
    return CostModel.of(base), "SimParams defaults (no calibration file)"


def _estimate_span(w: Workload, cost: CostModel, engines: int) -> float:
    """A rough total of the steps' lower bounds (to size the probe interval)."""
    total = 0.0
    for step in w.steps:
        P = np.array([g.prompt_len for g in step for _ in g.output_lens])
        L = np.array([x for g in step for x in g.output_lens])
        total += max(cost.work_s(P, L).sum() / engines, cost.alone_s(P, L).max())
    return total


def _progress(policy: str, m: dict, steps: int, wall0: float) -> None:
    ratio = m["ratio_to_bound"]
    print(
        f"  [{policy}] step {m['step'] + 1}/{steps}: makespan {m['makespan_s']:.2f} s "
        f"(bound {m['lower_bound_s']:.2f} s, x{ratio:.2f}), {m['tokens']:,} tokens, "
        f"slots {m['slot_utilisation']:.2f}, wall {time.perf_counter() - wall0:.1f} s",
        file=sys.stderr, flush=True,
    )


async def run_async(cfg: RunConfig, policy: PolicySpec, on_fleet=None) -> RunResult:
    """`run_policy` on the running event loop (real clock: the caller's loop).
    `on_fleet(fleet)`, if given, is called once the fleet is up (to instrument it)."""
    cfg.check()
    w = cfg.workload
    env = multiturn.environment(w) if w.multi_turn else None
    spec = fleet_spec(cfg, policy, {multiturn.ENV_NAME: env} if env is not None else None)
    fleet_of = in_process_fleet if cfg.clock == "virtual" else grpc_fleet
    keep_tokens = cfg.engine_kind != "sim" and any(g.problem is not None for s in cfg.workload.steps for g in s)
    wall0 = time.perf_counter()
    async with fleet_of(spec, keep_tokens=keep_tokens) as fleet:
        if on_fleet is not None:
            on_fleet(fleet)
        if cfg.engine_kind != "sim":
            need = max(g.prompt_len for s in w.steps for g in s) + w.max_tokens
            if need > fleet.max_model_len:
                raise ValueError(f"the workload needs {need} tokens per sequence, the model allows "
                                 f"{fleet.max_model_len}: scale it down with --length-scale")
        cost, cost_source = cost_model(fleet, cfg)
        interval = _estimate_span(w, cost, cfg.engines) / 400
        if cfg.clock == "real":
            interval = max(0.02, interval)
        if w.multi_turn:
            interval = multiturn.PROBE_INTERVAL_S
        probe = FleetProbe(fleet.engines, fleet.target.now, max(interval, 1e-6),
                           tools=(lambda: env.in_flight) if env is not None else None)
        starts: dict[int, Counters] = {}
        step_out: list[dict] = []
        n_steps = len(w.steps) if cfg.mode == "closed" else 1

        def on_start(step: int) -> None:
            starts[step] = Counters.read(fleet)

        def on_end(record: driver.StepRecord) -> None:
            probe.sample()
            m = step_metrics(record, starts[record.step], Counters.read(fleet), probe, cost, cfg.engines)
            if w.multi_turn:
                m.update(multiturn.step_metrics(record, starts[record.step], Counters.read(fleet), probe, cost,
                                                cfg.engines, w))
            step_out.append(m)
            if cfg.progress:
                _progress(policy.name, m, n_steps, wall0)

        warmup_s = 0.0
        if cfg.warmup_steps:
            if cfg.progress:
                print(f"  [{policy.name}] warm-up: {cfg.warmup_steps} step(s), not measured", file=sys.stderr, flush=True)
            warmup_s = await driver.warm_up(fleet.target, w, fleet.vocab_size, run_id=policy.name,
                                            steps=cfg.warmup_steps)
            if cfg.progress:
                print(f"  [{policy.name}] warm-up done in {warmup_s:.1f} s", file=sys.stderr, flush=True)
        probe.start()
        host0 = host_cpu() if cfg.clock == "real" else None  # virtual time: the host's CPUs say nothing
        extra = {}
        try:
            if cfg.mode == "closed" and policy.has("partial"):
                records, duplicates, extra = await driver.partial_loop(
                    fleet.target, w, fleet.vocab_size, cfg.over_provision, run_id=policy.name,
                    on_step_start=on_start, on_step_end=on_end, train_s=cfg.train_s)
            elif cfg.mode == "closed":
                records, duplicates = await driver.closed_loop(
                    fleet.target, w, fleet.vocab_size, run_id=policy.name, need_groups=cfg.need_groups,
                    on_step_start=on_start, on_step_end=on_end, train_s=cfg.train_s)
            else:
                records, duplicates = await driver.open_loop(
                    fleet.target, w, fleet.vocab_size, cfg.rate, seed=cfg.seed, run_id=policy.name,
                    on_step_start=on_start, on_step_end=on_end)
        finally:
            await probe.stop()
        host = host_cpu_share(host0, host_cpu())
        if host is not None and cfg.progress:
            print(f"  [{policy.name}] host CPUs over the measured steps: {host['busy']:.0%} busy, "
                  f"{host['idle']:.0%} idle, {host['steal']:.1%} stolen by the hypervisor", file=sys.stderr, flush=True)
        speculation = speculation_summary(fleet.spec) if fleet.spec is not None and fleet.spec.spec.enabled else None
        if speculation is not None and cfg.progress:
            print(f"  [{policy.name}] {describe_speculation(speculation)}", file=sys.stderr, flush=True)
    summary = summarise(step_out, records, cfg.engines)
    if w.multi_turn:
        summary.update(multiturn.summarise(step_out, records))
        summary["trajectory_moves"] = int(fleet.core.counters.get("trajectory_moves", 0))
        summary["tool_calls"] = env.calls
    if cfg.mode == "closed":
        summary.update(trained_staleness(records, cfg.max_version_lag if policy.has("partial") else -1))
    if extra:
        summary.update(partial_summary(extra, records, summary, cfg))
    summary.update({
        "policy": policy.name,
        "duplicate_samples": duplicates,
        "wall_s": time.perf_counter() - wall0,
        "warmup_s": warmup_s,
        # Real clock: where the host's CPU time went over the measured steps.
        "host_cpu": host,
        "cost_model": {"source": cost_source, **{k: getattr(cost, k) for k in cost.__dataclass_fields__}},
    })
    if keep_tokens:
        summary["reward_mean"] = _reward(records, w)
    if speculation is not None:
        summary["speculation"] = speculation
    t0 = records[0].submitted_at if records else 0.0
    timeline = {
        "times": [t - t0 for t in probe.times],
        "running": probe.running,
        "step_starts": [r.submitted_at - t0 for r in records],
        "step_ends": [r.done_at - t0 for r in records],
        "engine_ids": list(fleet.engines),
        "max_seqs": cfg.max_seqs,
    }
    drained = extra["drain"]["drained_samples"] if extra else []
    return RunResult(policy.name, summary, step_out, timeline, records, drained)


_ROUND_KEYS = ("policy_version", "draft_version", "examples", "seconds", "loss_last", "agreement_before",
               "agreement_after", "push_seconds")


def speculation_summary(spec: SpecRuntime) -> dict:
    """What speculation did over the run, warm-up included: per engine the
    verify steps, the mean acceptance length (tokens per verify step of one
    request, the bonus token included) and the depth schedule in force at
    the end [(first batch, last batch, K)]; the online drafter's rounds
    (when it trains a model), each with the greedy agreement with the
    policy's samples before and after it and the seconds it took."""
    status = spec.status()
    out: dict = {
        "method": status.method,
        "max_k": max((e.max_k for e in status.engines.values()), default=0),
        "engines": {eid: {"verify_steps": e.verify_steps, "draft_tokens": e.draft_tokens,
                          "accepted_tokens": e.accepted_tokens, "mean_acceptance_length": e.mean_acceptance_length,
                          "draft_version": e.draft_version, "schedule": [list(b) for b in e.schedule]}
                    for eid, e in status.engines.items()},
    }
    steps = sum(e.verify_steps for e in status.engines.values())
    accepted = sum(e.accepted_tokens for e in status.engines.values())
    out["mean_acceptance_length"] = 1.0 + accepted / steps if steps else None
    if isinstance(spec.trainer, DrafterTrainer):
        out["drafter_rounds"] = [{k: r.get(k) for k in _ROUND_KEYS} for r in spec.trainer.rounds]
    return out


def describe_speculation(s: dict) -> str:
    """One line of `speculation_summary` for the progress output."""
    length = s["mean_acceptance_length"]
    text = f"speculation ({s['method']}): acceptance length {length:.2f}" if length else \
        f"speculation ({s['method']}): no verify step"
    rounds = s.get("drafter_rounds")
    if rounds:
        text += (f"; {len(rounds)} drafter rounds, {sum(r['seconds'] or 0 for r in rounds):.0f} s of training, "
                 f"agreement {rounds[0]['agreement_before']:.2f} before the first, "
                 f"{rounds[-1]['agreement_after']:.2f} after the last")
    return text


def partial_summary(extra: dict, records: list[driver.StepRecord], summary: dict, cfg: RunConfig) -> dict:
    """Partial rollout's own figures: the drain of carried groups at the
    end, staleness of what was delivered, and the length bias per step."""
    drain = extra["drain"]
    delivered = [c for r in records for c in r.samples] + drain["drained_samples"]
    lags: dict[int, int] = {}
    for r in records:
        for c in r.samples:
            lag = r.step - c.min_version  # versions behind the policy the step trains
            lags[lag] = lags.get(lag, 0) + 1
    total = sum(r.makespan_s for r in records)
    groups = sum(r.groups_complete for r in records)
    return {
        # A partial step hands over groups that started in earlier steps: the
        # per-step bound of a synchronous step does not apply to it.
        "ratio_to_bound": None,
        "over_provision": cfg.over_provision,
        "max_version_lag": cfg.max_version_lag,
        "drain_s": drain["drain_s"],
        "drained_groups": drain["drained_groups"],
        "groups_per_s_with_drain": (groups + drain["drained_groups"]) / (total + drain["drain_s"]) if total else 0.0,
        "samples_delivered_with_drain": len(delivered),
        # Versions between a sample's oldest token and the policy the step trains (a finished
        # sample waits in its group for slower siblings, so this can exceed max_version_lag,
        # which bounds staleness when the service delivers a sample).
        "samples_by_handover_lag": {str(k): v for k, v in sorted(lags.items())},
        "length_bias": extra["length_bias"],
    }


def trained_staleness(records: list[driver.StepRecord], max_version_lag: int) -> dict:
    """What a trainer that honours `max_version_lag` trains on: step k trains
    policy version k, so a token sampled by a version older than
    k - max_version_lag is masked out of the loss (the GRPO example's rule,
    `Sample.loss_mask(current_version, max_lag)`). Counts the tokens so masked and the largest
    lag among the tokens trained on."""
    masked = trained = 0
    worst = 0
    for r in records:
        for c in r.samples:
            for version, n in c.tokens_by_version.items():
                lag = r.step - version
                if max_version_lag >= 0 and lag > max_version_lag:
                    masked += n
                else:
                    trained += n
                    worst = max(worst, lag)
    return {"tokens_trained": trained, "tokens_masked_stale": masked, "max_trained_lag": worst}


def _reward(records: list[driver.StepRecord], w: Workload) -> float:
    from rollout_service.bench.workloads.tiny_reasoner import score

    rewards = []
    for r in records:
        for c in r.samples:
            _, step, group = c.group_id.rsplit("-", 2)
            shape = w.steps[int(step[1:])][int(group[1:])]
            if shape.problem is not None and c.response_token_ids is not None:
                rewards.append(score(shape.problem, c.response_token_ids))
    return float(np.mean(rewards)) if rewards else 0.0


def run_policy(cfg: RunConfig, policy: PolicySpec, on_fleet=None) -> RunResult:
    """Run one policy on a fresh fleet (virtual time or a real service).
    On real vLLM engines the host's speed reference is timed before the
    fleet starts and after it stops (`speed_reference` in the summary)."""
    cfg.check()
    if cfg.clock == "virtual":
        return run_virtual(run_async(cfg, policy, on_fleet))
    before = _speed_reference(cfg)
    result = asyncio.run(run_async(cfg, policy, on_fleet))
    ref = speed_reference.bracket(before, _speed_reference(cfg) if before is not None else None)
    if ref is not None:
        result.summary["speed_reference"] = ref
        if cfg.progress:
            print(f"  [{policy.name}] {speed_reference.describe(ref)}", file=sys.stderr, flush=True)
    return result


def _speed_reference(cfg: RunConfig) -> dict | None:
    """The host's speed now on the run's target (real vLLM engines on the
    CPU only: what `predict` scales a calibration by), one copy per engine."""
    if cfg.engine_kind != "vllm" or not speed_reference.on_cpu():
        return None
    from rollout_service.assets import tiny_model_path

    return speed_reference.measure_or_warn(cfg.model or str(tiny_model_path()),
                                           copies=min(cfg.engines, os.cpu_count() or 1))


PASS_MARK = "#"  # a policy's result in pass k of a two-pass run is named POLICY#k


def base_policy(name: str) -> str:
    """The policy a result name stands for (`partial#2` -> `partial`)."""
    return name.split(PASS_MARK, 1)[0]


def check_passes(cfg: RunConfig, passes: int) -> None:
    """Why `run_passes(cfg, ..., passes)` cannot run, as a ValueError."""
    if passes == 1:
        return
    if passes != 2:
        raise ValueError(f"passes must be 1 or 2, got {passes}")
    if cfg.mode != "closed":
        raise ValueError("two passes are for the closed loop (--mode closed)")
    if len(cfg.workload.steps) < 2:
        raise ValueError("two passes need at least 2 steps (each pass runs half of them)")


def run_passes(cfg: RunConfig, policies: list[PolicySpec], passes: int = 1) -> list[RunResult]:
    """Every policy on a fresh fleet of its own, one after the other.

    `passes=2` runs each policy twice: the first half of the workload's
    steps with the policies in the order given, then the second half in
    the reverse order (A B C C B A), each time on a fresh fleet. On a host
    whose speed drifts during the run, a drift that is even roughly linear
    in time then weighs on every policy alike, where one pass puts all of
    it on the policy that runs last. The results are named `POLICY#1` and
    `POLICY#2`; `report.pooled` joins them."""
    check_passes(cfg, passes)
    if passes == 1:
        return [run_policy(cfg, p) for p in policies]
    first, second = cfg.workload.split(2)
    out = []
    for k, (half, order) in enumerate(((first, policies), (second, policies[::-1])), start=1):
        for policy in order:
            if cfg.progress:
                print(f"pass {k} of 2: {policy.name}, steps {len(half.steps)}", file=sys.stderr, flush=True)
            result = run_policy(replace(cfg, workload=half), policy)
            result.policy = f"{policy.name}{PASS_MARK}{k}"
            result.summary.update(policy=result.policy, run_pass=k)
            out.append(result)
    return out
