"""`rollout-service bench`: replay a workload against a running deployment.

    rollout-service bench --target grpc://HOST:50051 --workload math --report out/
    rollout-service bench --target http://HOST:8000 --workload math --quick
    rollout-service bench compare out-a out-b

One run: check the target (fails in `--connect-timeout-s` seconds naming
it), build the workload's requests (prompts of the trace's lengths from the
model's vocabulary, or the user's prompts), drive them in a closed loop
(steps of groups, wait for `--need-groups`, a trainer stand-in, an optional
weight push) or an open loop (Poisson arrivals at `--rate` groups/s), then
report (`rollout_service.bench.report`).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

from rollout_service.bench import driver, report
from rollout_service.bench.prompts import is_prompt_file, load_prompt_file
from rollout_service.bench.targets import HttpWeightPush, TargetError, connect_grpc, connect_http
from rollout_service.bench.workloads import WORKLOADS, GroupShape, Workload, load_workload, scaled

DEFAULT_VOCAB = 64  # prompt ids in [3, 64) are tokens of any model; --vocab-size widens them


@dataclass(slots=True)
class BenchOptions:
    """A bench run (the flags of `rollout-service bench`, lengths in tokens, times in seconds)."""

    target: str
    workload: str = "math"
    token: str | None = None
    tls_ca: str | None = None
    mode: str = "closed"
    rate: float = 0.0
    steps: int | None = None
    groups_per_step: int | None = None
    need_groups: int | None = None
    train_s: float = 0.0
    push_bytes: int = 0
    weights_token: str | None = None
    push_address: str | None = None
    length_scale: float = 1.0
    lengths: str = "trace"
    vocab_size: int = 0
    max_model_len: int = 0
    max_tokens: int = 256
    samples_per_group: int = 8
    quick: bool = False
    report: str | None = None
    seed: int = 0
    max_concurrency: int = 512
    stream: bool = True
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0
    run_timeout_s: float = 24 * 3600.0
    progress_s: float = 10.0
    status_every_s: float = 0.5
    plots: bool = True


def parse_target(text: str) -> tuple[str, str]:
    """("grpc", "host:port") or ("http", "http://host:port"); ValueError naming --target."""
    parts = urlsplit(text)
    if parts.scheme in ("grpc", "http", "https") and parts.hostname and parts.port:
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        if parts.scheme == "grpc":
            return "grpc", f"{host}:{parts.port}"
        return "http", f"{parts.scheme}://{host}:{parts.port}"
    raise ValueError(f"--target must be grpc://HOST:PORT or http(s)://HOST:PORT, got {text!r}")


def resolve_workload(opts: BenchOptions) -> Workload:
    """The workload `--workload` names, sized and scaled by the flags."""
    steps, groups = opts.steps, opts.groups_per_step
    scale = opts.length_scale
    if opts.quick:
        steps, groups, scale = min(steps or 2, 2), min(groups or 8, 8), scale * 0.1
    path = Path(opts.workload)
    if is_prompt_file(path):
        w = load_prompt_file(path, opts.samples_per_group, groups or 64, opts.max_tokens)
        w = w.resized(steps, None)
    else:
        w = load_workload(opts.workload, seed=opts.seed, steps=steps, groups_per_step=groups)
    return scaled(w, scale)


def fit_context(w: Workload, max_model_len: int) -> tuple[Workload, int]:
    """Responses and made-up prompts cut so prompt + response fits
    `max_model_len` (0: no limit); returns the workload and how many samples
    were cut."""
    if max_model_len <= 0:
        return w, 0
    cut = 0
    steps = []
    for step in w.steps:
        out = []
        for g in step:
            prompt = len(g.prompt_token_ids) if g.prompt_token_ids is not None else g.prompt_len
            if g.prompt_token_ids is None and not g.prompt_text:
                prompt = min(prompt, max(1, max_model_len // 2))
            room = max(1, max_model_len - prompt - 1)
            lens = [min(L, room) for L in g.output_lens]
            cut += sum(a != b for a, b in zip(lens, g.output_lens)) + (prompt != g.prompt_len) * len(lens)
            out.append(GroupShape(prompt, lens, g.prompt_token_ids, g.problem, g.trajectories, g.prompt_text))
        steps.append(out)
    fitted = Workload(w.name, steps, min(w.max_tokens, max_model_len - 1), w.source, w.length_scale,
                      dict(w.params), w.vocab_size)
    return fitted, cut


class _Counted:
    """A target that counts what was submitted and delivered (the progress line)."""

    def __init__(self, target) -> None:
        self.target = target
        self.submitted = 0
        self.delivered = 0
        self.failed = 0

    async def submit(self, groups) -> None:
        self.submitted += sum(g.num_samples for g in groups)
        await self.target.submit(groups)

    async def completions(self):
        async for c in self.target.completions():
            self.delivered += 1
            self.failed += c.finish_reason.startswith("error:")
            yield c

    async def push_weights(self, version: int) -> None:
        await self.target.push_weights(version)

    def now(self) -> float:
        return self.target.now()


async def _watch_fleet(client, counted: _Counted, every_s: float, polls: list[dict]) -> None:
    """Poll the service's GetStatus every `every_s` seconds: what each
    engine runs, for the report's fleet utilisation (`report.fleet`). A
    failed poll is skipped: the run's own calls report the target's errors."""
    while True:
        with contextlib.suppress(Exception):
            st = await asyncio.wait_for(client.status(), max(every_s, 1.0))
            live = [e for e in st.engines if e.state != "dead"]
            polls.append({"t": counted.now(), "engines": len(live), "busy": sum(e.running > 0 for e in live),
                          "running": sum(e.running for e in live),
                          "waiting": sum(e.waiting for e in live) + st.queued_requests})
        await asyncio.sleep(every_s)


async def _progress(counted: _Counted, total: int, every_s: float, t0: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        t = time.monotonic() - t0
        print(f"bench: {t:.0f} s, {counted.delivered}/{total} samples back ({counted.failed} errors), "
              f"{counted.delivered / t:.0f} samples/s", file=sys.stderr, flush=True)


def _lengths_statement(kind: str, lengths: str, exact: bool) -> str:
    if not exact:
        return "the model's own (capped at max_tokens)" if lengths == "free" else "free"
    if kind == "http":
        return ("exact per sample: max_tokens = min_tokens = the target length, ignore_eos (a server that "
                "ignores min_tokens/ignore_eos only caps them)")
    return ("per group: min_tokens = its shortest and max_tokens = its longest target; the exact per-sample "
            "lengths reach simulated engines only (the sim.target_lengths hint); a real engine's samples end "
            "within their group's bounds, as its model decides")


async def run_bench(opts: BenchOptions, out=sys.stdout) -> dict:
    """Run the bench (module docstring); returns the report's document and
    writes it under `opts.report` when set."""
    kind, address = parse_target(opts.target)
    if opts.mode == "open" and opts.rate <= 0:
        raise ValueError("--mode open needs --rate > 0 (groups per second)")
    if opts.push_bytes and opts.mode != "closed":
        raise ValueError("--push-bytes pushes after each step: it needs --mode closed")
    w = resolve_workload(opts)
    if w.multi_turn and kind != "grpc":
        raise ValueError(f"--workload {opts.workload} is multi-turn: it replays over grpc:// only (the bench answers "
                         "each turn through the trajectory API; an OpenAI-compatible server has none)")
    exact = opts.lengths == "trace" and w.params.get("lengths") != "free"
    if exact:
        # Every sample asks for its own length, the trace's truncated ones included.
        w.max_tokens = max(int(L) for step in w.steps for g in step for L in g.output_lens) + 1
    session = client = None
    if kind == "grpc":
        client, status, target = await connect_grpc(address, opts.token, opts.tls_ca, opts.connect_timeout_s,
                                                    push_bytes=opts.push_bytes, exact_lengths=exact, hints=exact)
        model, max_len = status.model, opts.max_model_len
    else:
        session, info, target = await connect_http(address, opts.token, opts.tls_ca, opts.connect_timeout_s,
                                                   exact_lengths=exact, stream=opts.stream,
                                                   max_concurrency=opts.max_concurrency,
                                                   request_timeout_s=opts.request_timeout_s)
        model, max_len = info["id"], opts.max_model_len or info["max_model_len"]
        if opts.push_bytes:  # the weight-transfer group forms now: a target that cannot fails before the run
            target.weight_push = HttpWeightPush(session, address, opts.push_bytes, opts.weights_token or opts.token,
                                                opts.tls_ca, opts.push_address, timeout_s=opts.connect_timeout_s * 12)
            try:
                await target.weight_push.prepare()
            except BaseException:
                await target.close()
                await session.close()
                raise
    vocab = opts.vocab_size or w.vocab_size or DEFAULT_VOCAB
    target.vocab_size = vocab  # multi-turn: the observations' ids
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    counted = _Counted(target)
    t0 = time.monotonic()
    progress = watch = None
    polls: list[dict] = []
    try:
        w, cut = fit_context(w, max_len)
        expected = {}
        if exact:
            for k in range(len(w.steps)):
                for g in driver.group_requests(w, k, run_id, vocab):
                    expected.update({(g.group_id, i): L for i, L in enumerate(g.target_lengths)})
        total = sum(g.num_samples for step in w.steps for g in step)
        progress = asyncio.create_task(_progress(counted, total, opts.progress_s, t0))
        if client is not None and opts.status_every_s > 0:
            watch = asyncio.create_task(_watch_fleet(client, counted, opts.status_every_s, polls))
        async with asyncio.timeout(opts.run_timeout_s):
            if opts.mode == "closed":
                records, dups = await driver.closed_loop(
                    counted, w, vocab, run_id=run_id, need_groups=opts.need_groups,
                    push_weights=opts.push_bytes > 0, train_s=opts.train_s, drain=True)
            else:
                records, dups = await driver.open_loop(counted, w, vocab, opts.rate, seed=opts.seed, run_id=run_id)
    finally:
        for task in (progress, watch):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if session is not None:
            await target.close()
            await session.close()
        if client is not None:
            await client.close()
    summary = report.summarise(records, target, expected or None, dups)
    summary["fleet"] = report.fleet(polls, records, opts.status_every_s) if polls else None
    config = {k: v for k, v in asdict(opts).items() if k not in ("token", "weights_token")}
    config.update(model=model, lengths=_lengths_statement(kind, opts.lengths, exact), vocab_size=vocab,
                  prompt_ids=f"made up in [3, {vocab})" if not any(g.prompt_token_ids or g.prompt_text
                                                                   for s in w.steps for g in s) else "the workload's",
                  max_model_len=max_len, samples_cut_to_context=cut, wall_s=time.monotonic() - t0)
    doc = {"schema": report.SCHEMA, "config": config, "workload": w.describe(), "summary": summary,
           "fleet_polls": polls}
    print(report.markdown(doc), file=out)
    if opts.report:
        latencies = [c.finished_at - c.queued_at for r in records for c in r.samples
                     if not c.finish_reason.startswith("error:")]
        ttft = list(target.ttft_s) if target.streams_tokens else [c.first_token_at - c.queued_at for r in records
                                                                  for c in r.samples if c.first_token_at > 0]
        paths = report.write(Path(opts.report), doc, latencies, ttft, plots=opts.plots)
        print("wrote " + ", ".join(str(p) for p in paths), file=out)
    return doc


def add_parser(sub) -> None:
    """The `bench` subcommand (and `bench compare A B`)."""
    p = sub.add_parser("bench", help="load-test a running deployment (this service over gRPC, or any "
                                     "OpenAI-compatible server) with a trace; `bench compare A B` prints two reports",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("compare", nargs="?", choices=["compare"], help="compare two reports: bench compare A B")
    p.add_argument("reports", nargs="*", help="compare: two --report folders (or their report.json)")
    p.add_argument("--target", help="grpc://HOST:PORT (this service) or http(s)://HOST:PORT (/v1/completions)")
    p.add_argument("--token", help="bearer token for the target")
    p.add_argument("--tls-ca", metavar="PEM", help="CA certificate of the target: TLS for gRPC; for http the "
                                                   "https:// scheme with this CA")
    p.add_argument("--workload", default="math",
                   help=f"{', '.join(w for w in WORKLOADS if w != 'search-r1')}, synthetic:k=v,..., a PolyTrace "
                        "folder or file, or a JSONL of prompts (text or token ids, optional output_len)")
    p.add_argument("--mode", choices=["closed", "open"], default="closed",
                   help="closed: steps of groups, each waiting for --need-groups; open: Poisson arrivals at --rate")
    p.add_argument("--rate", type=float, default=0.0, help="open loop: groups per second")
    p.add_argument("--steps", type=int, help="steps (default: the workload's)")
    p.add_argument("--groups-per-step", type=int, help="groups per step (default: the workload's)")
    p.add_argument("--need-groups", type=int, help="closed loop: groups a step waits for (the rest are "
                                                   "collected after the last step)")
    p.add_argument("--train-s", type=float, default=0.0, help="closed loop: trainer stand-in seconds per step")
    p.add_argument("--push-bytes", type=int, default=0, help="closed loop: push a tensor of this many bytes after "
                                                             "each step (the weight push's stall shows); http: "
                                                             "through vLLM's weight-transfer routes")
    p.add_argument("--weights-token", help="http: bearer token of the weight routes (default: --token)")
    p.add_argument("--push-address", help="http: this host's address the target's engines reach for the "
                                          "weight-transfer group (default: the route to the target)")
    p.add_argument("--lengths", choices=["trace", "free"], default="trace",
                   help="trace: ask for the workload's response lengths; free: the model decides (up to the cap)")
    p.add_argument("--length-scale", type=float, default=1.0, help="multiply prompt and response lengths")
    p.add_argument("--vocab-size", type=int, default=0, help=f"made-up prompt ids come from [3, N) "
                                                             f"(default {DEFAULT_VOCAB}, valid for any model)")
    p.add_argument("--max-model-len", type=int, default=0, help="cut prompt + response to this context "
                                                                "(default: what /v1/models says, else none)")
    p.add_argument("--max-tokens", type=int, default=256, help="prompt files without output_len: the cap")
    p.add_argument("--samples-per-group", type=int, default=8, help="prompt files: samples per prompt")
    p.add_argument("--max-concurrency", type=int, default=512, help="http: requests in flight at most")
    p.add_argument("--no-stream", dest="stream", action="store_false", help="http: no server-sent events (no TTFT)")
    p.add_argument("--connect-timeout-s", type=float, default=5.0, help="how long the target may take to answer")
    p.add_argument("--request-timeout-s", type=float, default=600.0, help="http: bound on one request")
    p.add_argument("--run-timeout-s", type=float, default=24 * 3600.0, help="bound on the whole run")
    p.add_argument("--progress-s", type=float, default=10.0, help="print a progress line this often")
    p.add_argument("--status-every-s", type=float, default=0.5,
                   help="grpc: poll the service's status this often for the fleet's utilisation (0: never)")
    p.add_argument("--quick", action="store_true", help="2 steps of at most 8 groups, lengths x0.1")
    p.add_argument("--report", metavar="DIR", help="write report.json, report.md and bench.png here")
    p.add_argument("--no-plots", dest="plots", action="store_false")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.compare:
        if len(args.reports) != 2:
            raise ValueError("bench compare takes two reports: bench compare A B")
        a, b = (report.load(r) for r in args.reports)
        print(report.compare(a, b, tuple(args.reports)))
        return 0
    if args.reports:
        raise ValueError(f"unexpected arguments {args.reports}: did you mean `bench compare A B`?")
    if not args.target:
        raise ValueError("bench needs --target grpc://HOST:PORT or http(s)://HOST:PORT")
    fields = set(BenchOptions.__dataclass_fields__)
    opts = BenchOptions(**{k: v for k, v in vars(args).items() if k in fields})
    try:
        asyncio.run(run_bench(opts))
    except TargetError as exc:
        print(f"rollout-service bench: {exc}", file=sys.stderr)
        return 1
    return 0
