"""TRL's GRPOTrainer (and other trainers on TRL's vLLM server mode) on rollout-service.

The service's side server speaks what TRL's `VLLMClient` expects of
`vllm serve`, so generation needs no change. Only the weight path differs:
TRL broadcasts weights over NCCL, which this service does not take (and a
CPU machine lacks); here they travel through the service's own push path,
gRPC `PushWeights`, with an increasing policy version per push.

The change to a training script (see docs/trl.md)::

    from trainer_client.trl import GRPOTrainer        # instead of: from trl import GRPOTrainer

    args = GRPOConfig(..., use_vllm=True, vllm_mode="server",
                      vllm_server_base_url="http://localhost:8000")   # the side server
    trainer = GRPOTrainer(model=..., reward_funcs=..., args=args, train_dataset=...,
                          rollout_address="localhost:50051")           # the gRPC port
    trainer.train()

For other trainers built on TRL's vLLM server mode (e.g. `RLOOTrainer`),
construct them inside `with use_rollout_service("localhost:50051"): ...`.

Tested with TRL 1.16.0. This module imports `trl` and `torch` (the trainer
side's own dependencies), never the service.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterable, Iterator

import torch
import trl
from trl.generation import vllm_generation as _vllm_generation
from trl.generation.vllm_client import VLLMClient

from trainer_client.sync import SyncRolloutClient

log = logging.getLogger(__name__)

__all__ = ["GRPOTrainer", "RolloutServiceVLLMClient", "use_rollout_service"]


class RolloutServiceVLLMClient(VLLMClient):
    """TRL's `VLLMClient`, generating through the rollout service's side
    server and pushing weights over gRPC instead of NCCL.

    Each push (one per TRL weight sync) gets the next policy version above
    the service's; only tensors of the served checkpoint are sent (a tied
    output layer is not one), cast to the checkpoint's dtype.
    """

    def __init__(
        self,
        base_url: str | None = None,
        host: str = "0.0.0.0",
        server_port: int = 8000,
        group_port: int = 51216,
        connection_timeout: float = 0.0,
        *,
        rollout_address: str | None = None,
        token: str | None = None,
    ) -> None:
        # Set before the base class's first request (it lists the models).
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        super().__init__(base_url=base_url, host=host, server_port=server_port, group_port=group_port,
                         connection_timeout=connection_timeout)
        info = self._get(f"{self.base_url}/server_info", params={"config_format": "json"})
        service = info.get("rollout_service")
        if service is None:
            raise RuntimeError(f"{self.base_url} is not a rollout-service side server (its /server_info has no "
                               "'rollout_service' section)")
        self.checkpoint_tensors: dict | None = service.get("checkpoint_tensors")
        self.policy_version: int = int(service.get("policy_version", 0))
        #: Versions (min, max) of the tokens of the latest generation request.
        self.last_generation_versions: tuple[int, int] | None = None
        self.pushes = 0
        self._rollout = SyncRolloutClient(rollout_address or f"{self.host}:50051", consumer_id="trl", token=token)
        self._staged: dict[str, torch.Tensor] | None = None

    # -- HTTP (with the bearer token; records the versions that generated) ---------

    def _get(self, url: str, **kwargs) -> dict:
        if self._headers:
            kwargs["headers"] = {**self._headers, **kwargs.get("headers", {})}
        return super()._get(url, **kwargs)

    def _post(self, url: str, **kwargs) -> dict:
        if self._headers:
            kwargs["headers"] = {**self._headers, **kwargs.get("headers", {})}
        reply = super()._post(url, **kwargs)
        if isinstance(reply, dict) and "policy_version" in reply and reply.get("choices"):
            segments = [seg for c in reply["choices"] for seg in c.get("policy_versions", ())]
            if segments:
                versions = [seg["version"] for seg in segments]
                self.last_generation_versions = (min(versions), max(versions))
        return reply

    # -- weights: gRPC PushWeights instead of an NCCL group -------------------------

    def init_communicator(self, device: torch.device | str | int = 0) -> None:
        """No NCCL group: wait until the service's gRPC port answers."""
        self._rollout.wait_ready(timeout=60.0)

    def close_communicator(self) -> None:
        self._staged = None

    def close(self) -> None:
        self._rollout.close()

    @contextlib.contextmanager
    def weight_update(self) -> Iterator[None]:
        """Tensors sent inside the block go out as one push, at its end."""
        self._staged, self._updating_weights = {}, True
        try:
            yield
            staged = self._staged
        finally:
            self._staged, self._updating_weights = None, False
        if staged:
            self._push(staged)

    def update_named_params(self, metadata, named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        tensors = {name: t for name, t in named_params}
        if self._staged is not None:
            self._staged.update(tensors)
        else:
            self._push(tensors)

    def _select(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors the served checkpoint has, in its dtypes."""
        if self.checkpoint_tensors is None:  # the service takes any manifest
            return {n: t.detach() for n, t in tensors.items()}
        out = {}
        for name, spec in self.checkpoint_tensors.items():
            t = tensors.get(name)
            if t is None:
                continue
            if list(t.shape) != list(spec["shape"]):
                raise ValueError(f"{name}: the trainer's tensor is {list(t.shape)}, the served checkpoint's "
                                 f"{spec['shape']}")
            out[name] = t.detach().to(getattr(torch, spec["dtype"]))
        if not out:
            raise ValueError("none of the trainer's tensors is in the served checkpoint (trainer: "
                             f"{sorted(tensors)[:3]}..., service: {sorted(self.checkpoint_tensors)[:3]}...)")
        missing = sorted(set(self.checkpoint_tensors) - set(out))
        if missing and self.pushes == 0:
            log.warning("%d checkpoint tensors are not trained and keep their served values, e.g. %s",
                        len(missing), missing[:3])
        return out

    def _push(self, tensors: dict[str, torch.Tensor]) -> None:
        state = self._select(tensors)
        serving = self._rollout.status().policy_version
        version = max(self.policy_version, serving) + 1
        pushed = self._rollout.push_weights(state, version=version)
        self.policy_version = pushed.applied_version
        self.pushes += 1
        log.info("pushed %d tensors (%.1f MB) as policy version %d in %.2f s", len(state),
                 pushed.bytes_received / 1e6, pushed.applied_version, pushed.seconds)


@contextlib.contextmanager
def use_rollout_service(address: str | None = None, token: str | None = None) -> Iterator[None]:
    """Trainers constructed inside the block that use TRL's vLLM server mode
    talk to the rollout service: generation through its side server (the
    trainer's `vllm_server_base_url`), weights through gRPC `address`
    (default: the side server's host, port 50051). `token`: a bearer token
    allowed to push weights, when the service requires one."""

    def make_client(*args, **kwargs) -> RolloutServiceVLLMClient:
        return RolloutServiceVLLMClient(*args, rollout_address=address, token=token, **kwargs)

    saved = _vllm_generation.VLLMClient
    _vllm_generation.VLLMClient = make_client
    try:
        yield
    finally:
        _vllm_generation.VLLMClient = saved


class GRPOTrainer(trl.GRPOTrainer):
    """`trl.GRPOTrainer`, generating on rollout-service and pushing weights to it.

    Takes `trl.GRPOTrainer`'s arguments and: `rollout_address` (the service's
    gRPC address; default the side server's host, port 50051),
    `rollout_token` (a bearer token allowed to push weights), and
    `push_final_weights` (default True: after `train()`, push the final
    weights too, so the service serves the trained policy).

    `args` must enable TRL's vLLM server mode: `use_vllm=True`,
    `vllm_mode="server"`, `vllm_server_base_url` = the service's side server.
    """

    def __init__(self, *args, rollout_address: str | None = None, rollout_token: str | None = None,
                 push_final_weights: bool = True, **kwargs) -> None:
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if config is None or not config.use_vllm or config.vllm_mode != "server":
            raise ValueError("trainer_client.trl.GRPOTrainer needs GRPOConfig(use_vllm=True, vllm_mode='server', "
                             "vllm_server_base_url='http://<host>:<side server port>')")
        self.push_final_weights = push_final_weights
        with use_rollout_service(rollout_address, rollout_token):
            super().__init__(*args, **kwargs)

    @property
    def rollout_client(self) -> RolloutServiceVLLMClient | None:
        """The client of the service (main process only; None elsewhere)."""
        return getattr(self.vllm_generation, "vllm_client", None)

    def train(self, *args, **kwargs):
        output = super().train(*args, **kwargs)
        if self.push_final_weights and self.state.global_step != self._last_loaded_step:
            self.vllm_generation.sync_weights()  # every process takes part (gathers), the main one pushes
            self._last_loaded_step = self.state.global_step
        return output
