"""The engine protocol: the only thing the layers above see of an engine.

Every engine kind (`sim`, `vllm`, and either in a Ray actor) implements
it; the core and the scheduling policies never learn which kind they talk
to. Capabilities beyond generation are declared, not discovered:
`speculation` is None on an engine that does not speculate.
"""
from __future__ import annotations

from typing import AsyncIterator, Mapping, Protocol, runtime_checkable

from rollout_proto.devices import RankDevice
from rollout_service.engines.collective import TransferInit
from rollout_service.engines.speculation import Speculation
from rollout_service.engines.types import EngineDescription, EngineLoad, EngineRequest, PartialResponse, TokenDelta
from rollout_service.engines.weights import StagedWeights


class EngineError(RuntimeError):
    """An engine failed (died, refused a request, rejected weights)."""


class WeightsRejected(ValueError):
    """Pushed weights do not fit the model (unknown name, wrong shape or dtype)."""


@runtime_checkable
class Engine(Protocol):
    engine_id: str
    kind: str
    speculation: Speculation | None  # None: this engine does not speculate

    async def start(self) -> None:
        """Bring the engine up; returns when it can accept requests."""

    def add(self, request: EngineRequest) -> AsyncIterator[TokenDelta]:
        """Start generating; yields token deltas until a finish reason.

        A request with `generated_token_ids` continues that partial response
        (re-prefill of prompt + generated). Each delta is tagged with the
        policy version of the weights that sampled it. An aborted request's
        iterator ends with `finish_reason=ABORTED`. An engine that returns
        a `DeltaStream` (engines/stream.py) lets the core take each step's
        deltas in the step itself, with no task switch per delta.
        """

    async def abort(self, request_id: str) -> PartialResponse:
        """Stop a request; returns every token it generated on this engine
        (since its `add`), with logprobs and versions."""

    def load(self) -> EngineLoad:
        """A snapshot of the engine's load (cheap, non-blocking); KV use in tokens."""

    def describe(self) -> EngineDescription:
        """What the engine is: kind, model, limits, speculation method."""

    def check_weights(self, manifest: Mapping[str, tuple[str, tuple[int, ...]]]) -> None:
        """Raise WeightsRejected if a manifest {name: (dtype, shape)} does not
        fit this engine's model. Called before any byte is applied."""

    async def update_weights(self, version: int, weights: StagedWeights) -> None:
        """Apply verified policy weights at a safe point (between engine
        steps); tokens sampled afterwards carry `version`."""

    # -- collective weight transfer (see engines/collective.py) ------------------

    def transfer_ranks(self) -> int:
        """Receiving ranks this engine holds in a collective weight transfer
        group (one per model worker); 0: it cannot join one."""

    async def transfer_devices(self) -> list[RankDevice]:
        """Where each receiving rank computes, in rank order (its GPU's
        identity; a CPU rank has none), so that a group with two ranks on
        one GPU is refused before it forms."""

    async def init_weight_transfer(self, init: TransferInit) -> None:
        """Join a trainer's transfer group at `init.rank_offset`; returns
        once every rank has joined (bounded by `init.timeout_s`)."""

    async def receive_weights(self, version: int, specs: list) -> None:
        """Stop at a safe point (running requests kept) and receive a
        collective push of `specs` into the model. Nothing samples from the
        new weights before `finish_received_weights`."""

    async def finish_received_weights(self, version: int) -> None:
        """Make the received weights live at `version` and resume."""

    async def abandon_received_weights(self, fallback: StagedWeights | None, version: int) -> None:
        """A collective push failed or was abandoned: serve the previous
        weights again (`fallback`, or the model's own when None) at the
        serving `version`, leave the group, and resume."""

    async def close_weight_transfer(self) -> None:
        """Leave the transfer group (nothing if not in one)."""

    async def close(self) -> None:
        """Stop the engine and free its resources."""
