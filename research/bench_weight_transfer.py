"""Weight transfer into real vLLM CPU engines, per path, side by side:
gRPC stream (`push_weights`), same-host file (`push_weights_file`) and the
collective path (`push_weights_collective`, gloo), against a raw
`torch.distributed` gloo broadcast of the same bytes to as many receivers.

For each model size and engine count a service runs in a process of its own
(as a trainer and the service run), on vLLM CPU engines each bound to its
own core(s). Per push: the time from the trainer's call to the version being
live on every engine, the bytes the trainer sent, and the generation stall:
the longest gap in token progress of requests running across the push (the
inter-token gap without a push is printed next to it), and how long the
engines were paused to apply the push ("paused s": the apply itself, from
pausing generation to resuming it; the longest of the engines').
`collective-direct` is the collective path with `engine.collective_receive =
"direct"` (loaded as received, generation paused for the transfer).

    python -m research.bench_weight_transfer [--sizes tiny,tail,size]
        [--engines 1,2,4] [--paths grpc,file,collective,collective-direct] [--repeats 2]
        [--models DIR] [--report DIR]

Sizes: `tiny` is the bundled model (~1M parameters); `tail` (0.1B, 405 MB
float32) and `size` (0.5B, 2 GB) are built with `rollout-service
build-model --preset ...` into --models (reused when present).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SIZES = ("tiny", "tail", "size")
# "collective-direct": the collective path with engine.collective_receive =
# "direct" (loaded as received, generation paused for the transfer).
PATHS = ("grpc", "file", "collective", "collective-direct")
# Where the fast-path files are written (the service may read only listed directories).
PUSH_FILE_DIRS = ["/dev/shm", tempfile.gettempdir()]


def model_dir(size: str, models: Path) -> str:
    from rollout_service.assets import tiny_model_path

    if size == "tiny":
        return str(tiny_model_path())
    out = models / size
    if not (out / "model.safetensors").exists():
        subprocess.run([sys.executable, "-m", "rollout_service.cli", "build-model", "--preset", size, "--out", str(out)],
                       check=True)
    return str(out)


def load_weights(path: str, seed: int) -> dict:
    """The model's weights, every 2-D tensor perturbed (so each push changes them)."""
    import torch
    from safetensors.torch import load_file

    w = load_file(os.path.join(path, "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for k, v in w.items():
        if v.ndim == 2:
            v.add_(torch.randn(v.shape, generator=g), alpha=1e-3 * float(v.std()))
    return w


# -- the service's process ---------------------------------------------------------


def _serve(conn, model: str, engines: int) -> None:
    from rollout_service.config import EngineConfig, ServiceConfig
    from rollout_service.service import RolloutService

    async def run() -> None:
        cfg = ServiceConfig(grpc_port=0, http_port=0, max_message_mb=64, weights_file_dirs=PUSH_FILE_DIRS,
                            engine=EngineConfig(kind="vllm", num_engines=engines, model=model, max_model_len=1024,
                                                max_seqs=8, kv_cache_gib=0.25))
        service = RolloutService(cfg)
        await service.start()
        from rollout_service.engines.types import EngineRequest, SamplingParams

        # A probe request per engine, generating until told to stop, outside
        # the scheduler: the gaps between its token deltas are the stall.
        stamps: dict[str, list[float]] = {}
        probes: list[asyncio.Task] = []

        async def probe(engine, rid: str) -> None:
            req = EngineRequest(rid, [1, 40, 41, 42], [], SamplingParams(max_tokens=1000, ignore_eos=True),
                                max_new_tokens=1000)
            async for delta in engine.add(req):
                if delta.token_ids:
                    stamps[rid].append(time.perf_counter())

        conn.send(service.grpc_port)
        loop = asyncio.get_running_loop()
        n = 0
        try:
            while True:
                cmd = await loop.run_in_executor(None, conn.recv)
                if cmd == "stop":
                    break
                if isinstance(cmd, tuple) and cmd[0] == "receive":  # engine.collective_receive
                    for engine in service.core.fleet.engines.values():
                        engine.collective_receive = cmd[1]
                    conn.send(None)
                elif cmd == "mark":  # start the probes
                    for engine in service.core.fleet.engines.values():
                        n += 1
                        rid = f"probe-{n}"
                        stamps[rid] = []
                        probes.append(asyncio.create_task(probe(engine, rid)))
                    await asyncio.sleep(1.0)
                    conn.send(None)
                elif cmd == "gaps":  # (longest gap between a probe's deltas, median gap)
                    for engine in service.core.fleet.engines.values():
                        for rid in list(stamps):
                            await engine.abort(rid)
                    for task in probes:
                        task.cancel()
                    await asyncio.gather(*probes, return_exceptions=True)
                    probes.clear()
                    gaps = [b - a for ts in stamps.values() for a, b in zip(ts, ts[1:])]
                    stamps.clear()
                    paused = max(e.paused_s for e in service.core.fleet.engines.values())
                    conn.send((max(gaps, default=0.0), statistics.median(gaps) if gaps else 0.0, paused))
        finally:
            await service.stop()

    asyncio.run(run())


# -- the raw reference ---------------------------------------------------------------


def _raw_rank(rank: int, world: int, port: int, nbytes: int, chunk: int, out) -> None:
    import torch

    from rollout_proto import collective as wire

    pg, store = wire.open_group("gloo", "127.0.0.1", port, rank, world, 120)
    buf = torch.empty(min(chunk, nbytes), dtype=torch.uint8)
    if rank == 0:
        buf.fill_(7)
    pg.barrier().wait()
    t = time.perf_counter()
    left = nbytes
    while left > 0:
        n = min(chunk, left)
        pg.broadcast(buf[:n], 0).wait()
        left -= n
    pg.barrier().wait()
    if rank == 0:
        out.put(time.perf_counter() - t)


def raw_broadcast_s(nbytes: int, receivers: int, chunk: int) -> float:
    """A plain gloo broadcast of `nbytes` (in `chunk`-byte pieces) from one
    process to `receivers` others."""
    from trainer_client.collective import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_raw_rank, args=(r, receivers + 1, port, nbytes, chunk, out))
             for r in range(receivers + 1)]
    for p in procs:
        p.start()
    seconds = out.get(timeout=600)
    for p in procs:
        p.join(60)
    return seconds


# -- the trainer's side ----------------------------------------------------------------


async def case(size: str, model: str, engines: int, paths: list[str], repeats: int, chunk_mb: float) -> list[dict]:
    from trainer_client import RolloutClient

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child, model, engines))  # not daemonic: it starts engines
    proc.start()
    loop = asyncio.get_running_loop()

    async def ask(cmd):
        parent.send(cmd)
        return await loop.run_in_executor(None, parent.recv)

    rows = []
    try:
        if not await loop.run_in_executor(None, parent.poll, 900):
            raise RuntimeError("the service did not start within 900 s")
        port = parent.recv()
        import torch

        w = load_weights(model, 1)  # one copy, nudged before each push (memory)
        nbytes = sum(t.numel() * t.element_size() for t in w.values())
        g = torch.Generator().manual_seed(2)
        async with RolloutClient(f"127.0.0.1:{port}", max_message_mb=64) as client:
            await client.wait_ready(600)
            version = (await client.status()).policy_version
            for path in paths:
                await ask(("receive", "direct" if path == "collective-direct" else "staged"))
                times, sent, stalls, steps, pauses = [], [], [], [], []
                for r in range(repeats + 1):  # the first push warms up (and forms the group)
                    for t in w.values():
                        if t.ndim == 2:
                            t.view(-1)[:1024].add_(torch.randn(min(1024, t.numel()), generator=g), alpha=1e-4)
                    await ask("mark")
                    version += 1
                    t = time.perf_counter()
                    if path == "grpc":
                        reply = await client.push_weights(w, version)
                        bytes_sent = nbytes
                    elif path == "file":
                        from safetensors.torch import save_file

                        directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
                        with tempfile.NamedTemporaryFile(suffix=".safetensors", dir=directory) as f:
                            save_file(w, f.name)  # the trainer's side of the fast path
                            reply = await client.push_weights_file(f.name, version)
                        bytes_sent = 0  # written to a file, not sent
                    else:
                        reply = await client.push_weights_collective(w, version, timeout_s=300, chunk_mb=chunk_mb)
                        bytes_sent = reply.bytes_received
                    seconds = time.perf_counter() - t
                    assert reply.applied_version == version
                    await asyncio.sleep(0.5)
                    stall, step, paused = await ask("gaps")
                    if r:
                        times.append(seconds)
                        sent.append(bytes_sent)
                        stalls.append(stall)
                        steps.append(step)
                        pauses.append(paused)
                rows.append({"size": size, "engines": engines, "path": path, "bytes": nbytes,
                             "seconds": statistics.median(times), "gb_per_s": nbytes / statistics.median(times) / 1e9,
                             "trainer_bytes_sent": int(statistics.median(sent)), "stall_s": max(stalls),
                             "step_s": statistics.median(steps), "paused_s": max(pauses), "repeats": repeats})
                print(_fmt(rows[-1]), flush=True)
            await client.close_collective()
        ref = raw_broadcast_s(nbytes, engines, int(chunk_mb * 1024 * 1024))
        rows.append({"size": size, "engines": engines, "path": "raw gloo broadcast", "bytes": nbytes, "seconds": ref,
                     "gb_per_s": nbytes / ref / 1e9, "trainer_bytes_sent": nbytes * engines, "stall_s": None,
                     "step_s": None, "paused_s": None, "repeats": 1})
        print(_fmt(rows[-1]), flush=True)
    finally:
        if proc.is_alive():
            parent.send("stop")
        proc.join(120)
        if proc.is_alive():
            proc.kill()
    return rows


HEADER = (f"{'size':>5} {'eng':>3} {'path':>19} {'MB':>8} {'s to live':>9} {'GB/s':>6} {'trainer MB':>10} "
          f"{'stall s':>8} {'paused s':>8} {'step s':>7}")


def _fmt(r: dict) -> str:
    stall = f"{r['stall_s']:8.3f}" if r["stall_s"] is not None else f"{'-':>8}"
    step = f"{r['step_s']:7.3f}" if r["step_s"] is not None else f"{'-':>7}"
    paused = f"{r['paused_s']:8.3f}" if r.get("paused_s") is not None else f"{'-':>8}"
    return (f"{r['size']:>5} {r['engines']:>3} {r['path']:>19} {r['bytes'] / 1e6:8.1f} {r['seconds']:9.3f} "
            f"{r['gb_per_s']:6.2f} {r['trainer_bytes_sent'] / 1e6:10.1f} {stall} {paused} {step}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,tail")
    ap.add_argument("--engines", default="1,2,4")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--chunk-mb", type=float, default=32.0)
    ap.add_argument("--models", default=os.path.join(tempfile.gettempdir(), "rollout-bench-models"))
    ap.add_argument("--report", default=None)
    args = ap.parse_args()
    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {os.cpu_count()} CPUs")
    print(HEADER)
    rows: list[dict] = []

    def report(after=None) -> None:  # after every case, so that a cut-short run keeps its figures
        if args.report:
            out = Path(args.report)
            out.mkdir(parents=True, exist_ok=True)
            (out / "weight_transfer.json").write_text(json.dumps(
                {"load_before": load, "load_after": after, "rows": rows}, indent=1))

    for size in args.sizes.split(","):
        model = model_dir(size, Path(args.models))
        for n in [int(x) for x in args.engines.split(",")]:
            try:
                rows += asyncio.run(case(size, model, n, args.paths.split(","), args.repeats, args.chunk_mb))
            except Exception as exc:  # e.g. out of memory: say so and go on
                print(f"{size} x {n} engines: failed: {type(exc).__name__}: {exc}", flush=True)
                rows.append({"size": size, "engines": n, "failed": f"{type(exc).__name__}: {exc}"})
            report()
    after = os.getloadavg()
    print(f"load average after: {after[0]:.2f} {after[1]:.2f} {after[2]:.2f}")
    report(after)


if __name__ == "__main__":
    from research.interrupt import stop_on_sigterm

    stop_on_sigterm()
    threading.current_thread().name = "bench"
    main()
