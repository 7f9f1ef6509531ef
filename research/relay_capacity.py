"""Relay capacity: the tokens per second one service process relays.

The service runs in a subprocess of its own (the real gRPC server and
core) on N simulated engines that emit one delta per sequence per engine
step, as vLLM does (`engine.sim.max_run_steps = 1`): every step lasts
`--step-ms` whatever the batch, no prefill cost, `--seqs` sequences per
engine, every sample `--tokens` tokens long. This process is the trainer
(the real client): it submits `--waves` full batches per engine at once and
streams the samples back. With `--backend process` the engines run in host
processes of `--engines-per-host` each (`engine.placement_backend =
"process"`) and send the server their deltas in batches. Per fleet size:

  demand tok/s    what the engines would produce if the server kept up:
                  engines x seqs / step
  relayed tok/s   response tokens the client received / wall time
  time/ideal      wall time / (waves x tokens x step)
  cpu us/tok      the server process's CPU time (every thread, from its own
                  counters via psutil) per relayed token; `all` includes the
                  simulated engines when they run inside the server process,
                  `excl sim` subtracts the time spent in the simulator's
                  step functions (planning a step, emitting its tokens and
                  handing each request its delta), measured in the server
                  as the event loop thread's CPU time
  cpu ms/sample   the same, per sample (all)
  cores           server CPU seconds / wall seconds (all)
  hosts           with `--backend process`: the engine hosts' CPU seconds / wall
                  seconds (the simulated engines, their output, the link's
                  pickling), counted apart from the server's
  lag p50/p99/max how late a 10 ms timer fires on the server's event loop

A row is fair to the server only when the client keeps up: the client's own
CPU share (`client cores`) is printed too; on a machine with fewer free cores
than server + client need, both slow down.

With `--engine vllm` the fleet is vLLM engines on the bundled tiny reasoner
(or `--model`), every sample exactly `--tokens` tokens (min_tokens =
max_tokens): their engine cores run in processes of their own (not counted),
their front ends (`AsyncLLM` output processing) in the server's (or, with
`--backend process`, in the hosts); demand and ideal are then unknown (`-`):
the row is the server's CPU per token at the rate those engines generate.

    python -m research.relay_capacity [--engines 16,32,64] [--step-ms 20] [--backend process] [--report DIR]
    python -m research.relay_capacity --engine vllm --engines 2 --seqs 64 --tokens 256 --waves 2
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

GROUP = 8  # samples per group
LAG_PROBE_S = 0.01
START_TIMEOUT_S = 120.0
STATS_TIMEOUT_S = 30.0
MARK = "relay-capacity: "  # the server's reports on its stdout start with this


# -- the server side (a subprocess) -----------------------------------------------------


def _instrument_sim(totals: dict) -> None:
    """Time the simulated engines' step functions (their cost, not the server's)."""
    import functools

    from rollout_service.engines.sim import SimEngine

    for name in ("_complete", "_plan", "_admit", "_preempt_overflow"):
        fn = getattr(SimEngine, name)

        def timed(self, *args, __fn=fn, **kwargs):
            t = time.thread_time()
            try:
                return __fn(self, *args, **kwargs)
            finally:
                totals["sim_s"] += time.thread_time() - t
        setattr(SimEngine, name, functools.wraps(fn)(timed))


async def serve(spec: dict) -> None:
    """Run the service; answer each `stats` line on stdin with a JSON line."""
    from rollout_service.config import EngineConfig, ServiceConfig
    from rollout_service.service import RolloutService

    totals = {"sim_s": 0.0}
    _instrument_sim(totals)
    sim = {"decode_base_s": spec["step_s"], "decode_per_seq_s": 0.0, "prefill_per_token_s": 0.0,
           "max_run_steps": 1, "weight_update_s": 0.0}
    where = {"placement_backend": spec.get("backend", "local"),
             "process": {"engines_per_host": spec.get("engines_per_host", 8), "batch_ms": spec.get("batch_ms", 0.0),
                         "nice": spec.get("nice", 0)}}
    if spec.get("engine", "sim") == "vllm":
        engine = EngineConfig(kind="vllm", num_engines=spec["engines"], max_seqs=spec["seqs"], model=spec.get("model", ""),
                              **where)
    else:
        engine = EngineConfig(kind="sim", num_engines=spec["engines"], max_seqs=spec["seqs"], sim=sim, **where)
    cfg = ServiceConfig(grpc_port=0, http_port=0, log_level="WARNING", engine=engine)
    service = RolloutService(cfg)
    await service.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    lags: list[float] = []
    gc_pauses: list[float] = []  # the server's garbage collections (seconds), since the last report
    gc_started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter()
        else:
            gc_pauses.append(time.perf_counter() - gc_started[0])

    import gc

    gc.callbacks.append(on_gc)

    async def lag_probe() -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(LAG_PROBE_S)
            lags.append(time.perf_counter() - t - LAG_PROBE_S)

    async def answer() -> None:
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            if line.strip() == b"stats":
                lag = sorted(lags)
                lags.clear()
                pick = (lambda q: round(1e3 * lag[min(len(lag) - 1, int(q * len(lag)))], 2)) if lag else (lambda q: None)
                gc_s, gc_max = sum(gc_pauses), max(gc_pauses, default=0.0)
                gc_pauses.clear()
                print(MARK + json.dumps({"sim_s": totals["sim_s"], "lag_p50_ms": pick(0.5), "lag_p99_ms": pick(0.99),
                                  "lag_max_ms": pick(1.0), "gc_s": gc_s, "gc_max_ms": round(1e3 * gc_max, 1),
                                  "tokens_generated": service.core.counters["tokens_generated"]}), flush=True)
        stop.set()  # the parent went away

    tasks = [asyncio.create_task(lag_probe()), asyncio.create_task(answer())]
    profiler = None
    if spec.get("profile"):
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    print(MARK + json.dumps({"port": service.grpc_port, "pid": os.getpid()}), flush=True)
    try:
        await stop.wait()
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(spec["profile"])
        for t in tasks:
            t.cancel()
        await service.stop()


# -- the trainer side (this process) ----------------------------------------------------


async def _line(stream: asyncio.StreamReader, timeout: float) -> dict:
    """The server's next report (other output, e.g. vLLM's, passes through)."""
    async with asyncio.timeout(timeout):
        while True:
            line = (await stream.readline()).decode()
            if not line:
                raise RuntimeError("the server process exited")
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
            sys.stdout.write(line)


async def measure(engines: int, seqs: int, tokens: int, step_s: float, waves: int, profile: str = "",
                  engine: str = "sim", model: str = "", backend: str = "local", engines_per_host: int = 8,
                  batch_ms: float = 0.0, nice: int = 0) -> dict:
    """One fleet size: start a server, relay `waves` batches, return the row
    (with `profile`, the server runs under cProfile and writes its stats there)."""
    import psutil

    from trainer_client import PromptGroup, RolloutClient

    spec = {"engines": engines, "seqs": seqs, "step_s": step_s, "profile": profile, "engine": engine, "model": model,
            "backend": backend, "engines_per_host": engines_per_host, "batch_ms": batch_ms,
            "nice": nice}
    vllm = engine == "vllm"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "research.relay_capacity", "--serve", json.dumps(spec),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    try:
        hello = await _line(proc.stdout, START_TIMEOUT_S)
        server = psutil.Process(hello["pid"])
        me = psutil.Process()

        async def stats() -> dict:
            proc.stdin.write(b"stats\n")
            await proc.stdin.drain()
            return await _line(proc.stdout, STATS_TIMEOUT_S)

        samples = engines * seqs * waves
        lengths = ",".join([str(tokens)] * GROUP)
        async with RolloutClient(f"127.0.0.1:{hello['port']}", consumer_id="relay") as client:
            await client.wait_ready(START_TIMEOUT_S)
            s0 = await stats()
            hosts = server.children()  # the process backend's engine hosts (vLLM's engine cores: not counted)
            hosts = hosts if backend == "process" else []
            cpu0, mine0 = sum(server.cpu_times()[:2]), sum(me.cpu_times()[:2])
            hosts0 = sum(sum(h.cpu_times()[:2]) for h in hosts)
            t0 = time.perf_counter()
            if vllm:  # exactly `tokens` tokens each; distinct prompts (no prefix-cache shortcut)
                groups = (PromptGroup(prompt_token_ids=[1, 5 + i % 50, 6 + i // 50 % 50, 7], num_samples=GROUP,
                                      max_tokens=tokens, min_tokens=tokens, group_id=f"r{i}", seed=i)
                          for i in range(samples // GROUP))
            else:
                groups = (PromptGroup(prompt_token_ids=[1, 5, 6, 7], num_samples=GROUP, max_tokens=tokens + 1,
                                      group_id=f"r{i}", metadata={"sim.target_lengths": lengths})
                          for i in range(samples // GROUP))
            await client.submit(groups)
            received = relayed = 0
            # Bounded: the slowest fleet size here relays at a fraction of its demand, not less than 1/50
            # (vLLM on a CPU: at least 100 tokens/s per engine).
            limit = waves * seqs * tokens / 100 if vllm else 50 * waves * tokens * step_s
            async with asyncio.timeout(60 + limit):
                async for sample in client.stream(ack_every=256):
                    received += 1
                    relayed += len(sample.response_token_ids)
                    if received == samples:
                        break
            wall = time.perf_counter() - t0
            cpu = sum(server.cpu_times()[:2]) - cpu0
            mine = sum(me.cpu_times()[:2]) - mine0
            hosts_cpu = sum(sum(h.cpu_times()[:2]) for h in hosts) - hosts0
            s1 = await stats()
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 60)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
    sim_s = s1["sim_s"] - s0["sim_s"]
    ideal = waves * tokens * step_s
    return {
        "engines": engines, "seqs_per_engine": seqs, "step_ms": step_s * 1e3, "tokens_per_sample": tokens,
        "samples": received, "tokens_relayed": relayed, "tokens_expected": samples * tokens,
        "tokens_generated": s1["tokens_generated"] - s0["tokens_generated"],
        "engine": engine, "backend": backend, "engines_per_host": engines_per_host if backend == "process" else None,
        "batch_ms": batch_ms if backend == "process" else None, "nice": nice if backend == "process" else None,
        "demand_tokens_per_s": None if vllm else round(engines * seqs / step_s),
        "relayed_tokens_per_s": round(relayed / wall),
        "wall_s": round(wall, 3), "ideal_s": None if vllm else round(ideal, 3),
        "time_over_ideal": None if vllm else round(wall / ideal, 3),
        "server_cpu_s": round(cpu, 3), "sim_cpu_s": round(sim_s, 3),
        "server_cores": round(cpu / wall, 2), "client_cores": round(mine / wall, 2),
        "host_cores": round(hosts_cpu / wall, 2) if hosts else None,
        "server_us_per_token": round(1e6 * cpu / max(1, relayed), 2),
        "server_us_per_token_excl_sim": round(1e6 * (cpu - sim_s) / max(1, relayed), 2),
        "server_ms_per_sample": round(1e3 * cpu / max(1, received), 3),
        "lag_p50_ms": s1["lag_p50_ms"], "lag_p99_ms": s1["lag_p99_ms"], "lag_max_ms": s1["lag_max_ms"],
        "gc_s": round(s1["gc_s"], 3), "gc_max_ms": s1["gc_max_ms"],
    }


HEADER = (f"{'engines':>7} {'demand tok/s':>12} {'relayed tok/s':>13} {'time/ideal':>10} {'cpu us/tok':>10} "
          f"{'excl sim':>8} {'ms/sample':>9} {'cores':>5} {'hosts':>5} {'client':>6} {'lag p50/p99/max ms':>20}")


def format_row(r: dict) -> str:
    lag = f"{r['lag_p50_ms']}/{r['lag_p99_ms']}/{r['lag_max_ms']}"
    demand = "-" if r["demand_tokens_per_s"] is None else f"{r['demand_tokens_per_s']:,}"
    ratio = "-" if r["time_over_ideal"] is None else f"{r['time_over_ideal']:.2f}"
    hosts = "-" if r.get("host_cores") is None else f"{r['host_cores']:.2f}"
    return (f"{r['engines']:>7} {demand:>12} {r['relayed_tokens_per_s']:>13,} "
            f"{ratio:>10} {r['server_us_per_token']:>10.2f} {r['server_us_per_token_excl_sim']:>8.2f} "
            f"{r['server_ms_per_sample']:>9.3f} {r['server_cores']:>5.2f} {hosts:>5} {r['client_cores']:>6.2f} {lag:>20}")


def run(engine_counts: list[int], seqs: int, tokens: int, step_s: float, waves: int, profile: str = "",
        engine: str = "sim", model: str = "", backend: str = "local", engines_per_host: int = 8,
        batch_ms: float = 0.0, nice: int = 0) -> list[dict]:
    steps = "vLLM engines" if engine == "vllm" else f"{step_s * 1e3:g} ms steps"
    where = (f"in host processes of {engines_per_host} engines (batches of {batch_ms:g} ms, nice {nice})"
             if backend == "process"
             else "in the server's process")
    print(f"{seqs} sequences per engine, {tokens}-token samples, {steps}, {waves} waves, engines {where}; "
          "server CPU: all threads of the server process", flush=True)
    print(HEADER, flush=True)
    rows = []
    for n in engine_counts:
        path = f"{profile}.{n}-engines.prof" if profile else ""
        row = asyncio.run(measure(n, seqs, tokens, step_s, waves, path, engine, model, backend, engines_per_host,
                                  batch_ms, nice))
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    from rollout_service.config import ProcessConfig

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default="16,32,64", help="fleet sizes, comma-separated")
    p.add_argument("--seqs", type=int, default=64, help="sequences per engine")
    p.add_argument("--tokens", type=int, default=256, help="tokens per sample")
    p.add_argument("--step-ms", type=float, default=20.0, help="engine step time (milliseconds)")
    p.add_argument("--waves", type=int, default=2, help="full batches per engine")
    p.add_argument("--engine", choices=["sim", "vllm"], default="sim", help="engine kind")
    p.add_argument("--model", default="", help="vLLM: model directory (default: the bundled tiny reasoner)")
    p.add_argument("--backend", choices=["local", "process"], default="local",
                   help="where the engines run: the server's process, or host processes (engine.placement_backend)")
    p.add_argument("--engines-per-host", type=int, default=8, help="process backend: engines per host process")
    p.add_argument("--batch-ms", type=float, default=None,
                   help="process backend: how long a host's news waits for more (engine.process.batch_ms)")
    p.add_argument("--nice", type=int, default=0, help="process backend: the hosts' niceness (engine.process.nice)")
    p.add_argument("--quick", action="store_true", help="a small run (CI): 2 engines x 4 sequences, 16 tokens")
    p.add_argument("--report", help="directory for relay_capacity.json")
    p.add_argument("--profile", metavar="PREFIX", help="run the server under cProfile (slower): PREFIX.N-engines.prof")
    p.add_argument("--serve", help=argparse.SUPPRESS)  # the server subprocess: its spec as JSON
    args = p.parse_args(argv)
    if args.serve:
        asyncio.run(serve(json.loads(args.serve)))
        return []
    if args.quick:
        rows = run([2], seqs=4, tokens=16, step_s=0.005, waves=2, backend=args.backend,
                   engines_per_host=args.engines_per_host, batch_ms=args.batch_ms or 0.0)
    else:
        rows = run([int(n) for n in args.engines.split(",")], args.seqs, args.tokens, args.step_ms / 1e3, args.waves,
                   os.path.abspath(args.profile) if args.profile else "", args.engine, args.model, args.backend,
                   args.engines_per_host, ProcessConfig().batch_ms if args.batch_ms is None else args.batch_ms,
                   args.nice)
    if args.report:
        out = Path(args.report)
        out.mkdir(parents=True, exist_ok=True)
        (out / "relay_capacity.json").write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    from research.interrupt import stop_on_sigterm

    if "--serve" not in sys.argv:
        stop_on_sigterm()
    main()
