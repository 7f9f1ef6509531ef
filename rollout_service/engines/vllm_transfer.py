"""The `gloo` backend of vLLM's weight-transfer API, on the worker side.

vLLM ships `nccl` (GPUs); this adds the same thing over a gloo process group
for CPU engines, registered with `WeightTransferEngineFactory` by
`vllm_plugin` in every vLLM process (no patch of vLLM). An engine started
with `weight_transfer_config={"backend": "gloo"}` then takes the stock calls:
`init_weight_transfer_engine` (join the trainer's group), and per push
`start_weight_update`, `update_weights` (receive and load, bucket by bucket),
`finish_weight_update`; the draft-model variant (`start_draft_weight_update`)
retargets the same engine at the drafter.

The bytes travel as `rollout_proto.collective` cuts them (chain mode by
default: every receiver forwards to the next, so the trainer sends each byte
once). Two ways to receive:

- *direct* (the stock calls): received tensors go straight into the model
  through vLLM's layerwise reload (`initialize_layerwise_reload` /
  `load_weights` / `finalize_layerwise_reload`, as the nccl engine does);
  no second copy of the model is held, but the engine core runs the
  receive inside its step loop, so generation waits for the whole transfer;
- *staged* (`begin_staged_receive` / `staged_receive_state` /
  `load_staged`, through the worker extension): a thread of the worker
  receives into host tensors while the engine goes on generating; only
  loading them into the model (between `start_weight_update` and
  `finish_weight_update`) pauses it. It holds a second copy of the weights
  for the length of a push.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from rollout_proto import collective


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = collective.DEFAULT_TIMEOUT_S
    chunk_bytes: int = collective.DEFAULT_CHUNK_BYTES
    mode: str = "chain"

    def __post_init__(self) -> None:
        if self.mode not in collective.MODES:
            raise ValueError(f"mode must be one of {collective.MODES}, got {self.mode!r}")


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ValueError("names, dtype_names and shapes must have the same length")


def _tied_modules(model) -> list:
    from rollout_service.engines.vllm_worker import _tied_modules as tied

    return tied(model)


@dataclass
class StagedReceive:
    """A receive running on a worker thread, and what it has received."""

    thread: threading.Thread | None = None
    tensors: list = field(default_factory=list)
    error: str = ""
    done: bool = False


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.store = None
        self.info: GlooWeightTransferInitInfo | None = None
        self.staged: StagedReceive | None = None

    def _rank(self) -> int:
        pc = self.parallel_config
        return pc.data_parallel_index * pc.world_size + pc.rank + self.info.rank_offset

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        self.shutdown()
        self.info = init_info
        self.group, self.store = collective.open_group(
            "gloo", init_info.master_address, init_info.master_port, self._rank(), init_info.world_size,
            init_info.timeout_s)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        # The base class synchronizes an accelerator afterwards; a CPU has none.
        self.receive_weights(self.parse_update_info(update_info))

    def _receive(self, update_info: GlooWeightTransferUpdateInfo, on_tensors) -> int:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialized: call init_weight_transfer_engine first")
        specs = [collective.Spec(n, d, tuple(int(x) for x in s))
                 for n, d, s in zip(update_info.names, update_info.dtype_names, update_info.shapes)]
        info = self.info
        return collective.receive(self.group, self._rank(), info.world_size, specs, info.chunk_bytes,
                                  on_tensors, mode=info.mode, timeout_s=info.timeout_s)

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():
            self._receive(update_info, self.model.load_weights)

    # -- staged: receive on a thread while the engine generates ---------------------

    def begin_staged_receive(self, update_info: dict) -> None:
        """Start receiving a push into host tensors on a thread; returns at once."""
        if self.staged is not None and not self.staged.done:
            raise RuntimeError("a staged receive is already running")
        parsed = self.parse_update_info(update_info)
        staged = self.staged = StagedReceive()

        def run() -> None:
            try:
                self._receive(parsed, staged.tensors.extend)
            except BaseException as exc:  # reported by staged_receive_state
                staged.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                staged.tensors.clear()
            finally:
                staged.done = True

        staged.thread = threading.Thread(target=run, name="rollout-staged-receive", daemon=True)
        staged.thread.start()

    def staged_receive_state(self) -> tuple[bool, str]:
        """(done, the error if it failed)."""
        staged = self.staged
        if staged is None:
            return True, "no staged receive"
        return staged.done, staged.error

    def load_staged(self) -> int:
        """Load a complete staged receive into the update target (between
        `start_weight_update` and `finish_weight_update`); returns the
        tensor count and frees the staged copy."""
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        staged, self.staged = self.staged, None
        if staged is None or not staged.done or staged.error:
            why = "none" if staged is None else staged.error or "still receiving"
            raise RuntimeError(f"no complete staged receive to load ({why})")
        tensors, staged.tensors = staged.tensors, []
        with disable_mtp_completeness_check():
            self.model.load_weights(iter(tensors))
        return len(tensors)

    def drop_staged(self) -> None:
        """Forget a staged receive (a failed push): the model is untouched.
        A receive still running ends with the group (`shutdown`) or its timeout."""
        self.staged = None

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        # The CPU backend keeps a repacked copy per layer: the second user of
        # a tied weight (lm_head) is refreshed here (see vllm_worker).
        for module in _tied_modules(self.model):
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)

    def shutdown(self) -> None:
        group, self.group, self.store = self.group, None, None
        collective.abort_group(group)
        staged = self.staged
        if staged is not None and staged.thread is not None:
            staged.thread.join(5.0)  # the aborted group ends its receive

