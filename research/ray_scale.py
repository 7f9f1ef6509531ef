"""The scheduler's own overhead with 8 to 256 engines as Ray actors.

This process runs the service (gRPC server, core, scheduler, the Ray
driver) on simulated engines hosted by Ray actors; a trainer in a
subprocess keeps a fixed number of samples in flight over gRPC (closed
loop: a new group as soon as enough samples came back). After a warm-up,
one measured window per fleet size records:

  samples/s        samples delivered
  decisions/s      placements made by the scheduler (requests started on an engine)
  dispatch us      server time per placement pass, and per decision
  server ms/sample CPU time of this process (every thread: asyncio, gRPC, Ray's
                   core worker) per delivered sample
  server/actors CPU  cores busy in this process / in all actor processes
  Ray hops/sample  actor calls (add, abort, weights) and stream batches received
  gRPC msgs/sample Submit calls, streamed samples and acks, as the trainer counts them
  loop lag p99     how late a 10 ms timer fires on the server's event loop

Engines run `engines_per_actor` to an actor process (8 actor processes in
all): 256 Ray worker processes of ~150 MB each do not fit this machine
beside the rest, and the number of processes does not change the server's
per-sample work (one stream per actor, one `add` per request). Sampling
lengths are short so that the server, not the engines, is what is loaded.

    python -m research.ray_scale [--engines 8,16,32,64,128,256] [--seconds 10] [--report DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from research.report import save_json

ACTORS = 8
SIM = {"decode_base_s": 0.004, "decode_per_seq_s": 0.00015, "length_median": 24, "length_sigma": 0.5,
       "weight_update_s": 0.0}
GROUP = 8  # samples per group


# -- the trainer (a subprocess) ------------------------------------------------------------


async def trainer(address: str, in_flight: int, out_path: str) -> None:
    from trainer_client import PromptGroup, RolloutClient

    counts = {"submits": 0, "samples": 0, "acks": 0, "submitted": 0}
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with RolloutClient(address, consumer_id="scale") as client:
        await client.wait_ready(120)
        original_ack = client.ack

        async def counted_ack(cursor=None):
            counts["acks"] += 1
            return await original_ack(cursor)

        client.ack = counted_ack
        n = 0

        async def top_up():
            nonlocal n
            missing = in_flight - (counts["submitted"] - counts["samples"])
            groups = max(0, missing // GROUP)
            if groups:
                await client.submit([PromptGroup(prompt_token_ids=[1, 5 + i % 50, 7], num_samples=GROUP, max_tokens=200,
                                                 group_id=f"s{n + i}") for i in range(groups)])
                n += groups
                counts["submits"] += 1
                counts["submitted"] += groups * GROUP

        async def consume():
            async for _ in client.stream(ack_every=64):
                counts["samples"] += 1
                if counts["samples"] % GROUP == 0:
                    await top_up()

        await top_up()
        task = asyncio.create_task(consume())
        await stop.wait()
        task.cancel()
    Path(out_path).write_text(json.dumps(counts))


# -- the server side -------------------------------------------------------------------------


async def measure(num_engines: int, in_flight: int, warmup_s: float, seconds: float) -> dict:
    from rollout_service.config import EngineConfig, RayConfig, ServiceConfig
    from rollout_service.service import RolloutService

    per_actor = max(1, num_engines // ACTORS)
    cfg = ServiceConfig(grpc_port=0, http_port=0, log_level="WARNING", engine=EngineConfig(
        kind="sim", num_engines=num_engines, max_seqs=64, sim=dict(SIM), placement_backend="ray",
        ray=RayConfig(cpus_per_engine=0.01, engines_per_actor=per_actor)))
    service = RolloutService(cfg)
    t0 = time.perf_counter()
    await service.start()
    start_s = time.perf_counter() - t0
    core = service.core
    timing = {"passes": 0, "decisions": 0, "seconds": 0.0}
    dispatch = core.dispatch

    def timed_dispatch():
        t = time.perf_counter()
        before = len(core.running)
        dispatch()
        timing["seconds"] += time.perf_counter() - t
        timing["passes"] += 1
        timing["decisions"] += max(0, len(core.running) - before)

    core.dispatch = timed_dispatch
    lags: list[float] = []

    async def lag_probe():
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            lags.append(time.perf_counter() - t - 0.01)

    fd, name = tempfile.mkstemp(prefix="ray-scale-", suffix=".json")
    os.close(fd)
    out = Path(name)
    client = subprocess.Popen([sys.executable, "-m", "research.ray_scale", "--trainer", f"127.0.0.1:{service.grpc_port}",
                               "--in-flight", str(in_flight), "--out", str(out)])
    probe = asyncio.create_task(lag_probe())
    import psutil

    actors = [psutil.Process(pid) for pid in {e.host.info["pid"] for e in core.engines.values()}]

    def actors_cpu() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in actors)

    try:
        await asyncio.sleep(warmup_s)
        a0 = actors_cpu()
        c0, cpu0, w0 = dict(core.counters), time.process_time(), time.perf_counter()
        t0 = dict(timing)
        lags.clear()
        await asyncio.sleep(seconds)
        c1, cpu1, w1 = dict(core.counters), time.process_time(), time.perf_counter()
        a1 = actors_cpu()
        t1 = dict(timing)
        lag = sorted(lags)
    finally:
        probe.cancel()
        client.send_signal(signal.SIGTERM)
        await asyncio.to_thread(client.wait, 60)
        await service.stop()
    trainer_counts = json.loads(out.read_text())
    out.unlink()
    wall = w1 - w0

    def d(key):
        return c1.get(key, 0) - c0.get(key, 0)

    samples = d("samples_completed")
    decisions = t1["decisions"] - t0["decisions"]
    passes = t1["passes"] - t0["passes"]
    dispatch_s = t1["seconds"] - t0["seconds"]
    grpc_msgs = trainer_counts["submits"] + trainer_counts["samples"] + trainer_counts["acks"]
    return {
        "engines": num_engines, "actors": -(-num_engines // per_actor), "in_flight": in_flight,
        "start_s": round(start_s, 1),
        "samples_per_s": round(samples / wall, 1),
        "decisions_per_s": round(decisions / wall, 1),
        "dispatch_us_per_pass": round(1e6 * dispatch_s / max(1, passes), 1),
        "dispatch_us_per_decision": round(1e6 * dispatch_s / max(1, decisions), 1),
        "server_cpu_ms_per_sample": round(1e3 * (cpu1 - cpu0) / max(1, samples), 3),
        "server_cpu_util": round((cpu1 - cpu0) / wall, 2),
        "actors_cpu_util": round((a1 - a0) / wall, 2),
        "ray_calls_per_sample": round(d("ray_calls") / max(1, samples), 2),
        "ray_batches_per_sample": round(d("ray_stream_items") / max(1, samples), 2),
        "ray_events_per_sample": round(d("ray_events") / max(1, samples), 2),
        "grpc_msgs_per_sample": round(grpc_msgs / max(1, trainer_counts["samples"]), 3),
        "loop_lag_p99_ms": round(1e3 * lag[int(0.99 * (len(lag) - 1))], 1) if lag else None,
        "requeued": d("requests_requeued"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default="8,16,32,64,128,256")
    p.add_argument("--in-flight-per-engine", type=int, default=8, help="samples kept in flight per engine")
    p.add_argument("--max-in-flight", type=int, default=1024)
    p.add_argument("--warmup", type=float, default=4.0)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--report", help="directory for ray_scale.json")
    p.add_argument("--trainer", help=argparse.SUPPRESS)  # the subprocess: the server's address
    p.add_argument("--in-flight", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trainer:
        asyncio.run(trainer(args.trainer, args.in_flight, args.out))
        return
    import ray

    ray.init(num_cpus=64, include_dashboard=False, log_to_driver=False, object_store_memory=256 * 1024**2)
    rows = []
    header = (f"{'engines':>8}{'actors':>7}{'in flight':>10}{'samples/s':>10}{'decisions/s':>12}{'us/pass':>9}"
              f"{'us/decision':>12}{'server ms/sample':>17}{'server CPU':>11}{'actors CPU':>11}{'Ray calls':>10}{'Ray batches':>12}"
              f"{'gRPC msgs':>10}{'lag p99 ms':>11}")
    print(header, flush=True)
    try:
        for n in [int(x) for x in args.engines.split(",")]:
            in_flight = min(args.max_in_flight, n * args.in_flight_per_engine)
            r = asyncio.run(measure(n, in_flight, args.warmup, args.seconds))
            rows.append(r)
            print(f"{r['engines']:>8}{r['actors']:>7}{r['in_flight']:>10}{r['samples_per_s']:>10.0f}{r['decisions_per_s']:>12.0f}"
                  f"{r['dispatch_us_per_pass']:>9.0f}{r['dispatch_us_per_decision']:>12.1f}{r['server_cpu_ms_per_sample']:>17.2f}"
                  f"{r['server_cpu_util']:>11.2f}{r['actors_cpu_util']:>11.2f}{r['ray_calls_per_sample']:>10.2f}{r['ray_batches_per_sample']:>12.2f}"
                  f"{r['grpc_msgs_per_sample']:>10.2f}{r['loop_lag_p99_ms']:>11}", flush=True)
    finally:
        ray.shutdown()
    save_json(args.report, "ray_scale.json", rows)


if __name__ == "__main__":
    main()
