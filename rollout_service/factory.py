"""Build the engine fleet and read what the edge needs to know of the model."""
from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import dataclass, fields
from pathlib import Path

from rollout_service.config import COLLECTIVE_RECEIVE, EngineConfig
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
    values = {"max_seqs": cfg.max_seqs, "vocab_size": info.vocab_size, "eos_token_id": info.eos_token_id}
    spec = cfg.spec
    if spec.enabled:  # the same [engine.spec] drives simulated speculation
        values.update(spec_method=spec.method, spec_max_k=spec.num_speculative_tokens, spec_schedule=spec.schedule)
    values.update(cfg.sim)
    values["seed"] = values.get("seed", 0) * 1000 + index
    return SimParams(**values)


def make_engines(cfg: EngineConfig, info: ModelInfo) -> list[Engine]:
    """The fleet: engines in this process, or (`placement_backend = "ray"`)
    the same engines in Ray actors behind `RayEngine` proxies."""
    if cfg.num_engines < 1:
        raise ValueError(f"engine.num_engines must be >= 1, got {cfg.num_engines}")
    if cfg.placement_backend not in ("local", "ray"):
        raise ValueError(f"engine.placement_backend must be 'local' or 'ray', got {cfg.placement_backend!r}")
    if cfg.collective_receive not in COLLECTIVE_RECEIVE:
        raise ValueError(f"engine.collective_receive must be one of {', '.join(COLLECTIVE_RECEIVE)}, "
                         f"got {cfg.collective_receive!r}")
    factories = engine_factories(cfg, info)
    if cfg.placement_backend == "ray":
        from rollout_service.engines.ray_fleet import make_ray_engines

        r = cfg.ray
        return make_ray_engines(factories, address=r.address, strategy=r.strategy, cpus_per_engine=r.cpus_per_engine,
                                gpus_per_engine=r.gpus_per_engine, engines_per_actor=r.engines_per_actor,
                                object_store_gb=r.object_store_gb, heartbeat_s=r.heartbeat_s)
    return [make() for _, make in factories]


def engine_factories(cfg: EngineConfig, info: ModelInfo) -> list[tuple[str, "functools.partial[Engine]"]]:
    """(engine id, zero-argument constructor) per engine; picklable, so a
    Ray actor can build the same engine on another node."""
    if cfg.kind == "sim":
        return [(f"sim-{i}", functools.partial(SimEngine, f"sim-{i}", sim_params(cfg, info, i)))
                for i in range(cfg.num_engines)]
    if cfg.kind == "vllm":
        from rollout_service.engines.vllm import VllmEngine

        # On a CPU platform each engine gets its own cores; with Ray this
        # assumes every node has this node's cores (true of one machine).
        binds = _cpu_binds(cfg.num_engines)
        return [
            (f"vllm-{i}", functools.partial(
                VllmEngine,
                f"vllm-{i}",
                info.path,
                max_seqs=cfg.max_seqs,
                max_model_len=info.max_model_len,
                kv_cache_gib=cfg.kv_cache_gib,
                cpu_bind=binds[i] if binds else None,
                seed=i,
                vllm_args=cfg.vllm_args,
                spec=cfg.spec,
                collective_receive=cfg.collective_receive,
            ))
            for i in range(cfg.num_engines)
        ]
    raise ValueError(f"engine.kind must be 'sim' or 'vllm', got {cfg.kind!r}")


def _cpu_binds(n: int) -> list[str] | None:
    """On a CPU platform, give each engine its own cores (OpenMP binding);
    None on GPUs."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // n)
    binds = []
    for i in range(n):
        chunk = cores[(i * per) % len(cores):][:per] or cores[:per]
        binds.append(",".join(map(str, chunk)))
    return binds
