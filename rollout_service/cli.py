"""`rollout-service serve | plan | selftest | status | demo | bench | build-model | build-eagle`."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys

from rollout_service.config import ServiceConfig, load_config


def _add_service_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML configuration file")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--grpc-port", type=int, help="gRPC port (default 50051; 0 picks a free one)")
    p.add_argument("--http-port", type=int, help="HTTP side-server port (default 8000; 0 picks a free one)")
    p.add_argument("--engine", choices=["sim", "vllm"], help="engine kind")
    p.add_argument("--num-engines", type=int, help="engines in the fleet")
    p.add_argument("--model", help="model directory (default: the bundled tiny reasoner)")
    p.add_argument("--placement", help="placement policy (default least-assigned)")
    p.add_argument("--ray", nargs="?", const="auto", metavar="ADDRESS",
                   help="run each engine as a Ray actor on the cluster at ADDRESS (default: auto, the cluster "
                        "this node belongs to; 'local' starts Ray here)")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="serve on an address other than loopback without tokens (auth.insecure_no_auth)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any configuration key, e.g. engine.max_seqs=32")


def _config(args: argparse.Namespace) -> ServiceConfig:
    overrides = list(args.set)
    for flag, key in (
        ("host", "host"), ("grpc_port", "grpc_port"), ("http_port", "http_port"), ("engine", "engine.kind"),
        ("num_engines", "engine.num_engines"), ("model", "engine.model"), ("placement", "placement"),
    ):
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={json.dumps(value)}")
    if args.insecure_no_auth:
        overrides.append("auth.insecure_no_auth=true")
    if args.ray is not None:
        overrides += ['engine.placement_backend="ray"', f"engine.ray.address={json.dumps(args.ray)}"]
    return load_config(args.config, overrides)


def _logging(level: str) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def cmd_serve(args: argparse.Namespace) -> int:
    from rollout_service.service import RolloutService

    cfg = _config(args)
    _logging(cfg.log_level)
    print("rollout-service configuration:\n" + cfg.describe(), flush=True)
    asyncio.run(RolloutService(cfg).serve_forever())
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Print what `serve` would start on the machine described (default:
    this one); a refusal exits 2 with the reason."""
    from rollout_service.device_plan import Platform, PlanError
    from rollout_service.factory import fleet_plan, model_info

    cfg = _config(args)
    if args.platform:
        platform = Platform.mocked(args.platform, args.gpus or 0, args.gpu_memory_gib or 0.0)
    elif args.gpus is not None or args.gpu_memory_gib is not None:
        raise ValueError("--gpus and --gpu-memory-gib describe a machine: give --platform too")
    else:
        platform = None
    try:
        plan = fleet_plan(cfg.engine, model_info(cfg.engine), platform)
    except PlanError as exc:
        name = args.platform or "this machine"
        if args.json:
            print(json.dumps({"platform": name, "engines": [], "refused": str(exc)}, indent=2))
        print(f"rollout-service plan: refused: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=2, default=str) if args.json else plan.describe())
    return 0


def cmd_selftest(args: argparse.Namespace) -> int:
    from rollout_service.selftest import run_selftest

    return run_selftest(args.platform, args.json, args.timeout)


def cmd_status(args: argparse.Namespace) -> int:
    import grpc

    from trainer_client import RolloutClient

    async def run() -> int:
        async with RolloutClient(args.address) as client:
            try:
                st = await asyncio.wait_for(client.status(), args.timeout)
            except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:
                print(f"cannot reach a rollout service at {args.address}: {exc}", file=sys.stderr)
                return 1
        if args.json:
            print(json.dumps(dataclasses.asdict(st), indent=2))
            return 0
        print(f"model {st.model}  policy version {st.policy_version}  scheduler {st.scheduler}  up {st.uptime_s:.0f}s")
        print(f"queued {st.queued_requests}  running {st.running_requests}  open groups {st.open_groups}  "
              f"last cursor {st.last_cursor}  retained {st.retained_samples}")
        if st.paused:
            print(f"paused (mode={st.paused}): nothing is placed until POST /resume")
        print(f"{'engine':<12}{'kind':<6}{'state':<10}{'running':>8}{'waiting':>8}{'kv':>7}{'tok/s':>10}{'version':>8}")
        for e in st.engines:
            print(f"{e.engine_id:<12}{e.kind:<6}{e.state:<10}{e.running:>8}{e.waiting:>8}{e.kv_usage:>7.1%}"
                  f"{e.tokens_per_s:>10.0f}{e.policy_version:>8}")
        for name, value in sorted(st.counters.items()):
            print(f"  {name:<24}{value:>14}")
        return 0

    return asyncio.run(run())


def cmd_demo(args: argparse.Namespace) -> int:
    from rollout_service.demo import run_demo

    cfg = _config(args)
    _logging("WARNING")
    return asyncio.run(run_demo(cfg, groups=args.groups, samples=args.samples, max_tokens=args.max_tokens))


def cmd_build_model(args: argparse.Namespace) -> int:
    from rollout_service.tools.build_model import build

    build(args.out, preset=args.preset, layers=args.layers, intermediate=args.intermediate, seed=args.seed,
          source=args.source)
    return 0


def _add_build_model(sub) -> None:
    from rollout_service.tools.build_model import PRESETS

    p = sub.add_parser("build-model", help="write a padded, function-identical copy of the bundled target "
                                           "(or drafter)",
                       description="Pad the bundled target or drafter (wider MLPs, extra layers that add nothing "
                                   "to the residual stream): the same logits at the cost, and with the room to "
                                   "learn, of a larger model. Presets: "
                                   + "; ".join(f"{k} ({v.layers} layers x {v.intermediate} intermediate): "
                                               f"{v.purpose}" for k, v in PRESETS.items()))
    p.add_argument("--preset", help=f"one of: {', '.join(PRESETS)}")
    p.add_argument("--layers", type=int, help="decoder layers (overrides the preset's)")
    p.add_argument("--intermediate", type=int, help="MLP intermediate size (overrides the preset's)")
    p.add_argument("--source", help="model to pad: target (the bundled reasoner), draft (the bundled drafter) "
                                    "or a model directory; default: the preset's, else target")
    p.add_argument("--seed", type=int, default=0, help="seed of the padding's random weights")
    p.add_argument("--out", required=True, help="directory to write")
    p.set_defaults(fn=cmd_build_model)


def cmd_build_eagle(args: argparse.Namespace) -> int:
    from rollout_service.drafter.build_eagle import build

    try:
        build(args.out, target=args.target, samples=args.samples, held_out=args.held_out,
              max_tokens=args.max_tokens, steps=args.steps, lr=args.lr, depth=args.depth, seed=args.seed,
              threads=args.threads)
    except (ValueError, FileNotFoundError) as e:
        print(f"build-eagle: {e}", file=sys.stderr)
        return 2
    return 0


def _add_build_eagle(sub) -> None:
    from rollout_service.drafter.build_eagle import BUILD_DEPTH, MAX_TOKENS  # no torch import at module level

    p = sub.add_parser("build-eagle", help="train an EAGLE-style drafter head for the bundled reasoner "
                                           "(or a target directory)",
                       description="Distill a one-layer EAGLE head (it drafts from the target's last hidden "
                                   "state) from the target's own samples; serve it with [engine.spec] "
                                   "method = \"eagle\", model = OUT.")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--target", help="target model directory (default: the bundled reasoner; its padded "
                                    "copies share its head)")
    p.add_argument("--samples", type=int, default=256, help="training responses sampled from the target")
    p.add_argument("--held-out", type=int, default=64, help="held-out responses the acceptance is measured on")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS,
                   help="longest sampled response (default %(default)s: as long as the engines' longest, the head learns the positions it sees)")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps (16 responses each)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--depth", type=int, default=BUILD_DEPTH,
                   help="draft depths trained (the head feeds itself depth-1 times; default %(default)s, the deepest the "
                        "tail schedules draft)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.set_defaults(fn=cmd_build_eagle)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rollout-service", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the service in the foreground")
    _add_service_flags(serve)
    serve.set_defaults(fn=cmd_serve)
    plan = sub.add_parser("plan", help="print the engines, devices, vLLM arguments and memory `serve` would start, "
                                       "without starting anything",
                          description="The device plan of `serve` with the same flags, on this machine or on one "
                                      "described by --platform/--gpus/--gpu-memory-gib; a plan that does not fit is "
                                      "refused (exit 2) naming the keys.")
    _add_service_flags(plan)
    plan.add_argument("--platform", choices=["cuda", "cpu"], help="plan for this platform instead of this machine's")
    plan.add_argument("--gpus", type=int, help="GPUs of the machine planned for (with --platform cuda)")
    plan.add_argument("--gpu-memory-gib", type=float, help="memory of each GPU (GiB), for the KV-cache budget")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(fn=cmd_plan)
    selftest = sub.add_parser("selftest", help="start 2 engines of the bundled model here and check devices, "
                                               "generation, weight pushes and speculation; print a report",
                              description="Checks the GPU path end to end (docs/gpu.md): 2 engines on their own "
                                          "GPUs (CPU: cores), generation with logprobs checked, weight pushes over "
                                          "gRPC and NCCL (gloo on a CPU), speculation and a draft push. Exits 1 if "
                                          "a check fails.")
    selftest.add_argument("--platform", choices=["auto", "cuda", "cpu"], default="auto",
                          help="the platform expected (default: this machine's, as vLLM sees it)")
    selftest.add_argument("--json", action="store_true", help="print the report as JSON")
    selftest.add_argument("--timeout", type=float, default=600.0, help="bound on each check (seconds)")
    selftest.set_defaults(fn=cmd_selftest)
    status = sub.add_parser("status", help="print a running service's status")
    status.add_argument("--address", default="localhost:50051")
    status.add_argument("--timeout", type=float, default=5.0)
    status.add_argument("--json", action="store_true")
    status.set_defaults(fn=cmd_status)
    demo = sub.add_parser("demo", help="start a service, run a short client session, print a summary, stop")
    _add_service_flags(demo)
    demo.add_argument("--groups", type=int, default=16)
    demo.add_argument("--samples", type=int, default=8)
    demo.add_argument("--max-tokens", type=int, default=256)
    demo.set_defaults(fn=cmd_demo)
    from rollout_service.bench.run import add_parser as _add_bench

    _add_bench(sub)
    _add_build_model(sub)
    _add_build_eagle(sub)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"rollout-service: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
