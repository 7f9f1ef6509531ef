"""`VllmEngine`: the engine protocol on vLLM's `AsyncLLM` (CPU or GPU, same code).

Each engine is one `AsyncLLM` with its own engine-core process. Tokens come
back as deltas with the sampled token's logprob (vLLM's processed logprobs:
after temperature and top-p, i.e. the behaviour policy's); each token is
tagged with the weight version vLLM's engine core attached to the step that
produced it (`finish_weight_update`/`update_weight_version`), so tags stay
exact across a weight update even when deltas are merged in flight.

Weight updates use vLLM's RL hooks: `pause_generation(mode="keep")` (running
requests are frozen, not lost), an in-place reload in the worker from a
staged safetensors file (`RolloutWorkerExtension`), `update_weight_version`,
`resume_generation()`.

KV use is reported in tokens: the engine core's cache (blocks x block
size, read from the vLLM config once the engine is up) times vLLM's
usage fraction. Prefix caching is vLLM's (on by default); a request's
`cache_salt` goes to vLLM as the prompt's salt, so cached KV is shared only
between requests of one salt, and vLLM's prefix-cache counters (queried and
hit prompt tokens) are summed into the engine's load. A weight update does
not flush the prefix cache: the core salts requests by policy version, so
what stays on one version keeps its cache (session affinity survives a
push) and nothing attends to older weights' KV under another salt.

Speculation at temperature > 0 is exact on vLLM's CPU platform only with
`vllm_plugin`'s rejection-sampler fix in the worker processes; an engine
configured to speculate there checks it after start and refuses to run
without it.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator, Mapping, Sequence

from rollout_service.engines.types import (
    EngineDescription,
    EngineLoad,
    EngineState,
    EngineRequest,
    FinishReason,
    PartialResponse,
    TokenDelta,
)
from rollout_service.engines.weights import StagedWeights, checkpoint_manifest
from rollout_service.engines.base import EngineError, WeightsRejected
from rollout_proto.devices import RankDevice
from rollout_service.engines.collective import TransferInit
from rollout_service.engines.spec_config import SpecConfig, graph_depths
from rollout_service.engines.vllm_args import engine_args, spawn_environment, uses_cuda_graphs
from rollout_service.engines.vllm_internals import check_internals, check_live
from rollout_service.engines.spec_monitor import SpecMonitor
from rollout_service.engines.vllm_speculation import VllmSpeculation, spec_counts

log = logging.getLogger(__name__)

# An in-place reload whose wall time exceeds its CPU time by this much is
# logged as a warning: it waited for a core, the disk or memory.
SLOW_RELOAD_WAIT_S = 2.0

STAGED_POLL_S = 0.02  # how often a staged receive's progress is read
_SPAWN_LOCK = threading.Lock()  # engines spawn one at a time (they share os.environ)


def this_platform() -> str:
    """"cpu" on vLLM's CPU platform, else "cuda" (`vllm_args.PLATFORMS`)."""
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "cuda"


def _with_environment(env: Mapping[str, str], build):
    """`build()` with `env` set in os.environ (restored afterwards): engine
    processes inherit it at spawn, so engines spawn one at a time."""
    with _SPAWN_LOCK:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return build()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


class _LoadLogger:
    """A vLLM stat logger that keeps the latest scheduler statistics."""

    def __init__(self, engine: "VllmEngine") -> None:
        self.engine = engine

    def __call__(self, vllm_config, engine_index: int = 0):  # the factory vLLM calls
        from vllm.v1.metrics.loggers import StatLoggerBase

        engine = self.engine

        class Logger(StatLoggerBase):
            def __init__(self, *_):
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
                if scheduler_stats is not None:
                    engine._running = scheduler_stats.num_running_reqs
                    engine._waiting = scheduler_stats.num_waiting_reqs
                    engine._kv_usage = scheduler_stats.kv_cache_usage
                    pc = scheduler_stats.prefix_cache_stats  # this interval's (vLLM resets it per report)
                    if pc is not None:
                        engine._prefix_queried += int(pc.queries)
                        engine._prefix_hits += int(pc.hits)
                if iteration_stats is not None:
                    engine._count_tokens(iteration_stats.num_generation_tokens)
                if engine.speculation is not None:
                    engine.speculation.record_step(scheduler_stats, iteration_stats)

            def log_engine_initialized(self):
                pass

        return Logger()


class _Seq:
    __slots__ = ("generated", "logprobs", "versions", "done")

    def __init__(self) -> None:
        self.generated: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.done = False


class VllmEngine:
    kind = "vllm"

    def __init__(
        self,
        engine_id: str,
        model: str,
        *,
        max_seqs: int = 64,
        max_model_len: int = 2048,
        kv_cache_gib: float = 1.0,
        cpu_bind: str | None = None,
        seed: int = 0,
        vllm_args: Mapping[str, object] | None = None,
        spec: SpecConfig | Mapping[str, object] | None = None,
        env: Mapping[str, str] | None = None,
        require_exact_sampler: bool = True,
        collective_receive: str = "staged",
        platform: str = "",
        devices: Sequence[str] = (),
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
    ) -> None:
        self.engine_id = engine_id
        self.model = model
        self.max_seqs = max_seqs
        self.max_model_len = max_model_len
        self.kv_cache_gib = kv_cache_gib
        self.cpu_bind = cpu_bind
        self.seed = seed
        self.vllm_args = dict(vllm_args or {})
        # Where it runs (the device plan's): "cpu" or "cuda" ("": this
        # machine's, read at start), its GPUs, its tensor-parallel size.
        self.platform = platform
        self.devices = tuple(str(d) for d in devices)
        self.tensor_parallel_size = tensor_parallel_size
        self.gpu_memory_utilization = gpu_memory_utilization
        # Speculative decoding (off by default) and extra environment for the
        # engine's processes (e.g. ROLLOUT_STOCK_SPEC_SAMPLER=1).
        self.spec = spec if isinstance(spec, SpecConfig) else SpecConfig.from_dict(spec)
        self.env = dict(env or {})
        # Refuse to speculate on a CPU without the exact sampler (False only
        # for the negative control of the exactness test).
        self.require_exact_sampler = require_exact_sampler
        self.speculation: VllmSpeculation | None = (
            VllmSpeculation(self, SpecMonitor(self.spec, max_seqs)) if self.spec.enabled else None)
        if self.speculation is not None and platform and uses_cuda_graphs(self._engine_args()):
            # The depth tuner keeps to the depths whose CUDA graphs vLLM captured.
            self.speculation.monitor.graph_depths = graph_depths(self.spec.schedule, max_seqs,
                                                                 self.spec.num_speculative_tokens)
        self._llm = None
        self._state = EngineState.STARTING
        self._kv_capacity = 0  # tokens, known once the engine core is up
        self._dtype = ""
        self._version = 0
        self._seqs: dict[str, _Seq] = {}
        self._running = self._waiting = 0
        self._kv_usage = 0.0
        self._prefix_queried = self._prefix_hits = 0  # cumulative, tokens (vLLM's prefix-cache counters)
        self._tok_window: list[tuple[float, int]] = []
        self._manifest = checkpoint_manifest(model)
        self._update_lock = asyncio.Lock()
        self._transfer: "TransferInit | None" = None  # the collective transfer group joined
        self._receiving = False  # a collective push holds the update lock
        self._update_open = False  # vLLM's weight update is open (start_weight_update called)
        self._staged_open = False  # the workers hold (or are receiving) a staged collective push
        # "staged": a collective (gloo) push is received on a worker thread
        # while generating, a second copy of the weights held for the push;
        # "direct": loaded as it arrives, generation paused for the transfer.
        self.collective_receive = collective_receive
        self.paused_s = 0.0  # how long generation was paused to apply the last weight push
        self.last_reload: dict | None = None  # the last in-place reload's report (`_note_reload`)
        self._paused_at = 0.0
        self.restarts = 0  # starts after the first (`start`)
        self._started = False
        self.update_timeout_s = 120.0  # bound on each step of a weight update

    # -- lifecycle ---------------------------------------------------------------

    async def start(self) -> None:
        """Start (or restart, after a death) the engine; returns when ready.

        Raises EngineError, with the engine shut down again, when the engine
        would speculate inexactly (`VllmSpeculation.check_exact_sampler`) or
        the installed vLLM lacks an internal relied on (`vllm_internals`)."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if self._llm is not None:
            self._shutdown_llm()
        # Every start after the first counts, whether the engine died or was
        # shut down (a failed push it could not undo; a roll-back).
        if self._started:
            self.restarts += 1
        self._started = True
        self._state = EngineState.STARTING
        self._version = 0  # a fresh engine serves the model directory's weights
        self._prefix_queried = self._prefix_hits = 0  # a fresh engine core starts with an empty cache
        self._transfer = None  # a fresh engine is in no transfer group
        self._staged_open = self._update_open = False
        if self._receiving:
            self._receiving = False
            self._update_lock.release()
        args = self._engine_args()
        # Construction blocks until the engine core is up (~20 s on a CPU), so
        # it runs in a thread: a restart must not stall the other engines.
        self._llm = await asyncio.to_thread(
            _with_environment, self._spawn_environment(),
            lambda: AsyncLLM.from_engine_args(AsyncEngineArgs(**args), stat_loggers=[_LoadLogger(self)]))
        self._dtype = str(args["dtype"])
        self._kv_capacity = self._read_kv_capacity()
        try:
            # Every vLLM internal relied on, or this engine stops here, named.
            check_internals(self.spec.enabled, self.spec.has_model,
                            getattr(self._llm.vllm_config, "use_v2_model_runner", None))
            check_live(self._llm)
            if self.speculation is not None:
                await self.speculation.check_exact_sampler()
            await self._llm.update_weight_version(str(self._version))
            if self.speculation is not None:
                await self.speculation.restore()
        except BaseException:
            self._shutdown_llm()
            self._state = EngineState.DEAD
            raise
        self._state = EngineState.READY
        log.info("%s ready (%s, pid %s, KV cache %d tokens)", self.engine_id, self.model, self.engine_core_pid,
                 self._kv_capacity)

    def _engine_args(self) -> dict[str, object]:
        """vLLM's engine arguments (`vllm_args.engine_args`): this service's
        defaults for the platform, then speculation, then `vllm_args`."""
        return engine_args(self.platform or this_platform(), self.model, max_seqs=self.max_seqs,
                           max_model_len=self.max_model_len, seed=self.seed,
                           tensor_parallel_size=self.tensor_parallel_size,
                           gpu_memory_utilization=self.gpu_memory_utilization, spec=self.spec,
                           vllm_args=self.vllm_args)

    def _spawn_environment(self) -> dict[str, str]:
        """What this engine's processes read from the environment at spawn."""
        return spawn_environment(self.platform or this_platform(), devices=self.devices,
                                 kv_cache_gib=self.kv_cache_gib, cpu_bind=self.cpu_bind, extra=self.env)

    def _read_kv_capacity(self) -> int:
        """Tokens the engine core's KV cache holds: its block count (sent back
        by the engine core at start) times the block size."""
        cache = self._llm.vllm_config.cache_config
        return int(cache.num_gpu_blocks or 0) * int(cache.block_size or 0)

    @property
    def async_llm(self) -> Any:
        """vLLM's `AsyncLLM` behind this engine (None before its start): the
        reference a benchmark drives directly, beside the service."""
        return self._llm

    @property
    def engine_core_pid(self) -> int | None:
        try:
            return self._llm.engine_core.resources.engine_manager.processes[0].pid
        except (AttributeError, IndexError):
            return None

    async def device_report(self) -> list[dict]:
        """Where each of this engine's workers computes
        (`RolloutWorkerExtension.rollout_device`): pid, GPU or cores."""
        if not self._alive():
            raise EngineError(f"engine {self.engine_id} is not running")
        return list(await asyncio.wait_for(self._llm.collective_rpc("rollout_device"), self.update_timeout_s))

    async def transfer_devices(self) -> list[RankDevice]:
        """The device of each of this engine's receiving ranks (its workers,
        in rank order) for a collective group's device check."""
        return [RankDevice.from_dict(r) for r in await self.device_report()]

    def _shutdown_llm(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            try:
                llm.shutdown()
            except Exception as exc:  # a dead engine may fail to shut down cleanly
                log.debug("shutdown of %s: %s", self.engine_id, exc)

    async def close(self) -> None:
        self._state = EngineState.DEAD
        self._shutdown_llm()

    def _alive(self) -> bool:
        return self._llm is not None and not self._llm.errored

    # -- generation --------------------------------------------------------------

    def _sampling_params(self, request: EngineRequest):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        sp = request.sampling
        # A continued request (re-prefilled with its partial response) counts
        # min_tokens from its new tokens: subtract what was generated. Stop
        # strings are looked for in the text vLLM detokenises from this
        # request's output only (a string straddling the point where it was
        # continued is missed); detokenising costs, so only when needed.
        return SamplingParams(
            n=1,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k if sp.top_k > 0 else 0,
            max_tokens=request.max_new_tokens,
            min_tokens=min(request.max_new_tokens, max(0, sp.min_tokens - len(request.generated_token_ids))),
            ignore_eos=sp.ignore_eos,
            stop_token_ids=list(sp.stop_token_ids),
            stop=list(sp.stop) or None,
            seed=sp.seed,
            logprobs=sp.logprobs,
            output_kind=RequestOutputKind.DELTA,
            skip_special_tokens=False,
            detokenize=bool(sp.stop),
        )

    def add(self, request: EngineRequest) -> AsyncIterator[TokenDelta]:
        if not self._alive() or self._state == EngineState.DEAD:
            raise EngineError(f"engine {self.engine_id} is not running")
        if request.request_id in self._seqs:
            raise EngineError(f"request {request.request_id} already running on {self.engine_id}")
        seq = self._seqs[request.request_id] = _Seq()
        return self._generate(request, seq)

    def _versions_of(self, request_id: str, start: int, end: int) -> list[int]:
        """Versions of output tokens [start, end) from vLLM's per-request
        weight-version starts; the engine's current version if unavailable."""
        state = self._llm.output_processor.request_states.get(request_id) if self._llm else None
        starts = getattr(state, "weight_version_starts", None)
        if not starts:
            return [self._version] * (end - start)
        out = []
        for pos in range(start, end):
            version = starts[0][0]
            for v, s in starts:
                if s <= pos:
                    version = v
            out.append(int(version))
        return out

    async def _generate(self, request: EngineRequest, seq: _Seq) -> AsyncIterator[TokenDelta]:
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids) + list(request.generated_token_ids))
        if request.cache_salt:
            prompt["cache_salt"] = request.cache_salt  # reuse only KV cached under the same salt
        rid = request.request_id
        try:
            async for out in self._llm.generate(prompt, self._sampling_params(request), rid):
                comp = out.outputs[0]
                ids = list(comp.token_ids)
                lps = [next(iter(d.values())).logprob if d else 0.0 for d in (comp.logprobs or [])] if ids else []
                if len(lps) < len(ids):
                    lps += [0.0] * (len(ids) - len(lps))
                tops = None
                if request.sampling.logprobs > 0 and ids:
                    # vLLM's order: the sampled token first, then the top ones by rank.
                    tops = [[(int(t), float(lp.logprob)) for t, lp in d.items()] if d else []
                            for d in (comp.logprobs or [])]
                    tops += [[]] * (len(ids) - len(tops))
                start = len(seq.generated)
                versions = self._versions_of(rid, start, start + len(ids))
                if seq.done:
                    return
                seq.generated += ids
                seq.logprobs += lps
                seq.versions += versions
                finish = None
                drafted = accepted = 0
                if out.finished:
                    finish = FinishReason.LENGTH if comp.finish_reason == "length" else FinishReason.STOP
                    if comp.finish_reason == "abort":
                        finish = FinishReason.ABORTED
                    drafted, accepted = spec_counts(comp)
                # One delta per version run (a merged delta may span an update).
                i = 0
                while i < len(ids):
                    j = i
                    while j < len(ids) and versions[j] == versions[i]:
                        j += 1
                    last = j == len(ids)
                    yield TokenDelta(ids[i:j], lps[i:j], versions[i], finish if last else None,
                                     drafted if last else 0, accepted if last else 0,
                                     tops[i:j] if tops is not None else None)
                    i = j
                if not ids and finish is not None:
                    yield TokenDelta([], [], self._version, finish, drafted, accepted)
                if finish is not None:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if seq.done:
                return
            raise EngineError(f"{self.engine_id}: {type(exc).__name__}: {exc}") from exc
        finally:
            self._seqs.pop(rid, None)
        if seq.done:
            return
        raise EngineError(f"{self.engine_id}: stream of {rid} ended without a finish reason")

    async def abort(self, request_id: str) -> PartialResponse:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return PartialResponse([], [], [])
        seq.done = True
        if self._alive():
            try:
                await self._llm.abort(request_id)
            except Exception as exc:
                log.debug("abort %s on %s: %s", request_id, self.engine_id, exc)
        return PartialResponse(list(seq.generated), list(seq.logprobs), list(seq.versions))

    # -- load -----------------------------------------------------------------

    def _count_tokens(self, n: int) -> None:
        now = time.monotonic()
        self._tok_window.append((now, n))
        while self._tok_window and now - self._tok_window[0][0] > 5.0:
            self._tok_window.pop(0)

    def load(self) -> EngineLoad:
        state = self._state
        if state != EngineState.STARTING and not self._alive():
            state = EngineState.DEAD
        window = self._tok_window
        rate = 0.0
        if len(window) > 1:
            span = max(window[-1][0] - window[0][0], 1e-3)
            rate = sum(n for _, n in window[1:]) / span
        return EngineLoad(
            engine_id=self.engine_id,
            kind=self.kind,
            state=state,
            running=self._running,
            waiting=self._waiting,
            max_seqs=self.max_seqs,
            kv_used_tokens=round(self._kv_usage * self._kv_capacity),
            kv_capacity_tokens=self._kv_capacity,
            tokens_per_s=rate,
            policy_version=self._version,
            prefix_cache_queried_tokens=self._prefix_queried,
            prefix_cache_hit_tokens=self._prefix_hits,
        )

    def describe(self) -> EngineDescription:
        return EngineDescription(
            engine_id=self.engine_id, kind=self.kind, placement="local", model=self.model,
            model_name=Path(self.model).name, max_seqs=self.max_seqs, max_model_len=self.max_model_len,
            kv_capacity_tokens=self._kv_capacity, dtype=self._served_dtype(), workers=max(1, self.transfer_ranks()),
            logprobs_mode=str(self.vllm_args.get("logprobs_mode", "processed_logprobs")),
            speculation=self.spec.method,
            draft_model=self.spec.draft_model_path() if self.spec.has_model else "")

    # -- weights ----------------------------------------------------------------

    def check_weights(self, manifest: Mapping[str, tuple[str, tuple[int, ...]]]) -> None:
        for name, (dtype, shape) in manifest.items():
            known = self._manifest.get(name)
            if known is None:
                raise WeightsRejected(f"header.tensors: unknown tensor name {name!r} for model {Path(self.model).name}")
            if tuple(shape) != known[1]:
                raise WeightsRejected(f"header.tensors: {name!r} has shape {list(shape)}, the model needs {list(known[1])}")
            if dtype not in ("float32", "float16", "bfloat16"):
                raise WeightsRejected(f"header.tensors: {name!r} has dtype {dtype}; send a floating-point dtype")

    async def update_weights(self, version: int, weights: StagedWeights) -> None:
        if not self._alive():
            raise EngineError(f"engine {self.engine_id} is not running")
        async with self._update_lock:
            path = await weights.as_file()
            self._state = EngineState.UPDATING
            # Every wait is bounded: a stuck engine fails the push (the
            # previous version keeps serving elsewhere) instead of hanging it.
            timeout = self.update_timeout_s
            # The prefix cache is kept: the core salts every request with the
            # policy version that computes its context (`cache_salt`), so KV
            # of the old weights is reused only where the carry-over mode says.
            self._paused_at = time.monotonic()
            await asyncio.wait_for(self._llm.pause_generation(mode="keep", clear_cache=False), timeout)
            try:
                self._note_reload(await asyncio.wait_for(
                    self._llm.collective_rpc("rollout_reload_weights", args=(path,)), timeout))
                await asyncio.wait_for(self._llm.update_weight_version(str(version)), timeout)
                self._version = version
            finally:
                await asyncio.wait_for(self._llm.resume_generation(), timeout)
                self.paused_s = time.monotonic() - self._paused_at
                self._state = EngineState.READY

    def _note_reload(self, reports) -> None:
        """Log each worker's in-place reload (`vllm_worker.reload_report`):
        a warning where it spent seconds waiting rather than computing."""
        for r in reports or []:
            if not isinstance(r, Mapping):
                continue
            self.last_reload = dict(r)
            waited = r["wall_s"] - r["cpu_s"]
            slow = waited > SLOW_RELOAD_WAIT_S
            (log.warning if slow else log.info)(
                "%s reloaded %d tensors in %.2f s (worker pid %s: CPU %.2f s, reading the file %.2f s, "
                "%d page faults from disk, preempted %d times)%s", self.engine_id, r["tensors"], r["wall_s"],
                r["pid"], r["cpu_s"], r["read_s"], r["major_faults"], r["involuntary_switches"],
                f"; it waited {waited:.1f} s for a core, the disk or memory" if slow else "")

    # -- collective weight transfer (vLLM's weight-transfer API) -----------------

    def _served_dtype(self) -> str:
        """The dtype vLLM resolved ("auto": the checkpoint's), once started."""
        resolved = self._llm.vllm_config.model_config.dtype if self._llm is not None else None
        return str(resolved).removeprefix("torch.") if resolved is not None else str(
            self.vllm_args.get("dtype", self._dtype))

    def transfer_ranks(self) -> int:
        cfg = self._llm.vllm_config.parallel_config if self._llm is not None else None
        return int(cfg.world_size) * int(cfg.data_parallel_size) if cfg is not None else 1

    def transfer_backend(self) -> str:
        default = "gloo" if (self.platform or this_platform()) == "cpu" else "nccl"
        cfg = self.vllm_args.get("weight_transfer_config")
        if isinstance(cfg, Mapping):
            return str(cfg.get("backend", default))
        return str(getattr(cfg, "backend", None) or default)

    async def init_weight_transfer(self, init: TransferInit) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        if not self._alive():
            raise EngineError(f"engine {self.engine_id} is not running")
        if init.backend != self.transfer_backend():
            raise EngineError(f"engine {self.engine_id} was started with the {self.transfer_backend()!r} "
                              f"weight-transfer backend, not {init.backend!r}")
        await self.close_weight_transfer()
        info = {"master_address": init.master_address, "master_port": int(init.master_port),
                "rank_offset": int(init.rank_offset), "world_size": int(init.world_size)}
        if init.backend == "gloo":
            info["timeout_s"] = float(init.timeout_s)
        info.update(init.options)
        await asyncio.wait_for(self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info)),
                               init.timeout_s + 30)
        self._transfer = init

    def _stages_collective(self) -> bool:
        """Whether a collective push is received on a worker thread while
        generating (gloo engines; `collective_receive`), not in the step loop."""
        return self.collective_receive == "staged" and self._transfer is not None and self._transfer.backend == "gloo"

    async def receive_weights(self, version: int, specs: list) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        if not self._alive():
            raise EngineError(f"engine {self.engine_id} is not running")
        if self._transfer is None:
            raise EngineError(f"engine {self.engine_id} is not in a transfer group")
        await self._update_lock.acquire()
        self._receiving = True
        # Bounded: the group's own timeout fails a receive whose trainer died
        # or stalls; this bounds the engine's side of it too.
        timeout = self._transfer.timeout_s + self.update_timeout_s
        info = {"names": [s.name for s in specs], "dtype_names": [s.dtype for s in specs],
                "shapes": [list(s.shape) for s in specs]}
        if self._stages_collective():
            await self._receive_staged(info, timeout)
            return
        self._state = EngineState.UPDATING
        self._paused_at = time.monotonic()
        # The prefix cache is kept, as on the streamed path (`update_weights`):
        # requests are salted with the version that computes their context.
        await asyncio.wait_for(self._llm.pause_generation(mode="keep", clear_cache=False), self.update_timeout_s)
        await asyncio.wait_for(self._llm.start_weight_update(), self.update_timeout_s)
        self._update_open = True
        try:
            await asyncio.wait_for(self._llm.update_weights(WeightTransferUpdateRequest(update_info=info)), timeout)
        except BaseException:
            self._update_open = False  # the worker ends the update when a receive fails
            raise

    async def _receive_staged(self, info: dict, timeout: float) -> None:
        """The workers receive on a thread of their own into host tensors
        while this engine goes on generating; returns once every worker has
        the whole push (`finish_received_weights` loads it)."""
        rpc = self._llm.collective_rpc
        self._staged_open = True  # from here a failure leaves the model untouched
        await asyncio.wait_for(rpc("rollout_begin_staged_receive", args=(info,)), self.update_timeout_s)
        deadline = time.monotonic() + timeout
        while True:
            states = await asyncio.wait_for(rpc("rollout_staged_receive_state"), self.update_timeout_s)
            failed = [err for done, err in states if done and err]
            if failed:
                raise EngineError(f"engine {self.engine_id} failed receiving the push: {failed[0]}")
            if all(done for done, _ in states):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {self.engine_id} did not receive the push within {timeout:g} s")
            await asyncio.sleep(STAGED_POLL_S)

    async def finish_received_weights(self, version: int) -> None:
        try:
            if self._staged_open:  # generation pauses only to load what was received
                self._state = EngineState.UPDATING
                self._paused_at = time.monotonic()
                await asyncio.wait_for(self._llm.pause_generation(mode="keep", clear_cache=False),
                                       self.update_timeout_s)
                await asyncio.wait_for(self._llm.start_weight_update(), self.update_timeout_s)
                self._update_open = True
                self._staged_open = False
                await asyncio.wait_for(self._llm.collective_rpc("rollout_load_staged"), self.update_timeout_s)
            await asyncio.wait_for(self._llm.finish_weight_update(weight_version=str(version)), self.update_timeout_s)
            self._update_open = False
            self._version = version
        finally:
            await self._resume_after_receive()

    async def abandon_received_weights(self, fallback: StagedWeights | None, version: int) -> None:
        """Put the previous weights back: the model may hold part of the
        failed push (weights load as they arrive)."""
        try:
            if not self._alive():
                return
            timeout = self.update_timeout_s
            if self._staged_open:  # nothing was loaded: the model still holds the serving weights
                self._staged_open = False
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._llm.collective_rpc("rollout_drop_staged"), timeout)
                await self.close_weight_transfer()
                return
            if self._update_open:
                self._update_open = False
                await asyncio.wait_for(self._llm.finish_weight_update(), timeout)
            await self.close_weight_transfer()
            if fallback is None and version != 0:
                # No copy of the serving weights (an NCCL push is not staged)
                # and a model that may hold part of the push: the engine is
                # restarted, and comes back on the model directory's weights
                # tagged version 0 until the next push.
                raise EngineError(f"no staged copy of version {version} to restore")
            paths = [await fallback.as_file()] if fallback is not None else \
                [str(p) for p in sorted(Path(self.model).glob("*.safetensors"))]
            for path in paths:
                self._note_reload(await asyncio.wait_for(
                    self._llm.collective_rpc("rollout_reload_weights", args=(path,)), timeout))
            self._version = version
            await asyncio.wait_for(self._llm.update_weight_version(str(version)), timeout)
        except Exception as exc:
            # The engine cannot be trusted with a half-loaded model: take it
            # down, the fleet restarts it at the serving version.
            log.error("%s could not restore its weights after a failed push (%s); restarting it (on the model "
                      "directory's weights, version 0, unless the service holds a staged copy)", self.engine_id, exc)
            self._shutdown_llm()
            self._state = EngineState.DEAD
        finally:
            await self._resume_after_receive()

    async def _resume_after_receive(self) -> None:
        try:
            if self._alive():
                await asyncio.wait_for(self._llm.resume_generation(), self.update_timeout_s)
        finally:
            if self._state == EngineState.UPDATING:
                self.paused_s = time.monotonic() - self._paused_at
                self._state = EngineState.READY
            if self._receiving:
                self._receiving = False
                self._update_lock.release()

    async def close_weight_transfer(self) -> None:
        if self._transfer is None or not self._alive():
            self._transfer = None
            return
        self._transfer = None
        try:
            await asyncio.wait_for(self._llm.collective_rpc("shutdown_weight_transfer_engine"), self.update_timeout_s)
        except Exception as exc:
            log.debug("leaving the transfer group on %s: %s", self.engine_id, exc)
