"""One figure: how close to the lower bound the length-aware policies come
as a function of what they know about response lengths.

    python -m research.information_plot --horizon reports/horizon \
        --noisy reports/noisy-kv196k --out docs/figures/length_information.png

Left: math and video at 8 engines, lengths revealed after N generated tokens
(`length-oracle-after-N`), never (the service's predictor) or at placement.
Right: code at 8 engines, lengths known at placement up to a log-normal
factor (`length-noisy-S`), spreading against packing.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from research.oracle import NOISE, REVEAL_AFTER

# Rank correlation with the true length on the code trace for each S (research/oracle.py),
# and the service's predictor's at placement (`python -m research predictor`, all steps).
NOISE_RHO = {0.25: 0.90, 0.5: 0.79, 1.0: 0.57}
PREDICTOR_RHO = 0.15


def _ratios(report_dir: Path) -> dict[str, dict[str, float]]:
    """workload -> policy -> ratio to the bound, from every report.json under the folder."""
    out: dict[str, dict[str, float]] = {}
    for path in sorted(report_dir.rglob("report.json")):
        report = json.loads(path.read_text())
        name = report["workload"]["name"]
        out.setdefault(name, {}).update({p: r["ratio_to_bound"] for p, r in report["results"].items()})
    return out


def plot(horizon: Path, noisy: Path, out: Path) -> dict[str, int]:
    """Write the figure to `out`; returns how many lines each panel got."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    drawn = {"left": 0, "right": 0}
    labels = ["never", *[f"after {n}" for n in sorted(REVEAL_AFTER, reverse=True)], "at placement"]
    for workload, ratios in sorted(_ratios(horizon).items()):
        for suffix, style in (("", "-o"), ("+isolate", "--s")):
            policies = [f"length-aware+rebalance{suffix}",
                        *[f"length-oracle-after-{n}+rebalance{suffix}" for n in sorted(REVEAL_AFTER, reverse=True)],
                        f"length-oracle+rebalance{suffix}"]
            pts = [(x, ratios[p]) for x, p in zip(labels, policies) if p in ratios]
            if len(pts) > 1:
                left.plot(*zip(*pts), style, label=f"{workload}{' + isolate' if suffix else ''}")
                drawn["left"] += 1
    left.axhline(1.10, color="grey", lw=0.8, ls=":")
    left.set(title="lengths revealed after N generated tokens (8 engines)", ylabel="makespan / lower bound")
    left.legend()

    code = _ratios(noisy).get("code", {})
    xs = [PREDICTOR_RHO, *sorted(NOISE_RHO.values()), 1.0]
    for name, packed in (("spread (LPT)", ""), ("packed", "-packed")):
        keys = ["length-aware+rebalance" if not packed else "length-packed+rebalance",
                *[f"length-noisy-{s}{packed}+rebalance" for s in sorted(NOISE, reverse=True)],
                f"length-oracle{packed}+rebalance"]
        pts = [(x, code[k]) for x, k in zip(xs, keys) if k in code]
        if len(pts) > 1:
            right.plot(*zip(*pts), "-o", label=name)
            drawn["right"] += 1
    right.axhline(1.10, color="grey", lw=0.8, ls=":")
    right.annotate("the service's\npredictor", (PREDICTOR_RHO, 1.2), textcoords="offset points", xytext=(8, 20))
    right.set(title="code, 8 engines, 192K KV: lengths known at placement",
              xlabel="rank correlation with the true lengths (1: exact)", ylabel="makespan / lower bound")
    right.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return drawn


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--horizon", type=Path, default=Path("reports/horizon"))
    ap.add_argument("--noisy", type=Path, default=Path("reports/noisy-kv196k"))
    ap.add_argument("--out", type=Path, default=Path("docs/figures/length_information.png"))
    args = ap.parse_args(argv)
    drawn = plot(args.horizon, args.noisy, args.out)
    if not any(drawn.values()):
        raise SystemExit(f"no policies of the expected names in {args.horizon} or {args.noisy}: run the commands "
                         "in this module's docstring first")
    print(f"{args.out} ({drawn['left']} lines left, {drawn['right']} right)")


if __name__ == "__main__":
    main()
