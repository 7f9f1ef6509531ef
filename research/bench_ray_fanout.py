"""Weight fan-out to engines that run as Ray actors: time from a verified
push to every engine having applied it, against the number of engines.

A local Ray cluster of two nodes (a head and a worker, separate Ray
processes on this machine; each has its own object store, so the bytes
really travel between stores) runs simulated engines as actors, half on
each node. Each push goes through `RayEngine.update_weights` exactly as the
core calls it (all engines at once):

  object store  the server puts the tensors once (`ray.put`); every actor
                receives the same ObjectRef, Ray copies the bytes once to
                the other node; each actor stages them as a safetensors
                file in /dev/shm and applies it (a simulated engine's apply
                is instant: the figures are transport and staging).
  per engine    the baseline a trainer would get sending to each engine
                itself: the same tensors passed by value in every actor
                call, so Ray serialises and ships one copy per engine.

    python -m research.bench_ray_fanout [--quick] [--report DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import numpy as np

from research.bench_weight_push import state_dict
from research.report import save_json
from rollout_service.config import EngineConfig
from rollout_service.engines.weights import StagedWeights, WeightTensor
from rollout_service.factory import make_engines, model_info

STORE_GB = 2.5  # object store of each node
BASELINE_MAX_MB = 1700  # per-engine copies beyond this would spill the store to disk: not measured


def staged_weights(params: int) -> StagedWeights:
    sd = state_dict(params)
    return StagedWeights([WeightTensor(k, "float32", v.shape, memoryview(v).cast("B")) for k, v in sd.items()])


async def fanout(engines, version: int, weights: StagedWeights) -> dict:
    t = time.perf_counter()
    await engines[0].host.fleet.weights_ref(weights)  # what the first engine's update does: the one put
    put = time.perf_counter() - t
    await asyncio.gather(*(e.update_weights(version, weights) for e in engines))
    total = time.perf_counter() - t
    return {"total_s": total, "put_s": put, "stage_s": max(e.last_update.stage_s for e in engines)}


async def per_engine(engines, version: int, weights: StagedWeights) -> float:
    """The same tensors by value in each actor call: one copy per engine."""
    payload = [(t.name, t.dtype, tuple(t.shape), np.frombuffer(t.data, dtype=np.uint8)) for t in weights.tensors]
    t = time.perf_counter()
    await asyncio.gather(*(e.host.actor.update_weights.remote(e.engine_id, version, payload) for e in engines))
    return time.perf_counter() - t


async def measure(num_engines: int, params: int, repeats: int) -> dict:
    cfg = EngineConfig(kind="sim", num_engines=num_engines, sim={"weight_update_s": 0.0}, placement_backend="ray")
    cfg.ray.cpus_per_engine = 0.25
    engines = make_engines(cfg, model_info(cfg))
    await asyncio.gather(*(e.start() for e in engines))
    nodes = len({e.node_id for e in engines})
    version = 0
    try:
        shared, baseline = [], []
        for _ in range(repeats):
            weights = staged_weights(params)
            version += 1
            shared.append(await fanout(engines, version, weights))
            del weights  # frees its object-store copy
            if num_engines * params * 4 / 1e6 <= BASELINE_MAX_MB:
                weights = staged_weights(params)
                version += 1
                baseline.append(await per_engine(engines, version, weights))
                del weights
    finally:
        await asyncio.gather(*(e.close() for e in engines))
    mb = params * 4 / 1e6
    total = statistics.median(r["total_s"] for r in shared)
    return {
        "engines": num_engines, "nodes": nodes, "params": params, "megabytes": round(mb),
        "object_store_s": round(total, 3),
        "put_s": round(statistics.median(r["put_s"] for r in shared), 3),
        "object_store_stage_s": round(statistics.median(r["stage_s"] for r in shared), 3),
        "per_engine_s": round(statistics.median(baseline), 3) if baseline else None,
        "per_engine_s_list": [round(x, 3) for x in baseline],
        "object_store_s_list": [round(r["total_s"], 3) for r in shared],
    }


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def main() -> None:
    import ray
    from ray.cluster_utils import Cluster

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="10M parameters on 2 and 4 engines only")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--report", help="directory for ray_fanout.json")
    args = p.parse_args()
    store = int(STORE_GB * 1024**3)
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=4, object_store_memory=store, include_dashboard=False))
    cluster.add_node(num_cpus=4, object_store_memory=store)
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    plan = [(10_000_000, [2, 4])] if args.quick else [(10_000_000, [2, 4, 8, 16]), (100_000_000, [2, 4, 8])]
    rows = []
    print(f"{'params':>12}{'MB':>6}{'engines':>9}{'nodes':>7}{'object store s':>16}{'of which: put s':>17}"
          f"{'staging s':>11}{'per-engine copies s':>21}", flush=True)
    try:
        for params, counts in plan:
            for n in counts:
                r = asyncio.run(measure(n, params, args.repeats))
                rows.append(r)
                print(f"{r['params']:>12,}{r['megabytes']:>6}{r['engines']:>9}{r['nodes']:>7}{r['object_store_s']:>16.2f}"
                      f"{r['put_s']:>17.2f}{r['object_store_stage_s']:>11.2f}{_fmt(r['per_engine_s']):>21}", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    save_json(args.report, "ray_fanout.json", rows)


if __name__ == "__main__":
    main()
