"""Reports: `report.json`, PNG plots and a printed table.

    DIR/report.json      config, workload statistics, per-policy summary and steps
    DIR/makespan.png     mean step makespan of each policy against the lower bound
    DIR/lengths_cdf.png  response-length CDF of the workload (all steps and each step)
    DIR/timeline_<policy>.png  running sequences per engine over time (white: idle)

The schema is documented in docs/benchmarking.md#the-report.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from research.runner import RunResult, base_policy
from rollout_service.bench.workloads import Workload

SCHEMA_VERSION = 1


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def save_json(report_dir: str | Path | None, name: str, data, plot=None) -> Path | None:
    """Write `data` as DIR/name (indented JSON) when a report directory was
    asked for, and `plot(data, png)` beside it (the same name, .png) when
    given; says where."""
    if not report_dir:
        return None
    path = Path(report_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=float))
    if plot is not None:
        plot(data, path.with_suffix(".png"))
    print(f"report: {path}")
    return path


def write_json(out: Path, config: dict, workload: Workload, results: list[RunResult]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "schema_version": SCHEMA_VERSION,
        "config": config,
        "workload": workload.describe(),
        "results": {r.policy: {**r.summary, "per_step": r.steps} for r in results},
    }
    if any(base_policy(r.policy) != r.policy for r in results):
        doc["pooled"] = pooled([r.summary for r in results])
    path = out / "report.json"
    path.write_text(json.dumps(doc, indent=2, default=float))
    return path


def measured_dir(out: Path, policy: str) -> Path:
    """Where a real-time run keeps what `policy`'s engines generated."""
    return out / "measured" / policy.replace("+", "_")


def write_measured(out: Path, results: list[RunResult]) -> Path:
    """For runs in real time: what each policy's engines generated, as
    PolyTrace-format traces (`DIR/measured/<policy>/packed_lengths_step_K.jsonl`)
    that `python -m research predict` replays on simulated engines."""
    for r in results:
        d = measured_dir(out, r.policy)
        d.mkdir(parents=True, exist_ok=True)
        for old in d.glob("packed_lengths_step_*.jsonl"):
            old.unlink()
        for step, groups in r.measured_steps().items():
            lines = [json.dumps({"step": step, "input": prompt, "output": lengths, "n_sampling": len(lengths)})
                     for prompt, lengths in groups]
            (d / f"packed_lengths_step_{step}.jsonl").write_text("\n".join(lines) + "\n")
    return out / "measured"


def _pass_of(name: str) -> str:
    """`#2` for `partial#2`; empty for a one-pass run's `partial`."""
    return name[len(base_policy(name)):]


def table(results: list[RunResult]) -> str:
    """A fixed-width table of the headline figures."""
    width = max([22] + [len(r.policy) for r in results])
    head = (f"{'policy':<{width}} {'makespan s':>11} {'bound s':>9} {'x bound':>8} {'tokens/s':>10} "
            f"{'groups/s':>9} {'slots':>6} {'busy':>6} {'p99 lat s':>10} {'delivered':>10} {'wall s':>7}")
    if results and results[0].summary.get("multi_turn"):
        return multi_turn_table(results)
    # The whole RL step (samples, the trainer stand-in, the push) and the
    # groups per second a trainer's loop gets, against the first policy.
    loop = results and all("max_trained_lag" in r.summary for r in results)
    if loop:
        head += f" {'step s':>7} {'loop groups/s':>13} {'x first':>8} {'lag<=':>6} {'stale masked':>13}"
    lines = [head, "-" * len(head)]
    # In a two-pass run, each pass against the first policy's run in the same pass.
    reference: dict[str, float] = {}
    for r in results:
        if base_policy(r.policy) == base_policy(results[0].policy):
            reference.setdefault(_pass_of(r.policy), r.summary.get("groups_per_s_with_trainer", 0.0))
    for r in results:
        s = r.summary
        ratio = f"{s['ratio_to_bound']:.2f}" if s["ratio_to_bound"] else "-"
        delivered = s.get("samples_delivered_with_drain", s["samples_delivered"])
        line = (
            f"{r.policy:<{width}} {s['makespan_s']:>11.2f} {s['lower_bound_s']:>9.2f} {ratio:>8} "
            f"{s['tokens_per_s']:>10.0f} {s['groups_per_s']:>9.2f} {s['slot_utilisation']:>6.3f} "
            f"{s['busy_fraction']:>6.3f} {s['latency_p99_s']:>10.2f} "
            f"{delivered:>5}/{s['samples_submitted']:<4} {s['wall_s']:>7.1f}"
        )
        if loop:
            g = s["groups_per_s_with_trainer"]
            first = reference.get(_pass_of(r.policy), 0.0)
            line += (f" {s['step_time_s']:>7.2f} {g:>13.3f} {g / first if first else 0:>7.2f}x "
                     f"{s['max_trained_lag']:>6} {s['tokens_masked_stale']:>13}")
        lines.append(line)
    return "\n".join(lines)


def pool(summaries: list[dict]) -> dict:
    """One policy's figures over the runs it made (the passes of a two-pass
    run), as if its steps had been one run: step means weighted by steps,
    groups per second of the trainer's loop over all its step time."""
    steps = [s["steps"] for s in summaries]
    n = sum(steps)
    cycle = sum(s["step_time_s"] * k for s, k in zip(summaries, steps))
    span = sum(s["makespan_s"] * k for s, k in zip(summaries, steps))
    groups = sum(s["groups_per_s_with_trainer"] * s["step_time_s"] * k for s, k in zip(summaries, steps))
    out = {
        "steps": n,
        "makespan_s": span / n if n else 0.0,
        "step_time_s": cycle / n if n else 0.0,
        "groups_per_s_with_trainer": groups / cycle if cycle else 0.0,
        "makespan_s_per_run": [s["makespan_s"] for s in summaries],
    }
    if all("tokens" in s for s in summaries):
        out["tokens_per_s"] = sum(s["tokens"] for s in summaries) / span if span else 0.0
    if all("samples_submitted" in s for s in summaries):
        out["samples_submitted"] = sum(s["samples_submitted"] for s in summaries)
        out["samples_delivered"] = sum(s.get("samples_delivered_with_drain", s["samples_delivered"]) for s in summaries)
    if all("max_trained_lag" in s for s in summaries):
        out["max_trained_lag"] = max(s["max_trained_lag"] for s in summaries)
        out["tokens_masked_stale"] = sum(s["tokens_masked_stale"] for s in summaries)
    return out


def pooled(summaries: list[dict]) -> dict[str, dict]:
    """Per policy (in the order first run), its results pooled: `pool` over
    `POLICY#1`, `POLICY#2`."""
    runs: dict[str, list[dict]] = {}
    for s in summaries:
        runs.setdefault(base_policy(s["policy"]), []).append(s)
    return {name: pool(ss) for name, ss in runs.items()}


def pooled_table(rows: dict[str, dict]) -> str:
    """The policies' pooled figures, each against the first policy's."""
    width = max([20] + [len(name) for name in rows])
    head = (f"{'policy (both passes)':<{width}} {'makespan s':>11} {'per pass':>16} {'step s':>7} "
            f"{'loop groups/s':>13} {'x first':>8} {'delivered':>11} {'lag<=':>6}")
    lines = [head, "-" * len(head)]
    first = next(iter(rows.values()))["groups_per_s_with_trainer"] if rows else 0.0
    for name, r in rows.items():
        g = r["groups_per_s_with_trainer"]
        per = " / ".join(f"{x:.2f}" for x in r["makespan_s_per_run"])
        delivered = f"{r.get('samples_delivered', 0)}/{r.get('samples_submitted', 0)}"
        lines.append(f"{name:<{width}} {r['makespan_s']:>11.2f} {per:>16} {r['step_time_s']:>7.2f} {g:>13.3f} "
                     f"{g / first if first else 0:>7.2f}x {delivered:>11} {r.get('max_trained_lag', '-'):>6}")
    return "\n".join(lines)


def multi_turn_table(results: list[RunResult]) -> str:
    """The multi-turn figures (research/multiturn.py), one row per policy;
    the speedup is each policy's step makespan against the first policy's."""
    head = (f"{'policy':<34} {'makespan s':>11} {'speedup':>8} {'bound s':>8} {'x bound':>8} {'cache hit':>10} "
            f"{'idle/tools':>11} {'trained tok/s':>14} {'moves':>6} {'delivered':>11}")
    lines = [head, "-" * len(head)]
    base = results[0].summary["makespan_s"] if results else 0.0
    for r in results:
        s = r.summary
        ratio = f"{s['ratio_to_bound']:.2f}" if s.get("ratio_to_bound") else "-"
        delivered = s.get("samples_delivered_with_drain", s["samples_delivered"])
        lines.append(
            f"{r.policy:<34} {s['makespan_s']:>11.2f} {base / s['makespan_s'] if s['makespan_s'] else 0:>7.2f}x "
            f"{s['lower_bound_s']:>8.2f} {ratio:>8} {s['prefix_cache_hit_rate']:>10.3f} "
            f"{s['engine_idle_while_tools']:>11.3f} {s['trained_tokens_per_s']:>14.0f} "
            f"{s.get('trajectory_moves', 0):>6} {delivered:>5}/{s['samples_submitted']:<5}")
    return "\n".join(lines)


def plot(out: Path, workload: Workload, results: list[RunResult], title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []

    # Makespan of each policy against the lower bound.
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(results), 4))
    names = [r.policy for r in results]
    spans = [r.summary["makespan_s"] for r in results]
    bounds = [r.summary["lower_bound_s"] for r in results]
    x = np.arange(len(results))
    ax.bar(x, spans, color="tab:blue", label="mean step makespan")
    ax.hlines(bounds, x - 0.4, x + 0.4, colors="black", linestyles="--", label="lower bound")
    for i, (s, b) in enumerate(zip(spans, bounds)):
        if b > 0:
            ax.text(i, s, f"x{s / b:.2f}", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(x, names, rotation=15)
    ax.set_ylabel("seconds per step")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "makespan.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    # Length CDF of the workload.
    fig, ax = plt.subplots(figsize=(6, 4))
    for step in workload.steps:
        L = np.sort([x for g in step for x in g.output_lens])
        ax.plot(L, np.arange(1, len(L) + 1) / len(L), color="tab:gray", alpha=0.35, lw=0.8)
    L = np.sort(workload.output_lengths())
    ax.plot(L, np.arange(1, len(L) + 1) / len(L), color="tab:red", lw=2, label="all steps")
    ax.set_xscale("log")
    ax.set_xlabel(f"response length (tokens, length scale {workload.length_scale:g})")
    ax.set_ylabel("fraction of samples")
    ax.set_title(f"{workload.name}: response lengths (grey: each step)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "lengths_cdf.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    # Per-engine timelines.
    for r in results:
        t = np.array(r.timeline["times"])
        running = np.array(r.timeline["running"], dtype=float)
        if len(t) < 2 or running.size == 0:
            continue
        keep = t >= 0
        t, running = t[keep], running[keep]
        n = running.shape[1]
        fig, ax = plt.subplots(figsize=(9, 1.5 + min(8, 0.12 * n)))
        grid = np.where(running.T > 0, running.T / r.timeline["max_seqs"], np.nan)
        mesh = ax.pcolormesh(np.append(t, t[-1] + (t[-1] - t[-2])), np.arange(n + 1), grid,
                             cmap="viridis", vmin=0, vmax=1, shading="flat")
        for s in r.timeline["step_starts"]:
            ax.axvline(s, color="red", lw=0.6, alpha=0.6)
        ax.set_xlabel("seconds (red: step starts)")
        ax.set_ylabel("engine")
        busy = r.summary["busy_fraction"]
        ax.set_title(f"{title} | {r.policy}: running / max_seqs per engine (white: idle); "
                     f"busy {busy:.2f}, slots {r.summary['slot_utilisation']:.2f}", fontsize=9)
        fig.colorbar(mesh, ax=ax, pad=0.01)
        fig.tight_layout()
        paths.append(out / f"timeline_{_safe(r.policy)}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def markdown_table(root: Path) -> str:
    """One row per (report, policy) under `root`: workload, engines, policy,
    makespan, bound, ratio, slot utilisation, busy fraction, tokens/s."""
    rows = ["| workload | engines | policy | step makespan s | lower bound s | x bound | slot util. | busy | tokens/s |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    entries = []
    for path in Path(root).rglob("report.json"):
        doc = json.loads(path.read_text())
        cfg = doc["config"]
        for i, (policy, r) in enumerate(doc["results"].items()):
            entries.append(((cfg["workload"], cfg["engines"], cfg.get("groups_per_step", 0), i), cfg, policy, r))
    for _, cfg, policy, r in sorted(entries, key=lambda e: e[0]):
        ratio = f"{r['ratio_to_bound']:.2f}" if r.get("ratio_to_bound") else "-"
        rows.append(f"| {cfg['workload']} | {cfg['engines']} | {policy} | {r['makespan_s']:.2f} | "
                    f"{r['lower_bound_s']:.2f} | {ratio} | {r['slot_utilisation']:.3f} | "
                    f"{r['busy_fraction']:.3f} | {r['tokens_per_s']:.0f} |")
    return "\n".join(rows)


def markdown_speedup_table(root: Path, baseline: str = "static") -> str:
    """One row per report under `root` (workload, engines, KV budget): the
    lower bound, then for every policy its makespan speedup over `baseline`
    and its ratio to the bound ("1.12x / 1.05")."""
    docs = []
    for path in Path(root).rglob("report.json"):
        doc = json.loads(path.read_text())
        cfg = doc["config"]
        docs.append(((cfg["workload"], cfg["engines"], -cfg.get("kv_tokens", 0)), doc))
    policies: list[str] = []
    for _, doc in sorted(docs, key=lambda d: d[0]):
        policies += [p for p in doc["results"] if p not in policies]
    rows = ["| workload | engines | KV tokens | lower bound s | " + " | ".join(policies) + " |",
            "|---|---:|---:|---:|" + "---:|" * len(policies)]
    for (workload, engines, kv), doc in sorted(docs, key=lambda d: d[0]):
        res = doc["results"]
        base = res.get(baseline, {}).get("makespan_s")
        cells = []
        for p in policies:
            r = res.get(p)
            if r is None:
                cells.append("")
                continue
            ratio = f"{r['ratio_to_bound']:.2f}" if r.get("ratio_to_bound") else "-"
            speed = f"{base / r['makespan_s']:.2f}x" if base and r["makespan_s"] else "-"
            cells.append(f"{speed} / {ratio}")
        bound = next(iter(res.values()))["lower_bound_s"]
        rows.append(f"| {workload} | {engines} | {-kv} | {bound:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(rows)
