"""The vLLM internals this service relies on beyond vLLM's documented API,
checked when an engine starts.

The `gpu` and `cpu` extras pin the vLLM release these were read against
(`TESTED_VLLM`). Another release may move any of them; an engine started on
one that lacks one stops with an `EngineError` naming it and the installed
version, never a silent fallback (a token tagged with the wrong policy
version, a draft push that does nothing).
"""
from __future__ import annotations

import inspect
from typing import Any

from rollout_service.engines.base import EngineError

TESTED_VLLM = "0.32.0"

# The front end's RL hooks (AsyncLLM): weight updates, pauses, worker calls.
ASYNC_LLM_METHODS = ("pause_generation", "resume_generation", "update_weight_version", "collective_rpc",
                     "init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")


def _sets(cls: type, attr: str, method: str = "__init__") -> bool:
    """Whether `cls.method` assigns `self.attr` (read from its bytecode's names)."""
    fn = getattr(cls, method, None)
    if fn is None:
        return False
    code = getattr(inspect.unwrap(fn), "__code__", None)
    return code is not None and attr in code.co_names


def _implemented(cls: type, method: str) -> bool:
    """Whether `cls` has `method`, implemented (not only declared abstract)."""
    fn = getattr(cls, method, None)
    return callable(fn) and not getattr(fn, "__isabstractmethod__", False)


def missing_internals(spec_enabled: bool, draft_model: bool, v2_model_runner: bool | None = None) -> list[str]:
    """The internals, by `module.Class.attribute`, that this vLLM lacks.

    `v2_model_runner`: which model runner the engine runs (vLLM's
    `VllmConfig.use_v2_model_runner`; None checks both)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core_client import BackgroundResources
    from vllm.v1.engine.output_processor import OutputProcessor, RequestState
    from vllm.v1.engine.utils import CoreEngineProcManager

    checks: list[tuple[str, bool]] = [(f"AsyncLLM.{m}", _implemented(AsyncLLM, m)) for m in ASYNC_LLM_METHODS]
    checks += [
        # Each token's policy version (engines/vllm.py `_versions_of`).
        ("RequestState.weight_version_starts", _sets(RequestState, "weight_version_starts")),
        ("OutputProcessor.request_states", _sets(OutputProcessor, "request_states")),
        # The engine-core process (`engine_core_pid`: restarts, reload reports).
        ("BackgroundResources.engine_manager", "engine_manager" in getattr(BackgroundResources,
                                                                           "__dataclass_fields__", {})),
        ("CoreEngineProcManager.processes", _sets(CoreEngineProcManager, "processes")),
    ]
    if spec_enabled:  # the run-time depth schedule (vllm_plugin.rollout_set_spec_schedule)
        checks.append(("Scheduler.dynamic_sd_lookup", _sets(Scheduler, "dynamic_sd_lookup")))
    if draft_model:  # draft-weight pushes (vllm_worker.draft_model_of)
        runners = []
        if v2_model_runner in (None, False):
            from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1

            runners.append(("gpu_model_runner.GPUModelRunner", V1))
        if v2_model_runner in (None, True):
            from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2

            runners.append(("gpu.model_runner.GPUModelRunner", V2))
        checks += [(f"{name}.get_draft_model", _implemented(cls, "get_draft_model")) for name, cls in runners]
    return [name for name, ok in checks if not ok]


def check_internals(spec_enabled: bool, draft_model: bool, v2_model_runner: bool | None = None) -> None:
    """Raise EngineError naming every internal this vLLM lacks."""
    missing = missing_internals(spec_enabled, draft_model, v2_model_runner)
    if missing:
        import vllm

        raise EngineError(f"vLLM {vllm.__version__} lacks {', '.join(missing)}, which rollout-service relies on "
                          f"(it is tested with vLLM {TESTED_VLLM}; install that release: pip install "
                          f"vllm=={TESTED_VLLM})")


def check_live(llm: Any) -> None:
    """The same for a started `AsyncLLM`'s objects (what a class check cannot see)."""
    missing = []
    if not isinstance(getattr(getattr(llm, "output_processor", None), "request_states", None), dict):
        missing.append("AsyncLLM.output_processor.request_states")
    manager = getattr(getattr(getattr(llm, "engine_core", None), "resources", None), "engine_manager", None)
    if not isinstance(getattr(manager, "processes", None), list):
        missing.append("AsyncLLM.engine_core.resources.engine_manager.processes")
    if missing:
        import vllm

        raise EngineError(f"vLLM {vllm.__version__} lacks {', '.join(missing)}, which rollout-service relies on "
                          f"(it is tested with vLLM {TESTED_VLLM})")
