"""The device plan: what `serve` starts on a machine, decided before anything starts.

Per engine: its id, its devices, its processes' environment, vLLM's engine
arguments and a memory budget. Local engines on GPUs get disjoint
`CUDA_VISIBLE_DEVICES` slices of `engine.tensor_parallel_size` devices out
of `engine.devices`; on a Ray cluster an engine's bundle holds
`engine.ray.gpus_per_engine` whole GPUs, which is its tensor-parallel size.
A plan that needs more devices than there are, or puts two engines on one,
is refused (`PlanError`) naming the keys. `rollout-service plan` prints it
for any machine (`--platform cuda --gpus 8`); `serve` logs it at start.

The memory budget reads the model's safetensors headers (weight bytes) and
config.json (KV bytes per token): on a GPU, the KV tokens that
`gpu_memory_utilization` of each device leaves after the weights (an upper
bound: vLLM also reserves activations and CUDA graphs, which it measures
at start); on a CPU, the tokens `kv_cache_gib` holds.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollout_service.config import EngineConfig
from rollout_service.engines.vllm_args import check_platform, engine_args, spawn_environment

DEFAULT_MAX_SEQS = {"cpu": 64, "cuda": 256}  # engine.max_seqs = 0
GIB = 1 << 30
# safetensors dtype names and the serving dtype names vLLM takes, in bytes.
_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
          "I8": 1, "U8": 1, "BOOL": 1, "float32": 4, "float16": 2, "bfloat16": 2, "half": 2, "float": 4}


class PlanError(ValueError):
    """The configuration does not fit the machine (the message names the keys)."""


@dataclass(slots=True)
class Platform:
    """The machine the engines run on: "cpu", or "cuda" with its visible GPUs."""

    name: str
    devices: list[str] = field(default_factory=list)  # visible GPU ids, in order
    memory_gib: float = 0.0  # per GPU; 0: unknown

    @classmethod
    def mocked(cls, name: str, gpus: int = 0, memory_gib: float = 0.0) -> "Platform":
        """A machine described on the command line (`plan --platform --gpus --gpu-memory-gib`)."""
        check_platform(name)
        if gpus < 0:
            raise PlanError(f"--gpus must be >= 0, got {gpus}")
        return cls(name, [str(i) for i in range(gpus)] if name == "cuda" else [], memory_gib)

    @classmethod
    def detect(cls) -> "Platform":
        """This machine, as vLLM sees it (imports vLLM)."""
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return cls("cpu")
        count = int(current_platform.device_count())
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [d.strip() for d in visible.split(",") if d.strip()] if visible is not None else []
        devices = ids[:count] if ids else [str(i) for i in range(count)]
        try:
            memory = current_platform.get_device_total_memory(0) / GIB if count else 0.0
        except Exception:  # a platform without the query
            memory = 0.0
        return cls("cuda", devices, memory)


@dataclass(slots=True)
class EnginePlan:
    id: str
    devices: list[str]  # CUDA_VISIBLE_DEVICES of a local GPU engine; [] on a CPU or under Ray
    env: dict[str, str]
    vllm_args: dict[str, Any]
    memory: dict[str, Any]
    cpu_bind: str | None = None  # CPU platform: the cores its OpenMP threads bind to
    ray_bundle: dict[str, float] = field(default_factory=dict)  # Ray: the bundle it is placed in


@dataclass(slots=True)
class FleetPlan:
    platform: str
    placement_backend: str
    engines: list[EnginePlan]
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape of `rollout-service plan --json`."""
        return {"platform": self.platform, "placement_backend": self.placement_backend,
                "engines": [{k: v for k, v in asdict(e).items() if v is not None and (v or k != "ray_bundle")}
                            for e in self.engines],
                "warnings": list(self.warnings)}

    def describe(self) -> str:
        hosts = {"process": ", front ends in host processes", "local": ", front ends in the server's process"}
        lines = [f"platform {self.platform}, {len(self.engines)} engines ({self.placement_backend}"
                 f"{hosts.get(self.placement_backend, '')})"]
        for e in self.engines:
            where = (f"GPUs {','.join(e.devices)}" if e.devices else
                     f"Ray bundle {e.ray_bundle}" if e.ray_bundle else
                     f"cores {e.cpu_bind}" if e.cpu_bind else "this process")
            args = e.vllm_args
            if not args:
                lines.append(f"  {e.id}: simulated")
                continue
            graphs = "CUDA graphs" if args and not args.get("enforce_eager") else "eager"
            tp = args.get("tensor_parallel_size", 1) if args else 1
            mem = ", ".join(f"{k} {v}" for k, v in e.memory.items() if k != "parameters")
            lines.append(f"  {e.id}: {where}; TP {tp}, {graphs}" + (f"; {mem}" if mem else ""))
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def resolve_backend(cfg: EngineConfig, platform: str) -> str:
    """Where the engines run: `engine.placement_backend`, with "auto" chosen
    by what an engine's front end costs. vLLM's output processing (decoding
    the engine core's outputs, logprobs, request states) costs the process
    running it ~50 us a token: on GPUs, where an engine makes thousands of
    tokens a second, each front end goes to a host process of its own
    ("process"). On a CPU the engines' own threads take the cores: hosts
    spend the same front-end CPU in more processes, beside the engines, and
    were no faster (0.68-1.03x the tokens/s of "local", docs/results.md);
    simulated engines cost the server less than a host link: "local"."""
    backend = cfg.placement_backend
    if backend == "auto":
        return "process" if cfg.kind == "vllm" and platform == "cuda" else "local"
    return backend


def max_seqs_for(cfg: EngineConfig, platform: str) -> int:
    """`engine.max_seqs`, or its platform default (simulated engines: the CPU's)."""
    if cfg.max_seqs < 0:
        raise PlanError(f"engine.max_seqs must be >= 0 (0: the platform's default), got {cfg.max_seqs}")
    return cfg.max_seqs or DEFAULT_MAX_SEQS["cpu" if cfg.kind == "sim" else platform]


def _device_list(cfg: EngineConfig, platform: Platform) -> list[str]:
    spec = cfg.devices
    if spec in ("auto", "", None):
        return list(platform.devices)
    items = spec.split(",") if isinstance(spec, str) else list(spec) if isinstance(spec, (list, tuple)) else [spec]
    devices = [str(d).strip() for d in items if str(d).strip()]
    seen: set[str] = set()
    for d in devices:
        if d in seen:
            raise PlanError(f"engine.devices lists GPU {d} twice: two engines (or two tensor-parallel ranks) on one "
                            "GPU fail vLLM's free-memory check and NCCL")
        seen.add(d)
        if platform.devices and d not in platform.devices:
            raise PlanError(f"engine.devices: GPU {d} is not visible here (visible: {','.join(platform.devices)})")
    return devices


def cpu_binds(n: int) -> list[str]:
    """On a CPU platform, each engine's own cores (OpenMP binding). Where
    there are more cores than engines, at least one is left to this process
    and the engines' schedulers, as vLLM's own binding leaves one: OpenMP
    threads spinning on every core stall whenever one is descheduled."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, (len(cores) - (len(cores) > n)) // n)
    return [",".join(map(str, cores[(i * per) % len(cores):][:per] or cores[:per])) for i in range(n)]


def _ray_tensor_parallel(cfg: EngineConfig, platform: Platform) -> tuple[str, int]:
    """(the engines' platform, tensor-parallel size) of a Ray fleet."""
    r = cfg.ray
    gpus = float(r.gpus_per_engine)
    if gpus < 0 or gpus != int(gpus):
        raise PlanError(f"engine.ray.gpus_per_engine must be a whole number of GPUs, got {r.gpus_per_engine:g}: "
                        "engines sharing a GPU fail vLLM's free-memory check")
    if not gpus:
        if platform.name == "cuda":
            raise PlanError("engine.ray.gpus_per_engine is 0: on GPUs each Ray engine needs whole GPUs of its own "
                            "(its tensor-parallel size)")
        if cfg.tensor_parallel_size != 1:
            raise PlanError("engine.tensor_parallel_size > 1 needs GPUs: set engine.ray.gpus_per_engine to it")
        return "cpu", 1
    if r.engines_per_actor != 1:
        raise PlanError(f"engine.ray.engines_per_actor = {r.engines_per_actor} with engine.ray.gpus_per_engine = "
                        f"{gpus:g}: engines sharing an actor would share its GPUs; use 1 engine per actor")
    if cfg.tensor_parallel_size not in (1, int(gpus)):
        raise PlanError(f"engine.tensor_parallel_size = {cfg.tensor_parallel_size} and engine.ray.gpus_per_engine = "
                        f"{gpus:g} disagree: a Ray engine's tensor-parallel size is its GPUs (leave the first at 1)")
    return "cuda", int(gpus)


def plan_fleet(cfg: EngineConfig, platform: Platform, model: str = "", max_model_len: int = 0) -> FleetPlan:
    """The plan of `cfg` on `platform` (the model directory and context length
    as `factory.model_info` resolved them), or PlanError."""
    if cfg.num_engines < 1:
        raise PlanError(f"engine.num_engines must be >= 1, got {cfg.num_engines}")
    if cfg.kind == "sim":
        return FleetPlan("sim", resolve_backend(cfg, "sim"),
                         [EnginePlan(f"sim-{i}", [], {}, {}, {}) for i in range(cfg.num_engines)])
    tp = cfg.tensor_parallel_size
    if tp < 1:
        raise PlanError(f"engine.tensor_parallel_size must be >= 1, got {tp}")
    if not 0 < cfg.gpu_memory_utilization <= 1:
        raise PlanError(f"engine.gpu_memory_utilization must be in (0, 1], got {cfg.gpu_memory_utilization}")
    warnings: list[str] = []
    name = platform.name
    slices: list[list[str]] = [[] for _ in range(cfg.num_engines)]
    bundle: dict[str, float] = {}
    if cfg.placement_backend == "ray":
        name, tp = _ray_tensor_parallel(cfg, platform)
        bundle = {"CPU": float(cfg.ray.cpus_per_engine)} | ({"GPU": float(tp)} if name == "cuda" else {})
    elif name == "cuda":
        devices = _device_list(cfg, platform)
        need = cfg.num_engines * tp
        if need > len(devices):
            raise PlanError(f"engine.num_engines = {cfg.num_engines} x engine.tensor_parallel_size = {tp} needs "
                            f"{need} GPUs; {len(devices)} available (engine.devices = {cfg.devices!r}"
                            f"{': ' + ','.join(devices) if devices else ''})")
        slices = [devices[i * tp:(i + 1) * tp] for i in range(cfg.num_engines)]
        if need < len(devices):
            warnings.append(f"GPUs {','.join(devices[need:])} unused")
    elif tp != 1:
        raise PlanError("engine.tensor_parallel_size > 1 needs GPUs (on the CPU platform an engine is one process "
                        "bound to its cores)")
    if name == "cuda" and cfg.kv_cache_gib != EngineConfig().kv_cache_gib:
        warnings.append("engine.kv_cache_gib applies on the CPU platform only; on GPUs the KV cache is what "
                        "engine.gpu_memory_utilization leaves after the weights")
    max_seqs = max_seqs_for(cfg, name)
    backend = resolve_backend(cfg, name)
    binds = cpu_binds(cfg.num_engines) if name == "cpu" and backend != "ray" else None
    engines: list[EnginePlan] = []
    for i in range(cfg.num_engines):
        args = engine_args(name, model, max_seqs=max_seqs, max_model_len=max_model_len, seed=i,
                           tensor_parallel_size=tp, gpu_memory_utilization=cfg.gpu_memory_utilization,
                           spec=cfg.spec, vllm_args=cfg.vllm_args)
        env = spawn_environment(name, devices=slices[i], kv_cache_gib=cfg.kv_cache_gib,
                                cpu_bind=binds[i] if binds else None)
        memory = dict(engines[0].memory) if engines else memory_budget(
            args, name, platform.memory_gib if name == platform.name else 0.0, cfg.kv_cache_gib,
            cfg.spec.draft_model_path() if cfg.spec.has_model else "")
        engines.append(EnginePlan(f"vllm-{i}", slices[i], env, args, memory, binds[i] if binds else None,
                                  dict(bundle)))
    _check_memory(engines[0], max_model_len)
    warnings += _graph_warnings(cfg, name, max_seqs)
    return FleetPlan(name, backend, engines, warnings)


def _graph_warnings(cfg: EngineConfig, platform: str, max_seqs: int) -> list[str]:
    """Depths of the speculation schedule that run without CUDA graphs."""
    from rollout_service.engines.spec_config import dense_lookup, graph_depths, normalize_schedule

    spec = cfg.spec
    if platform != "cuda" or not spec.enabled:
        return []
    k = spec.num_speculative_tokens
    lookup = dense_lookup(normalize_schedule(spec.schedule, max_seqs, k), max_seqs)
    captured = graph_depths(spec.schedule, max_seqs, k)
    eager = [b for b in range(1, max_seqs + 1) if b > captured.get(lookup[b], 0)]
    if not eager:
        return []
    return [f"engine.spec.schedule: batches of {eager[0]}-{eager[-1]} sequences decode at depth "
            f"{lookup[eager[0]]} beyond vLLM's captured CUDA graphs (eager steps)"]


# -- the memory budget ----------------------------------------------------------


def safetensors_bytes(model: str) -> tuple[int, dict[str, int]]:
    """(parameters, {safetensors dtype: bytes}) from a model directory's
    safetensors headers (the 8-byte length and the JSON header only)."""
    params, by_dtype = 0, {}
    for path in sorted(Path(model).glob("*.safetensors")):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            count = math.prod(meta["shape"])
            params += count
            by_dtype[meta["dtype"]] = by_dtype.get(meta["dtype"], 0) + count * _BYTES.get(meta["dtype"], 2)
    return params, by_dtype


def _serving_bytes(args: dict[str, Any], platform: str, hf: dict) -> int:
    """Bytes per element of the dtype vLLM serves in ("auto" on a GPU: the
    checkpoint's, float32 checkpoints in bfloat16, as vLLM resolves it)."""
    dtype = str(args.get("dtype", "auto")).removeprefix("torch.")
    if dtype == "auto":
        dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16")
        if platform == "cuda" and dtype in ("float32", "float"):
            dtype = "bfloat16"
    return _BYTES.get(dtype, 2)


def _kv_bytes_per_token(hf: dict, elem: int, tp: int) -> int:
    """Per GPU of a tensor-parallel engine: K and V of every layer (KV heads
    split over the ranks, replicated where fewer than the ranks)."""
    text = hf.get("text_config", hf)
    heads = int(text.get("num_attention_heads", 1))
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
    return 2 * int(text["num_hidden_layers"]) * max(1, kv_heads // tp) * head_dim * elem




def memory_budget(args: dict[str, Any], platform: str, gpu_gib: float, kv_cache_gib: float,
                  draft_model: str = "") -> dict[str, Any]:
    """The memory of one engine (per GPU under tensor parallelism); {} without
    a model directory to read."""
    model = str(args.get("model", ""))
    config = Path(model) / "config.json"
    if not model or not config.exists():
        return {}
    hf = json.loads(config.read_text())
    elem = _serving_bytes(args, platform, hf)
    tp = int(args.get("tensor_parallel_size", 1))
    params = safetensors_bytes(model)[0]
    out: dict[str, Any] = {"parameters": params, "weight_bytes": math.ceil(params * elem / tp)}
    if draft_model and (Path(draft_model) / "config.json").exists():
        out["draft_weight_bytes"] = safetensors_bytes(draft_model)[0] * elem
    per_token = _kv_bytes_per_token(hf, elem, tp)
    out["kv_bytes_per_token"] = per_token
    if platform == "cpu":
        out["kv_cache_gib"] = max(1, round(kv_cache_gib))
        out["kv_tokens"] = int(out["kv_cache_gib"] * GIB // per_token)
    elif gpu_gib > 0:
        util = float(args.get("gpu_memory_utilization", 0.9))
        free = util * gpu_gib * GIB - out["weight_bytes"] - out.get("draft_weight_bytes", 0)
        out.update(gpu_gib=gpu_gib, gpu_memory_utilization=util, kv_tokens=max(0, int(free // per_token)))
    return out


def _check_memory(engine: EnginePlan, max_model_len: int) -> None:
    tokens = engine.memory.get("kv_tokens")
    if tokens is None or "gpu_gib" not in engine.memory or tokens >= max_model_len:
        return
    m = engine.memory
    raise PlanError(f"{engine.id}: engine.gpu_memory_utilization = {m['gpu_memory_utilization']} of "
                    f"{m['gpu_gib']:g} GiB leaves {tokens} KV tokens after {m['weight_bytes'] / GIB:.1f} GiB of weights "
                    "per GPU, "
                    f"fewer than one engine.max_model_len sequence ({max_model_len}); raise "
                    "engine.tensor_parallel_size or engine.gpu_memory_utilization, or lower engine.max_model_len")
