"""What a `VllmEngine` hands vLLM: its engine arguments and its processes'
environment, per platform ("cpu" or "cuda"). Pure functions, no vLLM
import, so `rollout-service plan` shows exactly what `serve` would start.

Off the CPU platform: CUDA graphs and torch.compile on (no `enforce_eager`),
the engine's own GPUs in `CUDA_VISIBLE_DEVICES`, `tensor_parallel_size`
over them with vLLM's multiprocessing executor (also inside a Ray actor,
whose own GPUs those are), the checkpoint's dtype, NCCL weight transfer.
On the CPU platform: eager, float32, `VLLM_CPU_KVCACHE_SPACE` and a core
binding, gloo weight transfer.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from rollout_service.engines.spec_config import SpecConfig

PLATFORMS = ("cpu", "cuda")
WORKER_EXTENSION = "rollout_service.engines.vllm_worker.RolloutWorkerExtension"


def check_platform(platform: str) -> str:
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {', '.join(PLATFORMS)}, got {platform!r}")
    return platform


def engine_args(platform: str, model: str, *, max_seqs: int, max_model_len: int, seed: int,
                tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.9,
                spec: SpecConfig | None = None, vllm_args: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's engine arguments: this service's defaults for `platform`, then
    speculation, then `vllm_args` (which override both)."""
    cpu = check_platform(platform) == "cpu"
    args: dict[str, Any] = dict(
        model=model,
        # bf16 kills some CPU engines with SIGILL and is no faster for small
        # models there; elsewhere the checkpoint's dtype (vLLM's "auto").
        dtype="float32" if cpu else "auto",
        # CUDA graphs: the tail's small batches are launch-bound without them.
        enforce_eager=cpu,
        max_model_len=max_model_len,
        max_num_seqs=max_seqs,
        seed=seed,
        worker_extension_cls=WORKER_EXTENSION,
        logprobs_mode="processed_logprobs",
        disable_log_stats=False,
        weight_transfer_config={"backend": "gloo" if cpu else "nccl"},
    )
    if not cpu:
        args["gpu_memory_utilization"] = gpu_memory_utilization
    if tensor_parallel_size > 1:
        args["tensor_parallel_size"] = tensor_parallel_size
        # Never vLLM's Ray executor: inside a Ray actor it would start a new
        # driver without the actor's placement group and wait for GPUs the
        # actor already holds.
        args["distributed_executor_backend"] = "mp"
    if spec is not None and spec.enabled:
        args["speculative_config"] = spec.vllm_speculative_config(max_seqs, platform)
        args["per_request_spec_decode_metrics"] = "summary"
    args.update(vllm_args or {})
    return args


def spawn_environment(platform: str, *, devices: Sequence[str] = (), kv_cache_gib: float = 1.0,
                      cpu_bind: str | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """What an engine's processes read from the environment at spawn: its
    GPUs (CUDA), or its KV cache size and cores (CPU)."""
    env: dict[str, str] = {}
    if check_platform(platform) == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(kv_cache_gib)))
        if cpu_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
    elif devices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
    env.update(extra or {})
    return env


def uses_cuda_graphs(args: Mapping[str, Any]) -> bool:
    """Whether engine arguments leave CUDA graphs on."""
    if args.get("enforce_eager"):
        return False
    comp = args.get("compilation_config")
    mode = comp.get("cudagraph_mode") if isinstance(comp, Mapping) else getattr(comp, "cudagraph_mode", None)
    return mode is None or str(mode).upper() not in ("NONE", "0", "CUDAGRAPHMODE.NONE")
