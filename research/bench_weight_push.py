"""Weight-push throughput over loopback: gRPC stream vs same-host file path,
against a plain in-memory copy of the same bytes (the limit).

Simulated engines apply weights instantly, so the figures measure transport,
verification and staging, not an engine's reload.

The first table pushes ~10M and ~100M parameters with the client's defaults,
client and service in one process. The second (`--matrix`, on by default)
pushes a 1 GiB float32 state dict to 2 simulated engines in a service of its
own process (as a trainer and the service run), end to end (the client's
call until the version is live on both engines), for each checksum
algorithm and chunk size side by side, plus the same-host file path and,
as the ceiling, a bare grpc.aio stream of the same bytes in pre-built
messages to a process that only counts them ("raw": gRPC's own cost). With
`--stall`, a request generates throughout on those engines: "stall ms" is the
longest gap between its token deltas across a cell's pushes ("token gap ms":
the usual gap), i.e. how long generation waited on the push.

    python -m research.bench_weight_push [--quick] [--report DIR]
        [--no-matrix] [--matrix-gib 1] [--chunks-mb 1,4,8,16] [--repeats 2]
        [--checksums none,xxh3,sha256] [--digests trailer|header|both] [--stall]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from rollout_service.config import EngineConfig, ServiceConfig
from rollout_service.engines.weights import WeightTensor, write_safetensors
from rollout_service.service import RolloutService
from trainer_client import RolloutClient

# Where the fast-path files are written (the service may read only listed directories).
PUSH_FILE_DIRS = ["/dev/shm", tempfile.gettempdir()]


def state_dict(params: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Qwen-like tensors (float32) adding up to about `params` parameters."""
    rng = np.random.default_rng(seed)
    hidden = 512 if params < 50_000_000 else 1024
    out, total, i = {}, 0, 0
    while total < params:
        shape = (hidden * 4, hidden) if i % 2 else (hidden, hidden)
        out[f"model.layers.{i // 2}.w{i % 2}"] = rng.standard_normal(shape, dtype=np.float32)
        total += shape[0] * shape[1]
        i += 1
    return out


async def measure(params: int) -> dict:
    sd = state_dict(params)
    nbytes = sum(a.nbytes for a in sd.values())
    cfg = ServiceConfig(grpc_port=0, http_port=0, max_message_mb=64, weights_file_dirs=PUSH_FILE_DIRS,
                        engine=EngineConfig(kind="sim", num_engines=2, sim={"weight_update_s": 0.0}))
    service = RolloutService(cfg)
    await service.start()
    try:
        async with RolloutClient(f"127.0.0.1:{service.grpc_port}") as client:
            t = time.perf_counter()
            reply = await client.push_weights(sd, version=1)
            stream_s = time.perf_counter() - t
            assert reply.applied_version == 1
            directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
            with tempfile.NamedTemporaryFile(suffix=".safetensors", dir=directory) as f:
                tensors = [WeightTensor(k, "float32", v.shape, memoryview(v).cast("B")) for k, v in sd.items()]
                t = time.perf_counter()
                write_safetensors(f.name, tensors)  # the trainer's side of the fast path
                reply = await client.push_weights_file(f.name, version=2)
                file_s = time.perf_counter() - t
                assert reply.applied_version == 2
    finally:
        await service.stop()
    t = time.perf_counter()
    copies = {k: v.copy() for k, v in sd.items()}
    copy_s = time.perf_counter() - t
    del copies
    mb = nbytes / 1e6
    return {
        "params": sum(a.size for a in sd.values()),
        "megabytes": round(mb, 1),
        "grpc_stream_s": round(stream_s, 3),
        "grpc_stream_mb_per_s": round(mb / stream_s, 1),
        "file_path_s": round(file_s, 3),
        "file_path_mb_per_s": round(mb / file_s, 1),
        "memcpy_s": round(copy_s, 4),
        "memcpy_mb_per_s": round(mb / copy_s, 1),
    }


async def _watch_tokens(service, stamps: list[float]) -> None:
    """Generate without end on the service's engines, noting when each
    token delta arrives (time.monotonic, comparable across processes)."""
    from rollout_service.engines.types import SamplingParams
    from rollout_service.lifecycle.types import GroupSpec

    group = service.core.submit_private(GroupSpec(group_id="", prompt_token_ids=[1, 2, 3], num_samples=1,
                                                  sampling=SamplingParams(max_tokens=1 << 30, ignore_eos=True)))
    while True:
        await group.listener.get()
        stamps.append(time.monotonic())


def _gaps(stamps: list[float], windows: list[tuple[float, float]]) -> tuple[float, float]:
    """(median gap between token deltas outside the windows, longest gap
    overlapping any window), in seconds."""
    gaps = [(a, b) for a, b in zip(stamps, stamps[1:])]
    inside = [b - a for a, b in gaps if any(a < w1 and b > w0 for w0, w1 in windows)]
    outside = [b - a for a, b in gaps if not any(a < w1 and b > w0 for w0, w1 in windows)]
    return (statistics.median(outside) if outside else 0.0), (max(inside) if inside else 0.0)


def _serve(conn, max_message_mb: int, stall: bool = False) -> None:
    """The service, in a process of its own: sends its port, runs until told to stop."""

    async def run() -> None:
        # A token delta every engine step (~4 ms), for the stall measurement.
        cfg = ServiceConfig(grpc_port=0, http_port=0, max_message_mb=max_message_mb, weights_file_dirs=PUSH_FILE_DIRS,
                            engine=EngineConfig(kind="sim", num_engines=2,
                                                sim={"weight_update_s": 0.0, "max_run_steps": 1}))
        service = RolloutService(cfg)
        await service.start()
        stamps: list[float] = []
        watcher = asyncio.ensure_future(_watch_tokens(service, stamps)) if stall else None
        conn.send(service.grpc_port)
        # "cpu": this process's CPU seconds so far (every thread); ("gaps",
        # windows): token-delta gaps (see _gaps); "stop".
        while (cmd := await asyncio.get_running_loop().run_in_executor(None, conn.recv)) != "stop":
            if cmd == "cpu":
                conn.send(time.process_time())
            else:
                conn.send(_gaps(stamps, cmd[1]))
        if watcher is not None:
            watcher.cancel()
        await service.stop()

    asyncio.run(run())


def _stop(parent, proc) -> None:
    """Tell a server process to stop; kill it if it has not within 30 s."""
    parent.send("stop")
    proc.join(30)
    if proc.is_alive():
        proc.kill()


def _raw_sink(conn) -> None:
    """A bare grpc.aio server whose one method counts the bytes of a stream
    of raw messages (no protobuf, no checksums, no staging): what gRPC
    itself costs, the ceiling of a push over gRPC on this host."""
    import grpc

    async def run() -> None:
        async def sink(messages, context) -> bytes:
            n = 0
            async for m in messages:
                n += len(m)
            return str(n).encode()

        handler = grpc.method_handlers_generic_handler(
            "bench.Sink", {"Push": grpc.stream_unary_rpc_method_handler(sink)})
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
        server.add_generic_rpc_handlers((handler,))
        conn.send(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        loop = asyncio.get_running_loop()
        while (cmd := await loop.run_in_executor(None, conn.recv)) != "stop":
            conn.send(time.process_time())
        await server.stop(None)

    asyncio.run(run())


async def _raw_grpc(nbytes: int, chunk_mbs: list[float], repeats: int) -> list[dict]:
    """The reference rows: `nbytes` as pre-built messages of each chunk size
    over a bare grpc.aio stream to a process that only counts them."""
    import grpc

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_raw_sink, args=(child,), daemon=True)
    proc.start()
    loop = asyncio.get_running_loop()

    async def server_cpu() -> float:
        parent.send("cpu")
        return await loop.run_in_executor(None, parent.recv)

    rows = []
    try:
        port = await loop.run_in_executor(None, parent.recv)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                             options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
            push = channel.stream_unary("/bench.Sink/Push")
            for chunk_mb in chunk_mbs:
                size = int(chunk_mb * 1024 * 1024)
                payload = os.urandom(size)
                count = -(-nbytes // size)

                async def messages():
                    for _ in range(count):
                        yield payload

                times, cpu = [], []
                for _ in range(repeats):
                    c0, s0 = time.process_time(), await server_cpu()
                    t = time.perf_counter()
                    assert int(await push(messages())) == count * size
                    times.append(time.perf_counter() - t)
                    cpu.append((time.process_time() - c0, await server_cpu() - s0))
                rows.append(dict(_row("raw", "none", chunk_mb, count * size, times, cpu), engines=0))
    finally:
        _stop(parent, proc)
    return rows


def _gib_state_dict(gib: float) -> dict[str, np.ndarray]:
    """float32 tensors of 4096 x 4096 (64 MiB) and 4096 x 1024 adding up to `gib` GiB."""
    rng = np.random.default_rng(1)
    out, total, i = {}, 0, 0
    while total < gib * 1024**3:
        shape = (4096, 4096) if i % 4 else (4096, 1024)
        out[f"model.layers.{i // 4}.w{i % 4}"] = rng.random(shape, dtype=np.float32)
        total += shape[0] * shape[1] * 4
        i += 1
    return out


async def _matrix(gib: float, chunk_mbs: list[float], repeats: int,
                  algos: tuple = (False, "xxh3", "sha256"), digests: tuple = ("trailer",),
                  stall: bool = False) -> list[dict]:
    sd = _gib_state_dict(gib)
    nbytes = sum(a.nbytes for a in sd.values())
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child, 64, stall), daemon=True)
    proc.start()
    rows: list[dict] = []
    loop = asyncio.get_running_loop()

    async def server_cpu() -> float:
        parent.send("cpu")
        return await loop.run_in_executor(None, parent.recv)

    async def token_gaps(windows: list[tuple[float, float]]) -> tuple[float, float]:
        parent.send(("gaps", windows))
        return await loop.run_in_executor(None, parent.recv)

    try:
        port = await loop.run_in_executor(None, parent.recv)
        async with RolloutClient(f"127.0.0.1:{port}", max_message_mb=64) as client:
            await client.wait_ready()
            version = 0
            await client.push_weights({"warmup": np.ones(1024, np.float32)}, version=(version := version + 1))
            for checksums in algos:
                for chunk_mb in chunk_mbs:
                    for where in digests if checksums else ("-",):
                        times, cpu, windows = [], [], []
                        for _ in range(repeats):
                            c0, s0 = time.process_time(), await server_cpu()
                            t, m = time.perf_counter(), time.monotonic()
                            reply = await client.push_weights(sd, version=(version := version + 1),
                                                              chunk_mb=chunk_mb, checksums=checksums,
                                                              checksum_trailer=where == "trailer")
                            times.append(time.perf_counter() - t)
                            windows.append((m, time.monotonic()))
                            cpu.append((time.process_time() - c0, await server_cpu() - s0))
                            assert reply.applied_version == version
                        rows.append(_row("grpc", checksums or "none", chunk_mb, nbytes, times, cpu, where,
                                         await token_gaps(windows)))
            directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
            times, cpu, windows = [], [], []
            for _ in range(repeats):
                with tempfile.NamedTemporaryFile(suffix=".safetensors", dir=directory) as f:
                    tensors = [WeightTensor(k, "float32", v.shape, memoryview(v).cast("B")) for k, v in sd.items()]
                    c0, s0 = time.process_time(), await server_cpu()
                    t = time.perf_counter()
                    write_safetensors(f.name, tensors)  # the trainer's side of the fast path
                    m = time.monotonic()  # the service's part: from the call
                    reply = await client.push_weights_file(f.name, version=(version := version + 1))
                    times.append(time.perf_counter() - t)
                    windows.append((m, time.monotonic()))
                    cpu.append((time.process_time() - c0, await server_cpu() - s0))
                    assert reply.applied_version == version
            rows.append(_row("file", "none", 0, nbytes, times, cpu, gaps=await token_gaps(windows)))
    finally:
        _stop(parent, proc)
    return rows


def _row(path: str, checksums: str, chunk_mb: float, nbytes: int, times: list[float],
         cpu: list[tuple[float, float]], digests: str = "-", gaps: tuple[float, float] = (0.0, 0.0)) -> dict:
    """Wall-clock figures, CPU seconds per GB on each side (every thread of
    the process; less sensitive to other load on the host), and the
    generation stall: the longest gap between a running request's token
    deltas across the pushes, against the usual gap."""
    best = min(times)
    gb = nbytes / 1e9
    return {"path": path, "checksums": checksums, "digests": digests, "chunk_mb": chunk_mb, "bytes": nbytes, "engines": 2,
            "best_s": round(best, 3), "mean_s": round(statistics.fmean(times), 3),
            "best_gb_per_s": round(gb / best, 2), "mean_gb_per_s": round(gb / statistics.fmean(times), 2),
            "client_cpu_s_per_gb": round(min(c for c, _ in cpu) / gb, 2),
            "server_cpu_s_per_gb": round(min(s for _, s in cpu) / gb, 2),
            "token_gap_median_ms": round(gaps[0] * 1e3, 1), "token_gap_max_ms": round(gaps[1] * 1e3, 1),
            "runs": len(times)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="only the ~10M-parameter state dict")
    p.add_argument("--report", help="directory for weight_push.json (and weight_push_matrix.json)")
    p.add_argument("--no-matrix", action="store_true", help="skip the 1 GiB checksum x chunk size table")
    p.add_argument("--matrix-gib", type=float, default=1.0, help="size of the matrix's state dict, GiB")
    p.add_argument("--chunks-mb", default="1,4,8,16", help="chunk sizes of the matrix, MiB")
    p.add_argument("--repeats", type=int, default=2, help="pushes per matrix cell (best and mean reported)")
    p.add_argument("--checksums", default="none,xxh3,sha256", help="checksum choices of the matrix")
    p.add_argument("--stall", action="store_true",
                   help="generate on the engines throughout and report the longest gap in the token deltas across "
                        "each cell's pushes (costs the service some CPU: compare throughput without it)")
    p.add_argument("--digests", default="trailer",
                   help="where the digests go: trailer (after the data, hashed while streaming; the default), "
                        "header (hashed before streaming, as clients before the trailer), or both")
    args = p.parse_args()
    sizes = [10_000_000] if args.quick else [10_000_000, 100_000_000]
    rows = []
    print(f"{'params':>12}{'MB':>8}{'gRPC s':>9}{'MB/s':>8}{'file s':>9}{'MB/s':>8}{'memcpy MB/s':>13}")
    for n in sizes:
        r = asyncio.run(measure(n))
        rows.append(r)
        print(f"{r['params']:>12,}{r['megabytes']:>8.0f}{r['grpc_stream_s']:>9.2f}{r['grpc_stream_mb_per_s']:>8.0f}"
              f"{r['file_path_s']:>9.2f}{r['file_path_mb_per_s']:>8.0f}{r['memcpy_mb_per_s']:>13.0f}", flush=True)
    if args.report:
        Path(args.report).mkdir(parents=True, exist_ok=True)
        (Path(args.report) / "weight_push.json").write_text(json.dumps(rows, indent=2))
    if args.no_matrix:
        return
    chunk_mbs = [float(c) for c in args.chunks_mb.split(",")]
    load_before = os.getloadavg()
    algos = tuple(False if c == "none" else c for c in args.checksums.split(","))
    digests = ("header", "trailer") if args.digests == "both" else tuple(args.digests.split(","))
    matrix = asyncio.run(_matrix(args.matrix_gib, chunk_mbs, args.repeats, algos, digests, args.stall))
    matrix += asyncio.run(_raw_grpc(int(args.matrix_gib * 1024**3), chunk_mbs, args.repeats))
    load_after = os.getloadavg()
    print(f"\n{args.matrix_gib:g} GiB float32 to 2 sim engines, service in its own process, end to end "
          f"(best / mean of {args.repeats}); load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    print(f"{'path':>6}{'checksums':>11}{'digests':>9}{'chunk MiB':>11}{'best s':>9}{'GB/s':>7}{'mean s':>9}{'GB/s':>7}"
          f"{'client CPU s/GB':>17}{'server CPU s/GB':>17}{'token gap ms':>14}{'stall ms':>10}")
    for r in matrix:
        chunk = f"{r['chunk_mb']:g}" if r["path"] in ("grpc", "raw") else "-"
        print(f"{r['path']:>6}{r['checksums']:>11}{r['digests']:>9}{chunk:>11}{r['best_s']:>9.3f}{r['best_gb_per_s']:>7.2f}"
              f"{r['mean_s']:>9.3f}{r['mean_gb_per_s']:>7.2f}{r['client_cpu_s_per_gb']:>17.2f}"
              f"{r['server_cpu_s_per_gb']:>17.2f}{r['token_gap_median_ms']:>14.1f}{r['token_gap_max_ms']:>10.1f}")
    if args.report:
        (Path(args.report) / "weight_push_matrix.json").write_text(json.dumps(
            {"loadavg_before": load_before, "loadavg_after": load_after, "rows": matrix}, indent=2))


if __name__ == "__main__":
    from research.interrupt import stop_on_sigterm

    stop_on_sigterm()
    main()
