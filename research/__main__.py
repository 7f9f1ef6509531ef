"""`python -m research run ...`: replay a workload against a fleet under
one or more policies and write a report.

    python -m research run --workload math --engines 32 \\
        --policy static,least-assigned,sticky-rr --clock virtual --report reports/math-32

`--workload` and `--engines` also take comma-separated lists: every
combination runs and gets its own folder DIR/<workload>-<engines>e/.

    python -m research table DIR            # markdown table of every report under DIR
    python -m research table DIR --speedup-over static   # speedups and ratios, one row per report
    python -m research predictor --workload math,code,video --engines 8
                                              # length predictor's rank correlation on a replay
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from research.report import (markdown_speedup_table, markdown_table, plot, pooled, pooled_table, table,
                               write_json, write_measured)
from research.runner import RunConfig, check_passes, run_passes
from rollout_service.bench.workloads import WORKLOADS, load_workload
from rollout_service.engines.sim import SimParams
from research.policies import parse_policies
from research.predict import ENSEMBLE, JITTER

COST_FIELDS = ("decode_base_s", "decode_per_seq_s", "decode_per_ctx_token_s", "decode_floor_s", "prefill_per_token_s",
               "weight_update_s",
               "spec_draft_cost", "spec_verify_cost", "spec_acceptance")  # the last three: `calibrate --draft`


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m research", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run a workload under one or more policies")
    r.add_argument("--workload", default="math",
                   help=f"{', '.join(WORKLOADS)}, synthetic:k=v,..., or a trace folder/file (comma list: each)")
    r.add_argument("--engines", default="8", help="engines in the fleet (comma list: each)")
    r.add_argument("--policy", default="static,least-assigned,sticky-rr",
                   help="comma-separated policies, each a placement and '+'-joined mechanisms")
    r.add_argument("--clock", choices=["virtual", "real"], default="virtual")
    r.add_argument("--engine", choices=["sim", "vllm"], default="sim", help="engine kind (vllm: real clock)")
    r.add_argument("--model", default="", help="vLLM model directory (default: the bundled tiny reasoner)")
    r.add_argument("--max-seqs", type=int, default=64, help="running batch cap per engine (sequences)")
    r.add_argument("--kv-tokens", type=int, default=262_144, help="KV cache per simulated engine (tokens)")
    r.add_argument("--steps", type=int, help="steps to run (default: the trace's)")
    r.add_argument("--groups-per-step", type=int, help="groups per step (default: the trace's)")
    r.add_argument("--need-groups", type=int, help="groups a step waits for (default: all it submitted)")
    r.add_argument("--over-provision", type=float, default=2.0,
                   help="policy partial: groups kept in flight per group a step needs")
    r.add_argument("--max-version-lag", type=int, default=1,
                   help="policy partial: restart work holding tokens older than this many versions (-1: no bound)")
    r.add_argument("--train-s", type=float, default=0.0,
                   help="closed loop: a trainer stand-in computes this many seconds per step (on hardware of its "
                        "own) between the hand-over and the weight push")
    r.add_argument("--warmup-steps", type=int, default=0,
                   help="closed loop: run the workload's first N steps once on each fresh fleet, unmeasured and "
                        "without a weight push, before the measured steps (a fresh engine's first batches are slower)")
    r.add_argument("--passes", type=int, choices=[1, 2], default=1,
                   help="closed loop: 2 runs each policy twice on fresh fleets, the first half of the steps in the "
                        "order given and the second half in reverse (A B C C B A), so that a host whose speed "
                        "drifts during the run weighs on every policy alike; a second table pools the passes")
    r.add_argument("--length-scale", type=float, default=1.0, help="multiply prompt and response lengths")
    r.add_argument("--mode", choices=["closed", "open"], default="closed", help="closed loop (RL steps) or open loop")
    r.add_argument("--rate", type=float, default=0.0, help="open loop: groups per second")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--sim", action="append", default=[], metavar="FIELD=VALUE",
                   help=f"simulated-engine cost model, e.g. decode_base_s=0.02 ({', '.join(COST_FIELDS)})")
    r.add_argument("--spec", action="append", default=[], metavar="FIELD=VALUE",
                   help="[engine.spec] override for the policies that speculate, VALUE in JSON, e.g. "
                        "--spec 'schedule=[[1,2,3],[3,65536,0]]' --spec tune=false")
    r.add_argument("--cost-model", metavar="JSON",
                   help="a calibration file (research/calibrate.py) whose sim_params set the cost model; --sim overrides it")
    r.add_argument("--quick", action="store_true", help="a small run: 2 steps of at most 8 groups, lengths x0.1")
    r.add_argument("--report", help="output directory (report.json, PNG plots)")
    r.add_argument("--no-plots", action="store_true")
    r.add_argument("--quiet", action="store_true", help="no per-step progress")
    t = sub.add_parser("table", help="a markdown table of the report.json files under a directory")
    t.add_argument("dir")
    t.add_argument("--speedup-over", metavar="POLICY",
                   help="one row per report: each policy's makespan speedup over POLICY and its ratio to the bound")
    q = sub.add_parser("predict", help="replay a run on real engines on calibrated simulated engines: "
                                       "predicted vs measured per policy")
    q.add_argument("dir", help="the report directory of a `run --engine vllm --report DIR`")
    q.add_argument("--cost-model", metavar="JSON", required=True,
                   help="a calibration file (research/calibrate.py) of the same engines")
    q.add_argument("--sim", action="append", default=[], metavar="FIELD=VALUE", help="cost-model overrides")
    q.add_argument("--no-speed-scale", action="store_true",
                   help="predict at the calibration's host speed, not at each run's (see research/speed_reference.py)")
    q.add_argument("--ensemble", type=int, default=ENSEMBLE,
                   help="replays per policy, at engine costs spread evenly over +-JITTER; the prediction is their "
                        "mean (1: one replay at the calibrated costs)")
    q.add_argument("--jitter", type=float, default=JITTER, help="the ensemble's spread of engine costs (fraction)")
    q.add_argument("--out", help="write the rows as JSON here")
    q.add_argument("--plot", metavar="PNG", help="plot each policy's step makespans, measured beside predicted, here "
                                                 "(with --what-if: each policy's loop groups/s per trace)")
    q.add_argument("--what-if", metavar="POLICIES",
                   help="instead: replay every measured trace under each of these policies (comma-separated) and "
                        "print their loop groups/s per trace, mean, and ratio to the first")
    q.add_argument("--spec", action="append", default=[], metavar="FIELD=VALUE",
                   help="with --what-if: [engine.spec] overrides of the run's --spec for the speculating policies")
    a = sub.add_parser("predictor", help="rank correlation of the length predictor with the true lengths on a replay")
    a.add_argument("--workload", default="math,code,video", help="comma list, as for run")
    a.add_argument("--engines", default="8", help="engines in the fleet (comma list: each)")
    a.add_argument("--policy", default="rebalance", help="the policy the replay runs under")
    a.add_argument("--max-seqs", type=int, default=64)
    a.add_argument("--kv-tokens", type=int, default=262_144)
    a.add_argument("--steps", type=int)
    a.add_argument("--groups-per-step", type=int)
    a.add_argument("--length-scale", type=float, default=1.0)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--report", help="output directory (predictor.json)")
    return p


def _sim_overrides(items: list[str]) -> dict:
    out = {}
    known = set(SimParams.__dataclass_fields__)
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in known:
            raise SystemExit(f"--sim {item!r}: expected FIELD=VALUE with FIELD one of {sorted(known)}")
        current = getattr(SimParams(), key)
        out[key] = value if isinstance(current, str) else type(current)(float(value))
    return out


def _spec_overrides(items: list[str]) -> dict:
    """`--spec FIELD=VALUE` (VALUE in JSON; a bare word is a string) ->
    `[engine.spec]` overrides, validated on a speculating table."""
    from rollout_service.engines.spec_config import SpecConfig

    out: dict = {}
    known = set(SpecConfig.__dataclass_fields__) - {"method"}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in known:
            raise SystemExit(f"--spec {item!r}: expected FIELD=VALUE with FIELD one of {sorted(known)} "
                             f"(the method comes from the policy: spec, spec-ngram, spec-siblings, ...)")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    try:
        SpecConfig.from_dict({"method": "draft_model", **out})
    except (TypeError, ValueError) as e:
        raise SystemExit(f"--spec: {e}") from None
    return out


def _cost_model(path: str | None) -> dict:
    if not path:
        return {}
    fit = json.loads(Path(path).read_text())["sim_params"]
    return {k: [float(x) for x in v] if isinstance(v, list) else float(v) for k, v in fit.items() if k in COST_FIELDS}


def run_one(args, workload_name: str, engines: int, out: Path | None) -> dict:
    steps, groups, scale = args.steps, args.groups_per_step, args.length_scale
    if args.quick:
        steps = steps or 2
        groups = min(groups or 8, 8)
        scale = scale if scale != 1.0 else 0.1
    workload = load_workload(workload_name, seed=args.seed, length_scale=scale, steps=steps, groups_per_step=groups)
    policies = parse_policies(args.policy)
    cfg = RunConfig(
        workload=workload, engines=engines, clock=args.clock, engine_kind=args.engine, max_seqs=args.max_seqs,
        kv_tokens=args.kv_tokens, sim={**_cost_model(args.cost_model), **_sim_overrides(args.sim)}, seed=args.seed, mode=args.mode, rate=args.rate,
        need_groups=args.need_groups, model=args.model, progress=not args.quiet,
        over_provision=args.over_provision, max_version_lag=args.max_version_lag, train_s=args.train_s,
        warmup_steps=args.warmup_steps, spec=_spec_overrides(args.spec),
    )
    cfg.check()
    d = workload.describe()
    print(f"{workload.name} ({d['source']}): {d['steps']} steps x {d['groups_per_step']} groups x "
          f"{d['samples_per_group']} samples, length scale {workload.length_scale:g}, p50 {d['output_p50']:.0f} / "
          f"max {d['output_max']} tokens; {engines} {args.engine} engines x {args.max_seqs} seqs, "
          f"{args.clock} clock, {args.mode} loop"
          + (f", trainer stand-in {args.train_s:g} s per step" if args.train_s > 0 else ""), flush=True)
    try:
        check_passes(cfg, args.passes)
    except ValueError as exc:
        raise SystemExit(f"--passes: {exc}")
    results = run_passes(cfg, policies, args.passes)
    print(table(results), flush=True)
    if args.passes > 1:
        print(pooled_table(pooled([r.summary for r in results])), flush=True)
    config = {
        "command": " ".join(["python -m research", *sys.argv[1:]]),
        "workload": workload_name, "engines": engines, "clock": args.clock, "engine": args.engine,
        "max_seqs": args.max_seqs, "kv_tokens": args.kv_tokens, "length_scale": workload.length_scale,
        "steps": len(workload.steps), "groups_per_step": workload.groups_per_step, "seed": args.seed,
        "mode": args.mode, "rate": args.rate, "need_groups": args.need_groups, "quick": args.quick,
        "sim": cfg.sim, "cost_model_file": args.cost_model, "policies": [r.policy for r in results],
        "passes": args.passes,
        "model": args.model, "max_tokens": workload.max_tokens, "over_provision": args.over_provision,
        "max_version_lag": args.max_version_lag, "train_s": args.train_s, "warmup_steps": args.warmup_steps,
        "spec": cfg.spec,
    }
    if out is not None:
        path = write_json(out, config, workload, results)
        if args.clock == "real":
            print(f"measured traces: {write_measured(out, results)} (replay: python -m research predict {out} "
                  f"--cost-model FIT.json)", flush=True)
        if not args.no_plots:
            plot(out, workload, results, f"{workload.name}, {engines} engines")
        print(f"report: {path}", flush=True)
    return {"config": config, "results": {r.policy: r.summary for r in results}}


def split_workloads(text: str) -> list[str]:
    """"math,synthetic:median=300,sigma=1,code" -> ["math", "synthetic:median=300,sigma=1", "code"]."""
    out: list[str] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        if out and "=" in item and ":" not in item:
            out[-1] += "," + item  # another parameter of the previous workload
        else:
            out.append(item)
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "table":
        if args.speedup_over:
            print(markdown_speedup_table(Path(args.dir), args.speedup_over))
        else:
            print(markdown_table(Path(args.dir)))
        return 0
    if args.command == "predict":
        from research import predict

        if args.spec and not args.what_if:
            raise SystemExit("predict: --spec goes with --what-if (a plain prediction replays the run's own --spec)")
        try:
            reference = None if args.no_speed_scale else json.loads(Path(args.cost_model).read_text()).get("speed_reference")
            if args.what_if:
                result = predict.what_if(Path(args.dir), {**_cost_model(args.cost_model), **_sim_overrides(args.sim)},
                                         [p for p in args.what_if.split(",") if p], spec=_spec_overrides(args.spec),
                                         reference=reference, ensemble=args.ensemble, jitter=args.jitter)
                print(predict.what_if_markdown(result))
                print(predict.speed_note([{"speed_scale": f} for f in result["speed_scale"].values()],
                                         args.cost_model, reference, args.no_speed_scale))
                if args.out:
                    Path(args.out).write_text(json.dumps(result, indent=2))
                if args.plot:
                    print(f"plot: {predict.what_if_plot(result, Path(args.plot), f'{args.dir}: what if (simulated, {Path(args.cost_model).name})')}")
                return 0
            rows = predict.predict(Path(args.dir), {**_cost_model(args.cost_model), **_sim_overrides(args.sim)},
                                   reference=reference, ensemble=args.ensemble, jitter=args.jitter)
        except (ValueError, FileNotFoundError) as exc:
            raise SystemExit(f"predict: {exc}")
        print(predict.markdown(rows))
        print(predict.speed_note(rows, args.cost_model, reference, args.no_speed_scale))
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=2))
        if args.plot:
            print(f"plot: {predict.plot(rows, Path(args.plot), f'{args.dir} predicted with {Path(args.cost_model).name}')}")
        return 0
    if args.command == "predictor":
        from research import predictor_accuracy

        return predictor_accuracy.main(args)
    workloads = split_workloads(args.workload)
    fleets = [int(n) for n in args.engines.split(",") if n.strip()]
    try:
        parse_policies(args.policy)
    except ValueError as exc:
        raise SystemExit(f"--policy: {exc}")
    combos = [(w, n) for w in workloads for n in fleets]
    base = Path(args.report) if args.report else None
    summaries = []
    for w, n in combos:
        out = base if base is None or len(combos) == 1 else base / f"{Path(w).name.replace(':', '_')}-{n}e"
        summaries.append(run_one(args, w, n, out))
    if base is not None and len(combos) > 1:
        (base / "summary.json").write_text(json.dumps(summaries, indent=2, default=float))
    return 0


if __name__ == "__main__":
    from research.interrupt import stop_on_sigterm

    stop_on_sigterm()
    sys.exit(main())
