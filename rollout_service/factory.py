"""Build the engine fleet and read what the edge needs to know of the model."""
from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, fields
from pathlib import Path

from rollout_service.config import COLLECTIVE_RECEIVE, PLACEMENT_BACKENDS, EngineConfig
from rollout_service.device_plan import FleetPlan, Platform, max_seqs_for, plan_fleet
from rollout_service.engines.base import Engine
from rollout_service.engines.sim import SimEngine, SimParams

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelInfo:
    path: str  # "" when there is no model directory (pure simulation)
    name: str
    vocab_size: int
    max_model_len: int
    eos_token_id: int


def default_model_path() -> str:
    from rollout_service.assets import tiny_model_path

    return str(tiny_model_path())


def model_info(cfg: EngineConfig) -> ModelInfo:
    path = cfg.model or default_model_path()
    config_file = Path(path) / "config.json"
    if not config_file.exists():
        if cfg.kind != "sim":
            raise FileNotFoundError(f"engine.model: no config.json in {path!r}")
        sim = SimParams(**cfg.sim)
        return ModelInfo("", "simulated", sim.vocab_size, cfg.max_model_len or 4096, sim.eos_token_id)
    hf = json.loads(config_file.read_text())
    eos = hf.get("eos_token_id", 2)
    eos = eos[0] if isinstance(eos, list) else eos
    limit = hf.get("max_position_embeddings", 4096)
    return ModelInfo(
        path=path,
        name=Path(path).name,
        vocab_size=int(hf["vocab_size"]),
        max_model_len=min(cfg.max_model_len or limit, limit),
        eos_token_id=int(eos),
    )


def load_tokenizer(info: ModelInfo):
    """The model's tokenizer (for text prompts), or None without a model.

    A directory whose tokenizer_config names `PreTrainedTokenizerFast` is
    loaded as exactly that: recent transformers map `model_type` qwen2 to
    Qwen2Tokenizer whatever the config says, which would mis-tokenize the
    bundled character-level tokenizer."""
    path = Path(info.path) if info.path else None
    if path is None or not (path / "tokenizer.json").exists():
        return None
    import transformers

    config = path / "tokenizer_config.json"
    declared = json.loads(config.read_text()).get("tokenizer_class") if config.exists() else None
    if declared == "PreTrainedTokenizerFast":
        return transformers.PreTrainedTokenizerFast.from_pretrained(str(path))
    return transformers.AutoTokenizer.from_pretrained(str(path))


def sim_params(cfg: EngineConfig, info: ModelInfo, index: int) -> SimParams:
    known = {f.name for f in fields(SimParams)}
    unknown = set(cfg.sim) - known
    if unknown:
        raise ValueError(f"engine.sim: unknown parameters {sorted(unknown)}; known: {sorted(known)}")
    values = {"max_seqs": max_seqs_for(cfg, "cpu"), "vocab_size": info.vocab_size, "eos_token_id": info.eos_token_id}
    spec = cfg.spec
    if spec.enabled:  # the same [engine.spec] drives simulated speculation
        values.update(spec_method=spec.method, spec_max_k=spec.num_speculative_tokens, spec_schedule=spec.schedule)
    values.update(cfg.sim)
    values["seed"] = values.get("seed", 0) * 1000 + index
    return SimParams(**values)


def fleet_plan(cfg: EngineConfig, info: ModelInfo, platform: Platform | None = None) -> FleetPlan:
    """The device plan of the fleet (`device_plan`) on `platform` (default:
    this machine, or for a Ray fleet its GPU bundles); PlanError if it does
    not fit."""
    if cfg.placement_backend not in PLACEMENT_BACKENDS:
        raise ValueError(f"engine.placement_backend must be one of {', '.join(PLACEMENT_BACKENDS)}, "
                         f"got {cfg.placement_backend!r}")
    if platform is None:
        platform = Platform("cpu") if cfg.kind == "sim" or (
            cfg.placement_backend == "ray" and cfg.ray.gpus_per_engine) else Platform.detect()
    return plan_fleet(cfg, platform, info.path, info.max_model_len)


def make_engines(cfg: EngineConfig, info: ModelInfo, plan: FleetPlan | None = None) -> list[Engine]:
    """The fleet: engines in this process, or the same engines in host
    processes (`placement_backend = "process"`, or "auto" with vLLM on GPUs)
    or Ray actors ("ray") behind proxies, as `plan` resolved it."""
    if cfg.collective_receive not in COLLECTIVE_RECEIVE:
        raise ValueError(f"engine.collective_receive must be one of {', '.join(COLLECTIVE_RECEIVE)}, "
                         f"got {cfg.collective_receive!r}")
    plan = plan or fleet_plan(cfg, info)
    factories = engine_factories(cfg, info, plan)
    if plan.placement_backend == "ray":
        from rollout_service.engines.ray_fleet import make_ray_engines

        r = cfg.ray
        return make_ray_engines(factories, address=r.address, strategy=r.strategy, cpus_per_engine=r.cpus_per_engine,
                                gpus_per_engine=r.gpus_per_engine, engines_per_actor=r.engines_per_actor,
                                object_store_gb=r.object_store_gb, heartbeat_s=r.heartbeat_s)
    if plan.placement_backend == "process":
        from rollout_service.engines.proc_fleet import make_process_engines

        if cfg.process.engines_per_host < 0:
            raise ValueError(f"engine.process.engines_per_host must be >= 0 (0: one vLLM engine or 8 simulated "
                             f"engines a host), got {cfg.process.engines_per_host}")
        per_host = cfg.process.engines_per_host or (1 if cfg.kind == "vllm" else 8)
        return make_process_engines(factories, engines_per_host=per_host,
                                    heartbeat_s=cfg.process.heartbeat_s, batch_ms=cfg.process.batch_ms,
                                    nice=cfg.process.nice)
    return [make() for _, make in factories]


def engine_factories(cfg: EngineConfig, info: ModelInfo,
                     plan: FleetPlan | None = None) -> list[tuple[str, "functools.partial[Engine]"]]:
    """(engine id, zero-argument constructor) per engine, as `plan` places
    them; picklable, so a Ray actor can build the same engine on another node."""
    if cfg.kind == "sim":
        return [(f"sim-{i}", functools.partial(SimEngine, f"sim-{i}", sim_params(cfg, info, i)))
                for i in range(cfg.num_engines)]
    if cfg.kind == "vllm":
        from rollout_service.engines.vllm import VllmEngine

        plan = plan or fleet_plan(cfg, info)
        return [
            (e.id, functools.partial(
                VllmEngine,
                e.id,
                info.path,
                max_seqs=int(e.vllm_args["max_num_seqs"]),
                max_model_len=info.max_model_len,
                kv_cache_gib=cfg.kv_cache_gib,
                cpu_bind=e.cpu_bind,
                seed=i,
                vllm_args=cfg.vllm_args,
                spec=cfg.spec,
                collective_receive=cfg.collective_receive,
                platform=plan.platform,
                devices=tuple(e.devices),
                tensor_parallel_size=int(e.vllm_args.get("tensor_parallel_size", 1)),
                gpu_memory_utilization=cfg.gpu_memory_utilization,
            ))
            for i, e in enumerate(plan.engines)
        ]
    raise ValueError(f"engine.kind must be 'sim' or 'vllm', got {cfg.kind!r}")
