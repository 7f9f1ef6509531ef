"""Weight-push throughput over loopback: gRPC stream vs same-host file path,
against a plain in-memory copy of the same bytes (the limit).

Simulated engines apply weights instantly, so the figures measure transport,
verification (sha256 of every tensor) and staging, not an engine's reload.

    python -m load_tests.bench_weight_push [--quick] [--report DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from rollout_service.config import EngineConfig, ServiceConfig
from rollout_service.engines.weights import WeightTensor, write_safetensors
from rollout_service.service import RolloutService
from trainer_client import RolloutClient


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
    cfg = ServiceConfig(grpc_port=0, http_port=0, max_message_mb=64,
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="only the ~10M-parameter state dict")
    p.add_argument("--report", help="directory for weight_push.json")
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


if __name__ == "__main__":
    main()
