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
once). Received tensors go straight into the model through vLLM's layerwise
reload (`initialize_layerwise_reload` / `load_weights` /
`finalize_layerwise_reload`, as the nccl engine does); no second copy of the
model is held.
"""
from __future__ import annotations

from dataclasses import dataclass

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


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.store = None
        self.info: GlooWeightTransferInitInfo | None = None

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

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialized: call init_weight_transfer_engine first")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        specs = [collective.Spec(n, d, tuple(int(x) for x in s))
                 for n, d, s in zip(update_info.names, update_info.dtype_names, update_info.shapes)]
        info = self.info
        with disable_mtp_completeness_check():
            collective.receive(self.group, self._rank(), info.world_size, specs, info.chunk_bytes,
                               self.model.load_weights, mode=info.mode, timeout_s=info.timeout_s)

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

