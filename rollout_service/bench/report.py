"""A bench run's report: `report.json`, `report.md`, `bench.png`, and
`compare` of two reports side by side.

Throughputs are over the generation time: the sum of the steps' makespans
(closed loop: from a step's submission to its last needed group; open loop:
from the first arrival to the last sample), so a trainer stand-in's
`--train-s` and the weight pushes do not dilute them; `step_time_s` and
`groups_per_s_with_trainer` are the whole RL step's.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from rollout_service.bench.driver import Completion, StepRecord

SCHEMA = "rollout-service-bench/1"


def percentiles(values) -> dict | None:
    """p50, p90, p99 and the mean (seconds), or None without values."""
    x = np.asarray(values, dtype=float)
    if not x.size:
        return None
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(x.mean())}


def _is_error(c: Completion) -> bool:
    return c.finish_reason.startswith("error:")


def summarise(records: list[StepRecord], target, expected: dict[tuple[str, int], int] | None,
              duplicates: int = 0) -> dict:
    """Run-level figures from the step records (module docstring).
    `expected`: the target length of each (group, index), when the run asked
    for the trace's lengths."""
    samples = [c for r in records for c in r.samples]
    good = [c for c in samples if not _is_error(c)]
    errors: dict[str, int] = {}
    finish: dict[str, int] = {}
    for c in samples:
        if _is_error(c):
            errors[c.finish_reason[6:]] = errors.get(c.finish_reason[6:], 0) + 1
        else:
            finish[c.finish_reason] = finish.get(c.finish_reason, 0) + 1
    gen_s = float(sum(r.makespan_s for r in records))
    cycle_s = float(sum(r.cycle_s for r in records))
    tokens = sum(c.response_len for c in good)
    groups_ok = len({c.group_id for c in good} - {c.group_id for c in samples if _is_error(c)})
    groups_submitted = sum(len(r.group_submitted_at) for r in records)
    per_step = [{"step": r.step, "makespan_s": r.makespan_s, "samples_submitted": r.samples_submitted,
                 "samples_delivered": sum(1 for c in r.samples if not _is_error(c)),
                 "tokens": sum(c.response_len for c in r.samples if not _is_error(c)),
                 "train_s": max(0.0, r.trained_at - r.done_at), "weight_push_s": max(0.0, r.weights_at - r.trained_at)}
                for r in records]
    if target.streams_tokens:
        ttft, itl = list(target.ttft_s), list(target.itl_s)
        timing = "measured by the bench from the server-sent events (inter-token: gaps between streamed chunks)"
    else:
        ttft = [c.first_token_at - c.queued_at for c in good if c.first_token_at > 0]
        itl = [(c.finished_at - c.first_token_at) / (c.response_len - 1) for c in good
               if c.response_len > 1 and c.first_token_at > 0 and not c.turns]
        timing = "the service's per-sample timestamps (inter-token: each sample's mean; trajectories left out)"
    matched = None
    if expected:
        # A trajectory's target is its generated tokens (its observations are the bench's own).
        hits = [(c.generated_len if c.turns else c.response_len) == expected.get((c.group_id, c.index)) for c in good]
        matched = float(np.mean(hits)) if hits else None
    spans = [r.makespan_s for r in records]
    trajectories = [c for c in good if c.turns]
    token_s, bounds = lower_bounds(records, good)
    for row, bound in zip(per_step, bounds):
        row["lower_bound_s"] = bound
    ratios = [r.makespan_s / b for r, b in zip(records, bounds) if b]
    return {
        "steps": len(records),
        "generation_s": gen_s,
        "groups_submitted": groups_submitted,
        "groups_complete": groups_ok,
        "samples_submitted": sum(r.samples_submitted for r in records),
        "samples_delivered": len(good),
        "samples_failed": len(samples) - len(good),
        "duplicates": duplicates,
        "tokens": tokens,
        "groups_per_s": groups_ok / gen_s if gen_s > 0 else 0.0,
        "samples_per_s": len(good) / gen_s if gen_s > 0 else 0.0,
        "tokens_per_s": tokens / gen_s if gen_s > 0 else 0.0,
        "step_makespan_s": {"mean": float(np.mean(spans)), "max": float(np.max(spans)), "min": float(np.min(spans))}
        if spans else None,
        "fastest_token_s": token_s,
        "makespan_over_bound": {"mean": float(np.mean(ratios)), "max": float(np.max(ratios))} if ratios else None,
        "step_time_s": cycle_s / len(records) if records else 0.0,
        "groups_per_s_with_trainer": groups_ok / cycle_s if cycle_s > 0 else 0.0,
        "latency_s": percentiles([c.finished_at - c.queued_at for c in good]),
        "ttft_s": percentiles(ttft),
        "itl_s": percentiles(itl),
        "timing_source": timing,
        "finish_reasons": finish,
        "errors": errors,
        "error_examples": dict(getattr(target, "error_examples", {})),
        "lengths_matched": matched,
        "trajectories": {"count": len(trajectories), "turns_mean": float(np.mean([c.turns for c in trajectories])),
                         "tool_s_mean": float(np.mean([c.tool_s for c in trajectories])),
                         "generated_tokens": sum(c.generated_len for c in trajectories)} if trajectories else None,
        "per_step": per_step,
    }


def lower_bounds(records: list[StepRecord], good: list[Completion]) -> tuple[float | None, list[float | None]]:
    """The trace's lower bound of each step's makespan: its longest sample
    (of those the step waited for) at the run's fastest per-token time,
    the smallest of the samples' mean inter-token times (single-turn
    samples: a trajectory's time holds its tools'). A sample decodes
    no faster than that, so makespan / bound >= 1; what is above 1 is the
    tail's cost and the queueing (the bound is as tight as the run's
    lightest-loaded sample was fast). Returns (that time, the bounds);
    None where the target gave no first-token times."""
    times = [(c.finished_at - c.first_token_at) / (c.response_len - 1) for c in good
             if c.response_len > 1 and c.first_token_at > 0 and not c.turns]
    token_s = min(times) if times else None
    bounds: list[float | None] = []
    for r in records:
        waited = r.samples[:r.samples_waited] if r.samples_waited >= 0 else []
        longest = max((c.response_len for c in waited if not _is_error(c) and not c.turns), default=0)
        bounds.append((longest - 1) * token_s if token_s and longest > 1 else None)
    return token_s, bounds


def fleet(polls: list[dict], records: list[StepRecord], every_s: float) -> dict:
    """The fleet's utilisation from the service's status polls (`bench
    --status-every-s`): the share of live engines with a request running,
    and the requests running per engine and waiting, averaged over the
    polls inside the steps' generation windows (the trainer stand-in's
    time and the pushes left out): a long tail shows as engines idle while
    a step waits for its last samples."""
    windows = [(r.submitted_at, r.done_at) for r in records]
    gen = [p for p in polls if p["engines"] and any(a <= p["t"] <= b for a, b in windows)]
    return {
        "polls": len(polls),
        "polls_while_generating": len(gen),
        "every_s": every_s,
        "engines": max((p["engines"] for p in polls), default=0),
        "busy_fraction": float(np.mean([p["busy"] / p["engines"] for p in gen])) if gen else None,
        "running_per_engine": float(np.mean([p["running"] / p["engines"] for p in gen])) if gen else None,
        "waiting": float(np.mean([p["waiting"] for p in gen])) if gen else None,
    }


def _p(d: dict | None, key: str, scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    return fmt.format(d[key] * scale) if d else "-"


def markdown(doc: dict) -> str:
    """The report's headline figures as markdown."""
    s, cfg = doc["summary"], doc["config"]
    lines = [f"# rollout-service bench: {cfg['workload']} against {cfg['target']}", "",
             f"{cfg['mode']} loop; {doc['workload']['steps']} steps of {doc['workload']['groups_per_step']} groups; "
             f"lengths: {cfg['lengths']}.", "",
             "| figure | value |", "|---|---:|"]
    rows = [("groups/s", f"{s['groups_per_s']:.2f}"), ("samples/s", f"{s['samples_per_s']:.1f}"),
            ("tokens/s", f"{s['tokens_per_s']:.0f}"),
            ("step makespan s (mean / max)", f"{_p(s['step_makespan_s'], 'mean')} / {_p(s['step_makespan_s'], 'max')}"),
            ("step makespan / the trace's lower bound (mean / max)",
             f"{_p(s.get('makespan_over_bound'), 'mean', fmt='{:.2f}')} / "
             f"{_p(s.get('makespan_over_bound'), 'max', fmt='{:.2f}')}"),
            ("RL step s (with trainer and push)", f"{s['step_time_s']:.3f}")]
    for name, key in (("latency", "latency_s"), ("TTFT", "ttft_s"), ("inter-token", "itl_s")):
        d = s[key]
        rows.append((f"{name} ms p50 / p90 / p99",
                     " / ".join(_p(d, k, 1e3, "{:.1f}") for k in ("p50", "p90", "p99"))))
    rows += [("samples delivered / submitted", f"{s['samples_delivered']} / {s['samples_submitted']}"),
             ("errors by status", ", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "none"),
             ("lengths as asked", "-" if s["lengths_matched"] is None else f"{s['lengths_matched']:.1%}")]
    t = s.get("trajectories")
    if t:
        rows.append(("trajectories: turns / tool wait s (mean)", f"{t['turns_mean']:.2f} / {t['tool_s_mean']:.3f}"))
    f = s.get("fleet")
    if f and f["busy_fraction"] is not None:
        rows.append(("fleet busy while generating",
                     f"{f['busy_fraction']:.0%} of {f['engines']} engines ({f['running_per_engine']:.1f} running per "
                     f"engine, {f['waiting']:.1f} waiting; {f['polls_while_generating']} polls)"))
    lines += [f"| {a} | {b} |" for a, b in rows]
    lines += ["", f"TTFT and inter-token latency: {s['timing_source']}."]
    if s.get("fastest_token_s"):
        lines += ["", f"The trace's lower bound of a step: its longest sample at the run's fastest per-token time "
                      f"({s['fastest_token_s'] * 1e3:.2f} ms)."]
    lines += [f"First error {k}: {v}" for k, v in s["error_examples"].items()] + [""]
    return "\n".join(lines)


def plot(out: Path, doc: dict, latencies: list[float], ttft: list[float] = ()) -> Path:
    """`bench.png`: each step's makespan, the CDFs of per-sample latency
    and time to first token, and (over gRPC) the fleet's busy engines over
    time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = doc["summary"]
    polls = doc.get("fleet_polls") or []
    fig, axes = plt.subplots(1, 3 if polls else 2, figsize=(15 if polls else 10, 3.6))
    a, b = axes[0], axes[1]
    steps = s["per_step"]
    a.bar([p["step"] for p in steps], [p["makespan_s"] for p in steps], color="tab:blue")
    a.set_xticks([p["step"] for p in steps])
    a.set_xlabel("step")
    a.set_ylabel("makespan s")
    a.set_title(f"{s['tokens_per_s']:.0f} tokens/s, {s['samples_per_s']:.1f} samples/s", fontsize=10)
    for values, label, color in ((latencies, "latency", "tab:red"), (ttft, "time to first token", "tab:gray")):
        x = np.sort(np.asarray(values, dtype=float))
        if x.size:
            b.plot(x, np.arange(1, x.size + 1) / x.size, color=color, label=label)
    b.legend(fontsize=8)
    b.set_xlabel("per sample, s")
    b.set_ylabel("fraction of samples")
    b.grid(alpha=0.3)
    if polls:
        c = axes[2]
        t0 = polls[0]["t"]
        c.step([p["t"] - t0 for p in polls], [p["busy"] for p in polls], where="post", color="tab:green",
               label="engines with a request running")
        c.step([p["t"] - t0 for p in polls], [p["engines"] for p in polls], where="post", color="tab:gray",
               linestyle=":", label="live engines")
        c.set_xlabel("s since the first status poll")
        c.set_ylabel("engines")
        c.set_ylim(bottom=0)
        c.legend(fontsize=8)
        c.set_title("the fleet's utilisation", fontsize=10)
    fig.suptitle(f"{doc['config']['workload']} against {doc['config']['target']}", fontsize=10)
    fig.tight_layout()
    path = out / "bench.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(out: Path, doc: dict, latencies: list[float], ttft: list[float] = (), plots: bool = True) -> list[Path]:
    """Write report.json, report.md and (with matplotlib) bench.png into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "report.json", out / "report.md"]
    paths[0].write_text(json.dumps(doc, indent=2, default=float))
    paths[1].write_text(markdown(doc))
    if plots:
        try:
            paths.append(plot(out, doc, latencies, ttft))
        except ImportError:
            pass  # matplotlib is optional: the JSON and markdown carry every figure
    return paths


def load(path: str | Path) -> dict:
    """A bench report from its folder or its report.json."""
    p = Path(path)
    p = p / "report.json" if p.is_dir() else p
    if not p.is_file():
        raise FileNotFoundError(f"no bench report at {path} (a --report folder or its report.json)")
    doc = json.loads(p.read_text())
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{p} is not a rollout-service bench report")
    return doc


COMPARED = [("groups/s", "groups_per_s", None), ("samples/s", "samples_per_s", None),
            ("tokens/s", "tokens_per_s", None), ("step makespan s", "step_makespan_s", "mean"),
            ("makespan / bound", "makespan_over_bound", "mean"),
            ("RL step s", "step_time_s", None), ("latency p50 s", "latency_s", "p50"),
            ("latency p99 s", "latency_s", "p99"), ("TTFT p50 s", "ttft_s", "p50"), ("TTFT p99 s", "ttft_s", "p99"),
            ("inter-token p50 s", "itl_s", "p50"), ("inter-token p99 s", "itl_s", "p99"),
            ("samples delivered", "samples_delivered", None), ("samples submitted", "samples_submitted", None),
            ("samples failed", "samples_failed", None), ("fleet busy", "fleet", "busy_fraction")]


def _num(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, int) or abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.2f}" if abs(x) >= 1 else f"{x:.4f}"


def compare(a: dict, b: dict, names: tuple[str, str] = ("A", "B")) -> str:
    """Two reports' figures side by side, with B / A."""
    def value(doc, key, sub):
        v = doc["summary"].get(key)
        return v.get(sub) if isinstance(v, dict) and sub else (None if isinstance(v, dict) else v)

    head = f"{'':<20} {names[0][-22:]:>22} {names[1][-22:]:>22} {'B / A':>8}"
    lines = [f"A: {a['config']['target']} {a['config']['workload']} ({a['config']['mode']} loop)",
             f"B: {b['config']['target']} {b['config']['workload']} ({b['config']['mode']} loop)", head,
             "-" * len(head)]
    for label, key, sub in COMPARED:
        x, y = value(a, key, sub), value(b, key, sub)
        ratio = f"{y / x:.2f}" if isinstance(x, (int, float)) and isinstance(y, (int, float)) and x else "-"
        lines.append(f"{label:<20} {_num(x):>22} {_num(y):>22} {ratio:>8}")
    return "\n".join(lines)
