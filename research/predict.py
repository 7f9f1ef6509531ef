"""Predicted vs measured: a run on real engines replayed on simulated ones.

    python -m research run --engine vllm --clock real ... --report reports/measured
    python -m research predict reports/measured --cost-model fit.json

A `run` in real time (real engines, or simulated ones on the real clock)
writes, next to its report, what each policy's
engines generated (`measured/<policy>/packed_lengths_step_*.jsonl`: every
group's prompt length and response lengths). `predict` replays each
policy's own trace in virtual time on simulated engines with the
calibrated cost model (`research.calibrate`), the same fleet, batch cap,
over-provisioning, lag bound and trainer stand-in, and the weight push the
measured run took per step (the calibration does not model pushes), then
prints per policy the measured and predicted step makespan, RL step time
and complete groups per second, with the error of each prediction.

    python -m research predict reports/measured --cost-model fit.json --what-if partial,rebalance+partial+spec

replays every measured trace under each named policy instead (`what_if`):
what they would have made of the lengths the engines sampled, the noise of
each run's own sampling taken out of the comparison.

What the simulator cannot know is said in the table's notes: it replays the
measured lengths (it does not sample them), and its speculation model is
its own (`SimParams` acceptance profile), not the measured drafter's.

A verified draft token is priced as what the calibration measured one more
token of a decode batch to cost (`spec_verify_cost` 1.0: one more sequence,
`decode_per_seq_s`), unless the cost model or `--sim` says otherwise; the
simulated engine's own default (0, free verification) is a GPU's
idealisation, which on a CPU makes speculation look faster than it is.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from research import speed_reference
from research.policies import parse_policy
from research.report import measured_dir, pooled
from research.runner import RunConfig, base_policy, run_policy
from rollout_service.bench.workloads import polytrace

# A verified draft token costs one more sequence of the calibrated batch.
VERIFY_COST = {"spec_verify_cost": 1.0}
FIGURES = [("makespan_s", "makespan s"), ("step_time_s", "RL step s"), ("groups_per_s_with_trainer", "loop groups/s")]
# A replay of partial rollout or rebalancing is sensitive: on 6 steps of
# the tail target a 1% change in every engine cost moved a policy's
# predicted makespan by more than 20%, as a group completes just before or
# just after a step's end and the steps after it follow. So each policy is
# replayed at costs spread over +-JITTER (the speed reference's repeatability
# between consecutive readings, about 3%) and its prediction is their mean;
# the rows give the spread.
ENSEMBLE = 7
JITTER = 0.03


def cost_factors(ensemble: int, jitter: float) -> list[float]:
    """The ensemble's cost multipliers: `ensemble` evenly over 1 +- jitter."""
    if ensemble < 1:
        raise ValueError(f"ensemble must be >= 1, got {ensemble}")
    if not 0 <= jitter < 1:
        raise ValueError(f"jitter must be in [0, 1), got {jitter}")
    return [1.0] if ensemble == 1 else [float(f) for f in np.linspace(1 - jitter, 1 + jitter, ensemble)]


def predict(report_dir: Path, sim: dict, progress: bool = False, reference: dict | None = None,
            ensemble: int = ENSEMBLE, jitter: float = JITTER) -> list[dict]:
    """One row per policy of the measured run: its figures, measured and
    predicted. A two-pass run (`run --passes 2`) has a row per pass
    (`POLICY#1`, `POLICY#2`, each replayed on a fresh simulated fleet as it
    ran) and then one per policy, both passes pooled on each side.

    `reference`: the calibration's host speed reference. Where the run
    timed one too (every run on vLLM CPU engines does), each policy's
    engine costs are scaled by how much slower the host ran it than the
    calibration (`speed_scale` in its row).

    Each policy is replayed `ensemble` times at engine costs spread over
    +-`jitter` (`cost_factors`); its predicted figures are the replays'
    means, and `spread` in each figure gives their least and greatest."""
    factors = cost_factors(ensemble, jitter)
    sim = {**VERIFY_COST, **sim}
    doc = _real_time_run(report_dir)
    cfg = doc["config"]
    rows = []
    summaries: dict[str, list[dict]] = {"measured": [], "predicted": []}
    for policy in cfg["policies"]:
        measured = doc["results"][policy]
        factor, members = _replays(report_dir, cfg, policy, measured, sim, reference, factors, progress=progress)
        predicted = _mean_summary([m.summary for m in members])
        summaries["measured"].append({**measured, "policy": policy})
        summaries["predicted"].append({**predicted, "policy": policy})
        row = {"policy": policy, "weight_push_s": float(measured.get("weight_sync_s", 0.0)), "speed_scale": factor,
               **_figures(measured, predicted, [m.summary for m in members])}
        row["step_makespans_s"] = {"measured": [float(s["makespan_s"]) for s in measured.get("per_step", [])],
                                   "predicted": [float(np.mean([m.steps[i]["makespan_s"] for m in members]))
                                                 for i in range(len(members[0].steps))]}
        rows.append(row)
    if any(base_policy(p) != p for p in cfg["policies"]):
        sides = {side: pooled(ss) for side, ss in summaries.items()}
        for policy, measured in sides["measured"].items():
            rows.append({"policy": policy, "pooled": True, **_figures(measured, sides["predicted"][policy])})
    return rows


def _real_time_run(report_dir: Path) -> dict:
    """A run's report.json; refused unless it ran in real time."""
    doc = json.loads((report_dir / "report.json").read_text())
    if doc["config"].get("clock") != "real":
        raise ValueError(f"{report_dir}: a run in virtual time; predict replays runs in real time (real engines)")
    return doc


def _replays(report_dir: Path, cfg: dict, policy: str, measured: dict, sim: dict, reference: dict | None,
             factors: list[float], replay_as: str | None = None, spec: dict | None = None, progress: bool = False):
    """The measured trace of `policy` (a run's policy, `POLICY#PASS` in a
    two-pass run) replayed on the run's simulated fleet once per cost
    factor, under that policy or `replay_as`, with the run's `--spec` (and
    `spec` over it). Returns the host speed factor and the replays."""
    trace = measured_dir(report_dir, policy)
    if not trace.is_dir():
        raise FileNotFoundError(f"{trace}: no measured trace (written by `run --clock real --report DIR`)")
    workload = polytrace.load_trace(trace, name=f"measured {policy}", cap=cfg.get("max_tokens"))
    push_s = float(measured.get("weight_sync_s", 0.0))
    factor = speed_reference.scale(measured.get("speed_reference"), reference)
    members = []
    for f in factors:
        run = RunConfig(workload, engines=cfg["engines"], clock="virtual", engine_kind="sim",
                        max_seqs=cfg["max_seqs"], kv_tokens=cfg["kv_tokens"],
                        sim={**speed_reference.scaled(sim, (factor or 1.0) * f), "weight_update_s": push_s},
                        seed=cfg["seed"], need_groups=cfg.get("need_groups"), progress=progress,
                        over_provision=cfg.get("over_provision", 2.0),
                        max_version_lag=cfg.get("max_version_lag", 1), train_s=cfg.get("train_s", 0.0),
                        spec={**(cfg.get("spec") or {}), **(spec or {})})  # the run's `--spec`
        members.append(run_policy(run, parse_policy(replay_as or base_policy(policy))))
    return factor, members


def what_if(report_dir: Path, sim: dict, policies: list[str], spec: dict | None = None,
            reference: dict | None = None, ensemble: int = ENSEMBLE, jitter: float = JITTER,
            progress: bool = False) -> dict:
    """Every measured trace of a run replayed under each of `policies`: what
    those policies would have made of the lengths the engines sampled. Each
    policy's rows give its loop groups/s and mean step makespan per trace
    (the mean of `ensemble` replays, at each run's host speed as `predict`
    replays it) and their mean over the traces. `spec` overrides the run's
    `--spec` for the policies that speculate."""
    factors = cost_factors(ensemble, jitter)
    sim = {**VERIFY_COST, **sim}
    doc = _real_time_run(report_dir)
    cfg = doc["config"]
    if not policies:
        raise ValueError("--what-if: name at least one policy")
    for p in policies:
        try:
            parse_policy(p)  # refused before any replay
        except ValueError as e:
            raise ValueError(f"--what-if: {e}") from None
    traces = list(cfg["policies"])
    rows, speed = [], {}
    for p in policies:
        per_trace = {}
        for t in traces:
            speed[t], members = _replays(report_dir, cfg, t, doc["results"][t], sim, reference, factors,
                                         replay_as=p, spec=spec, progress=progress)
            mean = _mean_summary([m.summary for m in members])
            per_trace[t] = {key: mean[key] for key, _ in FIGURES}
        rows.append({"policy": p, "traces": per_trace,
                     "mean": {key: float(np.mean([v[key] for v in per_trace.values()])) for key, _ in FIGURES}})
    return {"traces": traces, "rows": rows, "speed_scale": speed,
            "measured": {t: {key: float(doc["results"][t].get(key, 0.0)) for key, _ in FIGURES} for t in traces}}


def what_if_markdown(result: dict) -> str:
    """Loop groups/s per trace and policy, the measured figure of each trace
    in the first row, and each policy's mean over the traces against the
    first policy's."""
    traces, rows = result["traces"], result["rows"]
    key = "groups_per_s_with_trainer"
    head = "| policy | " + " | ".join(traces) + " | mean | x " + rows[0]["policy"] + " |"
    lines = [head, "|---|" + "---:|" * (len(traces) + 2),
             "| measured (the policy that ran) | " + " | ".join(f"{result['measured'][t][key]:.4f}" for t in traces)
             + " | - | - |"]
    if any(v is not None for v in result["speed_scale"].values()):
        lines.append("| host speed x | " + " | ".join(f"{result['speed_scale'][t]:.2f}" if result["speed_scale"][t]
                                                       is not None else "-" for t in traces) + " | - | - |")
    first = rows[0]["mean"][key]
    for r in rows:
        ratio = f"{r['mean'][key] / first:.2f}" if first else "-"
        lines.append(f"| {r['policy']} | " + " | ".join(f"{r['traces'][t][key]:.4f}" for t in traces)
                     + f" | {r['mean'][key]:.4f} | {ratio} |")
    return "\n".join(lines)


def what_if_plot(result: dict, out: Path, title: str = "") -> Path:
    """Loop groups/s of each what-if policy on each measured trace (bars),
    with what the trace's own run measured (a black tick), and the means."""
    plt = _pyplot()
    traces, rows = result["traces"], result["rows"]
    key = "groups_per_s_with_trainer"
    labels = traces + ["mean"]
    x = np.arange(len(labels))
    width = 0.8 / len(rows)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.5 * len(labels)), 3.8))
    for i, r in enumerate(rows):
        values = [r["traces"][t][key] for t in traces] + [r["mean"][key]]
        ax.bar(x - 0.4 + width * (i + 0.5), values, width, label=r["policy"])
    ax.plot(x[:-1], [result["measured"][t][key] for t in traces], "k_", markersize=22, mew=2,
            label="measured (the policy that ran)")
    ax.set_xticks(x)
    ax.set_xticklabels([t.replace("+", "+\n") for t in traces] + ["mean"], fontsize=7)
    ax.set_ylabel("loop groups/s")
    ax.set_xlabel("measured trace (the policy and pass that sampled its lengths)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if title:
        ax.set_title(title, fontsize=9)
    return _saved(plt, fig, out)


def _pyplot():
    """matplotlib's pyplot on the file-only backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _saved(plt, fig, out: Path) -> Path:
    """`fig` laid out and written to `out` (its folder made), then closed."""
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _mean_summary(summaries: list[dict]) -> dict:
    """The ensemble's prediction: its replays' figures averaged (what
    pooling passes reads: steps and the FIGURES)."""
    out = {"steps": summaries[0]["steps"]}
    for key, _ in FIGURES:
        out[key] = float(np.mean([float(s.get(key, 0.0)) for s in summaries]))
    return out


def _figures(measured: dict, predicted: dict, members: list[dict] | None = None) -> dict:
    """Each of FIGURES, measured beside predicted, with the prediction's
    error (and, given the ensemble's replays, their least and greatest)."""
    out = {}
    for key, _ in FIGURES:
        m, p = float(measured.get(key, 0.0)), float(predicted.get(key, 0.0))
        out[key] = {"measured": m, "predicted": p, "error": (p / m - 1.0) if m else None}
        if members and len(members) > 1:
            values = [float(s.get(key, 0.0)) for s in members]
            out[key]["spread"] = [min(values), max(values)]
    return out


def plot(rows: list[dict], out: Path, title: str = "") -> Path:
    """Each policy's step makespans, measured beside predicted, one panel a policy."""
    plt = _pyplot()
    rows = [r for r in rows if "step_makespans_s" in r]  # pooled rows have no steps of their own
    fig, axes = plt.subplots(1, len(rows), figsize=(4.2 * len(rows), 3.4), sharey=True, squeeze=False)
    for ax, r in zip(axes[0], rows):
        steps = r["step_makespans_s"]
        n = max(len(steps["measured"]), len(steps["predicted"]))
        x = np.arange(1, n + 1)
        ax.bar(x - 0.2, steps["measured"] + [0.0] * (n - len(steps["measured"])), 0.4, label="measured")
        ax.bar(x + 0.2, steps["predicted"] + [0.0] * (n - len(steps["predicted"])), 0.4, label="predicted")
        err = r["makespan_s"]["error"]
        ax.set_title(f"{r['policy']}\nmean makespan {err:+.0%}" if err is not None else r["policy"], fontsize=9)
        ax.set_xlabel("step")
        ax.set_xticks(x)
    axes[0][0].set_ylabel("step makespan, s")
    axes[0][0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    return _saved(plt, fig, out)


def markdown(rows: list[dict]) -> str:
    """The rows as a table; a `host speed x` column where any prediction
    was scaled to the host's speed during its run, and the range of the
    ensemble's makespan errors where it had more than one replay."""
    speed = any(r.get("speed_scale") is not None for r in rows)
    spread = any("spread" in r["makespan_s"] for r in rows)
    head = ("| policy | " + ("host speed x | " if speed else "")
            + " | ".join(f"{label}: measured | predicted | error" for _, label in FIGURES)
            + (" | makespan error, replays' range" if spread else "") + " |")
    lines = [head, "|---|" + ("---:|" if speed else "") + "---:|---:|---:|" * len(FIGURES) + ("---:|" if spread else "")]
    for r in rows:
        cells = []
        if speed:
            cells.append(f"{r['speed_scale']:.2f}" if r.get("speed_scale") is not None else "-")
        for key, _ in FIGURES:
            f = r[key]
            err = f"{f['error']:+.1%}" if f["error"] is not None else "-"
            cells += [f"{f['measured']:.3f}", f"{f['predicted']:.3f}", err]
        if spread:
            f = r["makespan_s"]
            cells.append(" to ".join(f"{x / f['measured'] - 1:+.0%}" for x in f["spread"])
                         if "spread" in f and f["measured"] else "-")
        name = f"{r['policy']} (passes pooled)" if r.get("pooled") else r["policy"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def speed_note(rows: list[dict], calibration: str, reference: dict | None, off: bool) -> str:
    """One line on the host speed the predictions were made at."""
    if off:
        return "host speed: the calibration's (--no-speed-scale)"
    if reference is None:
        return (f"host speed: the calibration's ({calibration} has no speed reference: calibrate again to record "
                "one, and predictions follow the host's speed during each run)")
    if not any(r.get("speed_scale") is not None for r in rows):
        return ("host speed: the calibration's (the run timed no speed reference: runs on vLLM CPU engines "
                "record one)")
    return (f"host speed: each run's, against the calibration's reference ({reference['ms']:.1f} ms); "
            "host speed x = how much slower the host ran it")
