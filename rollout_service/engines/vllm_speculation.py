"""Speculative decoding of a `VllmEngine`: the depth schedule lives in the
scheduler of the engine-core process (`vllm_plugin` utilities), the draft
model in the worker (`vllm_worker`), the per-step statistics come from
vLLM's stat logger.

On vLLM's CPU platform the rejection sampler is exact at temperature > 0
only with `vllm_plugin`'s fix in the worker processes: `check_exact_sampler`
asks every worker after start, and the engine refuses to run without it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from rollout_service.engines.base import EngineError
from rollout_service.engines.spec_config import normalize_schedule
from rollout_service.engines.spec_monitor import SpecMonitor
from rollout_service.engines.speculation import MonitoredSpeculation
from rollout_service.engines.weights import StagedWeights

if TYPE_CHECKING:
    from rollout_service.engines.vllm import VllmEngine


class VllmSpeculation(MonitoredSpeculation):
    """`engine.speculation` of a `VllmEngine` that speculates (part of the
    engine: it drives the engine's `AsyncLLM`)."""

    def __init__(self, engine: "VllmEngine", monitor: SpecMonitor) -> None:
        super().__init__(monitor)
        self._engine = engine
        self._last_draft: tuple[int, StagedWeights] | None = None  # re-applied after a restart

    def _llm(self):
        engine = self._engine
        if not engine._alive():
            raise EngineError(f"engine {engine.engine_id} is not running")
        return engine._llm

    async def set_schedule(self, schedule) -> None:
        llm = self._llm()
        self.monitor.set_schedule(schedule)
        await llm.engine_core.call_utility_async("rollout_set_spec_schedule", [list(e) for e in self.monitor.schedule])

    async def update_draft_weights(self, version: int, weights: StagedWeights) -> None:
        """Reload the draft model in place. No pause: the worker applies it
        between two steps, and speculation is verified, so draft weights
        change only how many drafted tokens are accepted, never what is
        sampled."""
        if not self.has_draft_model:
            raise EngineError(f"engine {self._engine.engine_id} has no draft model "
                              f"(spec method {self.config.method!r})")
        llm = self._llm()
        path = await weights.as_file()
        await llm.collective_rpc("rollout_reload_draft_weights", args=(path,))
        self.monitor.draft_version = version
        self._last_draft = (version, weights)

    async def engine_info(self) -> dict:
        """What the engine-core process reports of its speculation (pid, max
        K, the dense depth lookup, whether the exact sampler is in place)."""
        return await self._llm().engine_core.call_utility_async("rollout_spec_info")

    # -- the engine's lifecycle --------------------------------------------------

    async def check_exact_sampler(self) -> None:
        """On vLLM's CPU platform, raise EngineError unless every worker runs
        `vllm_plugin`'s exact rejection-sampler expansion (without it,
        speculation at temperature > 0 samples from the wrong distribution).
        Waived by `VllmEngine(require_exact_sampler=False)` (the negative
        control of the exactness test)."""
        from vllm.platforms import current_platform

        engine = self._engine
        if not current_platform.is_cpu() or not engine.require_exact_sampler:
            return
        reports = await self._llm().collective_rpc("rollout_spec_sampler_patched")
        missing = [(pid, reason) for pid, patched, reason in reports if not patched]
        if missing:
            pid, reason = missing[0]
            raise EngineError(
                f"engine.spec: method {self.config.method!r} is configured, but on the CPU platform vLLM's "
                f"speculative rejection sampler is inexact at temperature > 0 without rollout_service's fix "
                f"(rollout_service.engines.vllm_plugin), and the fix is not in place in worker pid {pid}: {reason}. "
                f'Set engine.spec.method = "off", or make the plugin load (installing the package registers it).')

    async def restore(self) -> None:
        """After a (re)start: wire the sibling proposer; restore the tuned
        schedule and the latest draft weights."""
        engine, cfg = self._engine, self.config
        if cfg.method == "siblings":
            await self._llm().collective_rpc("rollout_attach_sibling_drafter")
        if self.monitor.schedule != normalize_schedule(cfg.schedule, engine.max_seqs, cfg.num_speculative_tokens):
            await self.set_schedule(self.monitor.schedule)
        if self._last_draft is not None:
            await self.update_draft_weights(*self._last_draft)

    def record_step(self, scheduler_stats, iteration_stats) -> None:
        """Feed one engine step (vLLM's stat logger) to the monitor. The step
        time is the inter-token latency of the requests that were already
        decoding (engine-core timestamps, so front-end lag does not count)."""
        if iteration_stats is None:
            return
        itl = iteration_stats.inter_token_latencies_iter
        batch = len(itl) + len(iteration_stats.time_to_first_tokens_iter)
        seconds = sorted(itl)[len(itl) // 2] if itl else None
        spec_stats = getattr(scheduler_stats, "spec_decoding_stats", None) if scheduler_stats is not None else None
        self.monitor.record(batch, seconds, iteration_stats.num_generation_tokens, spec_stats)


def spec_counts(completion) -> tuple[int, int]:
    """(draft tokens proposed, accepted) for a finished request, from vLLM's
    per-request speculative metrics; (0, 0) without speculation."""
    metrics = getattr(completion, "spec_decode_metrics", None)
    if metrics is None:
        return 0, 0
    accepted = sum(j * n for j, n in enumerate(metrics.histogram))
    return int(metrics.num_draft_tokens), int(accepted)
