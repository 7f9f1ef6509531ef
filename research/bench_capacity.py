"""`rollout-service bench` against a service it starts as a user would (a
`rollout-service serve` process of its own on simulated engines), in two
studies printed side by side:

- **capacity**: engines whose steps cost nothing, so the figure is what the
  bench and the service can move between them, not the fleet: samples/s and
  tokens/s over gRPC and over HTTP (the bench in this process, the service
  in its own). A simulated engine's run of steps ends at each finish and
  hands a delta to every sequence it runs, so the service's work per sample
  grows with the batch; the default fleet runs small batches (`--seqs 16`)
  on more engines so that the figure is the bench's and the service's
  per-sample path, not that per-delta cost;
- **agreement**: the same simulated fleet (the default cost model) and the
  same workload through the bench over gRPC and through the in-process
  harness (`python -m research run --clock real`, and `--clock virtual`):
  groups/s, tokens/s and mean step makespan, and their ratio to the
  bench's.

    python -m research.bench_capacity [--quick] [--engines 8] [--seqs 16] [--report DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rollout_service.bench.run import BenchOptions, run_bench
from trainer_client.collective import free_port

FREE = {"decode_base_s": 0.0, "decode_per_seq_s": 0.0, "prefill_per_token_s": 0.0}


@contextlib.contextmanager
def serving(engines: int, sim: dict, timeout_s: float = 120.0):
    """A `rollout-service serve` process on `engines` simulated engines:
    (grpc port, http port, pid); stopped (SIGTERM, bounded) at the end."""
    import urllib.request

    grpc_port, http_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "rollout_service.cli", "serve", "--engine", "sim", "--num-engines", str(engines),
           "--grpc-port", str(grpc_port), "--http-port", str(http_port), "--set", f"engine.max_seqs={sim.get('max_seqs', 64)}"]
    for key, value in sim.items():
        cmd += ["--set", f"engine.sim.{key}={value}"]
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"the service exited {proc.returncode}: {log.read()[-2000:].decode(errors='replace')}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/readyz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the service was not ready within {timeout_s:g} s")
            time.sleep(0.2)
        yield grpc_port, http_port, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _bench(target: str, workload: str, **kw) -> dict:
    opts = BenchOptions(target=target, workload=workload, progress_s=3600.0, status_every_s=0.0, plots=False, **kw)
    return asyncio.run(run_bench(opts, out=io.StringIO()))["summary"]


def _cpu_s(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def capacity(engines: int, seqs: int, workload: str, steps: int) -> list[dict]:
    """Each target's samples/s and tokens/s, with the CPU seconds per 1,000
    samples of the bench (this process) and of the service: the bench's own
    ceiling on one core is 1,000 / its figure x 1,000 samples/s."""
    rows = []
    with serving(engines, dict(FREE, max_seqs=seqs)) as (grpc_port, http_port, pid):
        for scheme, port, extra in (("grpc", grpc_port, {}), ("http", http_port, {}),
                                    ("http", http_port, {"stream": False})):
            target = f"{scheme}://127.0.0.1:{port}"
            _bench(target, workload, steps=1, **extra)  # warm-up
            bench0, server0 = time.process_time(), _cpu_s(pid)
            s = _bench(target, workload, steps=steps, **extra)
            bench_cpu, server_cpu = time.process_time() - bench0, _cpu_s(pid) - server0
            n = max(1, s["samples_delivered"])
            row = {"target": scheme + ("" if extra.get("stream", True) else ", not streamed"),
                   "samples": s["samples_delivered"], "samples_per_s": round(s["samples_per_s"], 1),
                   "tokens_per_s": round(s["tokens_per_s"]), "errors": s["errors"],
                   "bench_cpu_s_per_1k_samples": round(1000 * bench_cpu / n, 3),
                   "server_cpu_s_per_1k_samples": round(1000 * server_cpu / n, 3)}
            rows.append(row)
            print(f"capacity {row['target']:<18} {row['samples_per_s']:>8,.0f} samples/s {row['tokens_per_s']:>9,} "
                  f"tokens/s   CPU s per 1,000 samples: bench {row['bench_cpu_s_per_1k_samples']:.2f}, "
                  f"service {row['server_cpu_s_per_1k_samples']:.2f}   ({row['samples']} samples)", flush=True)
    return rows


def _harness(clock: str, engines: int, workload: str, steps: int, groups: int, scale: float, out: Path) -> dict:
    from research.__main__ import main as research_main

    with contextlib.redirect_stdout(io.StringIO()):
        research_main(["run", "--workload", workload, "--engines", str(engines), "--clock", clock, "--policy", "static",
                       "--steps", str(steps), "--groups-per-step", str(groups), "--length-scale", str(scale),
                       "--max-seqs", "64", "--report", str(out), "--no-plots", "--quiet"])
    doc = json.loads((out / "report.json").read_text())
    r = doc["results"]["static"]
    return {"groups_per_s": r["groups_per_s"], "tokens_per_s": r["tokens_per_s"], "makespan_s": r["makespan_s"]}


def agreement(engines: int, workload: str, steps: int, groups: int, scale: float) -> list[dict]:
    with serving(engines, {"max_seqs": 64}) as (grpc_port, _, _):
        s = _bench(f"grpc://127.0.0.1:{grpc_port}", workload, steps=steps, groups_per_step=groups,
                   length_scale=scale)
    bench = {"groups_per_s": s["groups_per_s"], "tokens_per_s": s["tokens_per_s"],
             "makespan_s": sum(p["makespan_s"] for p in s["per_step"]) / len(s["per_step"])}
    rows = [{"run": "rollout-service bench (grpc)", **bench}]
    with tempfile.TemporaryDirectory() as tmp:
        for clock in ("real", "virtual"):
            h = _harness(clock, engines, workload, steps, groups, scale, Path(tmp) / clock)
            rows.append({"run": f"in-process harness, {clock} clock", **h,
                         **{f"{k}_ratio": round(h[k] / bench[k], 4) for k in bench}})
    for r in rows:
        print(f"{r['run']:<38} groups/s {r['groups_per_s']:8.2f}  tokens/s {r['tokens_per_s']:10,.0f}  "
              f"makespan {r['makespan_s']:7.2f} s" + (f"  (x{r['groups_per_s_ratio']:.3f} groups/s, "
                                                    f"x{r['makespan_s_ratio']:.3f} makespan)" if "makespan_s_ratio" in r
                                                    else ""), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", type=int, default=8, help="simulated engines of the capacity study")
    p.add_argument("--seqs", type=int, default=16, help="sequences each of them runs at once")
    p.add_argument("--agreement-engines", type=int, default=4, help="simulated engines of the agreement study")
    p.add_argument("--quick", action="store_true", help="smaller runs (a test's size)")
    p.add_argument("--report", help="write bench_capacity.json here")
    args = p.parse_args(argv)
    steps, groups = (1, 8) if args.quick else (4, 64)
    size = "median=100,sigma=0.3,tail_prob=0,prompt_median=16"
    cap_workload = f"synthetic:{size},groups_per_step={64 if args.quick else 512},steps={steps}"
    doc = {"capacity": capacity(args.engines, args.seqs, cap_workload, steps),
           "agreement": agreement(args.agreement_engines, "math", 2 if args.quick else 3, groups, 0.05 if args.quick else 0.1)}
    if args.report:
        os.makedirs(args.report, exist_ok=True)
        (Path(args.report) / "bench_capacity.json").write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
