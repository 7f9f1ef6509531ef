"""How well the length predictor ranks responses, at the moments the service
uses it, on a replay.

    python -m research predictor --workload math,code,video --engines 8

Runs the replay in virtual time under a policy (default `rebalance`, whose
placement and rebalancer ask the predictor) and records, for every sample,

- **at placement**: the predicted total length when the request is first
  placed on an engine (what late binding orders the queue by);
- **after the first sibling**: when the first sample of its GRPO group
  finishes, the predicted total and remaining length of every sibling still
  running (the group's probe: what the rebalancer sees from then on).

and reports Spearman's rank correlation of each against the true length
(total, or what was left at that moment), over the whole run and over the
steps after the first (the first step has no history: every prediction at
placement is the same default). A trace's lengths are the simulated
engines' hints, so the true lengths are known exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from research.runner import RunConfig, run_policy
from rollout_service.bench.workloads import load_workload
from research.policies import parse_policy
from research.report import save_json
from rollout_service.lifecycle.types import Request
from rollout_service.scheduling.length_predictor import LengthPredictor


def predicted_total(predictor: LengthPredictor, req: Request) -> float:
    """Predicted median total length of `req` (generated + predicted remaining)."""
    return len(req.token_ids) + predictor.predict(req).median


def spearman(xs: list[float], ys: list[float]) -> float:
    """Rank correlation of predictions and outcomes (ties get mean ranks)."""

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    if len(xs) < 2:
        return 0.0
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx) ** 0.5
    vy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (vx * vy) if vx and vy else 0.0


class _RecordingPlacement:
    """The core's placement, reporting every request it places."""

    def __init__(self, inner, on_place) -> None:
        self.inner, self.on_place = inner, on_place
        self.name, self.predictor = inner.name, inner.predictor

    def place(self, queue, loads, assigned, in_flight=None):
        decisions = self.inner.place(queue, loads, assigned, in_flight)
        for req, _ in decisions:
            self.on_place(req)
        return decisions


@dataclass(slots=True)
class Recorder:
    """Predictions taken during a run, by request id."""

    placement: dict[str, float] = field(default_factory=dict)  # predicted total at first placement
    after_first: dict[str, tuple[int, float]] = field(default_factory=dict)  # (generated, predicted remaining)

    def attach(self, fleet) -> None:
        core = fleet.core
        if core.predictor is None:
            core.predictor = LengthPredictor()  # a policy without one: measure the default predictor
        predictor = core.predictor
        observe = predictor.observe

        def on_place(req):
            if req.request_id not in self.placement:
                self.placement[req.request_id] = predicted_total(predictor, req)

        def recording_observe(req, length, group_done):
            observe(req, length, group_done)
            if req.group.finished == 1 and not group_done:
                for sib in req.group.requests:
                    if sib.finish_reason is None and sib.request_id not in self.after_first:
                        self.after_first[sib.request_id] = (len(sib.token_ids), predictor.predict(sib).median)

        core.placement = _RecordingPlacement(core.placement, on_place)
        predictor.observe = recording_observe


def _step_of(sample_id: str) -> int:
    # Load-test group ids are "<run>-s<step>-g<group>"; sample ids add "/<index>".
    return int(sample_id.rsplit("/", 1)[0].rsplit("-", 2)[1][1:])


def _rho(pairs: list[tuple[float, float]]) -> float | None:
    if len(pairs) < 2:
        return None
    return spearman([p for p, _ in pairs], [t for _, t in pairs])


def measure(workload_name: str, engines: int, policy: str = "rebalance", kv_tokens: int = 262_144,
            max_seqs: int = 64, seed: int = 0, steps: int | None = None, groups_per_step: int | None = None,
            length_scale: float = 1.0) -> dict:
    """Run one replay and return the correlations (and counts)."""
    workload = load_workload(workload_name, seed=seed, length_scale=length_scale, steps=steps,
                             groups_per_step=groups_per_step)
    cfg = RunConfig(workload=workload, engines=engines, max_seqs=max_seqs, kv_tokens=kv_tokens, seed=seed,
                    progress=False)
    rec = Recorder()
    result = run_policy(cfg, parse_policy(policy), on_fleet=rec.attach)
    true = {c.sample_id: c.response_len for r in result.records for c in r.samples}
    at_place = [(rec.placement[i], t, _step_of(i)) for i, t in true.items() if i in rec.placement]
    after = [(g, rem, t, _step_of(i)) for i, t in true.items() if i in rec.after_first
             for g, rem in [rec.after_first[i]]]
    return {
        "workload": workload_name, "engines": engines, "policy": policy, "steps": len(workload.steps),
        "samples": len(true),
        "placement": {
            "n": len(at_place),
            "rho_total": _rho([(p, t) for p, t, _ in at_place]),
            "rho_total_after_first_step": _rho([(p, t) for p, t, s in at_place if s > 0]),
        },
        "after_first_sibling": {
            "n": len(after),
            "rho_total": _rho([(g + rem, t) for g, rem, t, _ in after]),
            "rho_remaining": _rho([(rem, t - g) for g, rem, t, _ in after]),
        },
    }


def markdown(rows: list[dict]) -> str:
    def f(x):
        return "-" if x is None else f"{x:.2f}"

    out = ["| workload | engines | samples | at placement: rho (all steps) | at placement: rho (steps 2+) "
           "| after the first sibling: n | rho, total length | rho, remaining length |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        p, a = r["placement"], r["after_first_sibling"]
        out.append(f"| {r['workload']} | {r['engines']} | {r['samples']} | {f(p['rho_total'])} | "
                   f"{f(p['rho_total_after_first_step'])} | {a['n']} | {f(a['rho_total'])} | {f(a['rho_remaining'])} |")
    return "\n".join(out)


def main(args) -> int:
    from research.__main__ import split_workloads

    rows = []
    for name in split_workloads(args.workload):
        for n in (int(x) for x in str(args.engines).split(",") if x.strip()):
            rows.append(measure(name, n, args.policy, args.kv_tokens, args.max_seqs, args.seed, args.steps,
                                args.groups_per_step, args.length_scale))
            print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    print(markdown(rows))
    save_json(args.report, "predictor.json", rows)
    return 0
