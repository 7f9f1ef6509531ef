"""The trainer's side of the gloo weight transfer: vLLM's trainer-side
engine interface (`trainer_init`, `send_weights`, `shutdown`) over a gloo
group, sending the bytes as `rollout_proto.collective` cuts them.

It lives with the wire code because both packages name it: the client
drives it (`trainer_client.collective`), and the service's vLLM plugin
registers it with vLLM's `WeightTransferTrainerFactory` by module path
beside the engines' receiving side. `client` is any `VLLMWeightSyncClient`
(rollout.v1's control plane in `trainer_client.collective.ServiceControl`);
`source` any `WeightSource` of (name, tensor) pairs.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import ClassVar

from rollout_proto import collective as wire


@dataclass
class GlooTrainerInitInfo:
    """Trainer-side init info of the gloo backend (vLLM's `TrainerInitInfo`
    shape: `backend` selects the engine, `rank` 0 sends)."""

    backend: ClassVar[str] = "gloo"

    master_address: str
    master_port: int
    world_size: int
    timeout_s: float = wire.DEFAULT_TIMEOUT_S
    chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES
    mode: str = "chain"
    rank: int = field(default=0, kw_only=True)

    @property
    def is_sender(self) -> bool:
        return self.rank == 0


class GlooTrainerWeightTransferEngine:
    """vLLM's trainer-side engine interface (`trainer_init`, `send_weights`,
    `shutdown`) over a gloo group; the bytes go as `rollout_proto.collective`
    cuts them (chain mode: sent once, whatever the number of engines)."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client, source, is_sender: bool, info: GlooTrainerInitInfo) -> None:
        self.client = client
        self.source = source
        self.is_sender = is_sender
        self.info = info
        self.group = None
        self.store = None
        self.bytes_sent = 0  # by the last send_weights

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source=None) -> "GlooTrainerWeightTransferEngine":
        if source is None:
            raise ValueError("the gloo trainer engine needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, info=init_info)
        if not engine.is_sender:
            return engine
        payload = {"master_address": init_info.master_address, "master_port": init_info.master_port,
                   "rank_offset": 1, "world_size": init_info.world_size, "timeout_s": init_info.timeout_s,
                   "chunk_bytes": init_info.chunk_bytes, "mode": init_info.mode}
        # The store first (the receivers reach it at once), then this rank
        # joins while the receivers are told to (they block until every rank
        # has). A refusal of the init call ends the wait at once with the
        # service's reason; the join, which cannot complete then, is left to
        # its timeout in a daemon thread.
        engine.store = wire.open_store(init_info.master_address, init_info.master_port, 0, init_info.world_size,
                                       init_info.timeout_s)
        joined: dict = {}

        def join() -> None:
            try:
                joined["group"] = wire.group_on(engine.store, "gloo", init_info.master_address, 0,
                                                init_info.world_size, init_info.timeout_s)
            except BaseException as exc:  # re-raised below, in the caller's thread
                joined["error"] = exc

        joiner = threading.Thread(target=join, name="gloo-trainer-join", daemon=True)
        joiner.start()
        client.init_weight_transfer_engine(payload)
        joiner.join(init_info.timeout_s + 30)
        if "error" in joined:
            raise joined["error"]
        if "group" not in joined:
            raise TimeoutError(f"the weight-transfer group did not form within {init_info.timeout_s:g} s")
        engine.group = joined["group"]
        return engine

    def send_weights(self) -> None:
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        specs = [wire.Spec(m.name, str(m.dtype).removeprefix("torch."), tuple(m.shape)) for m in meta]
        update_info = {"names": [s.name for s in specs], "dtype_names": [s.dtype for s in specs],
                       "shapes": [list(s.shape) for s in specs]}
        self.client.start_weight_update()  # the manifest is checked before a byte moves
        refused = threading.Event()

        def update() -> None:
            try:
                self.client.update_weights(update_info)
            except BaseException:
                # Refused (over HTTP the manifest is checked here): no engine
                # will take the bytes, so the send below ends at once, not at
                # the group's timeout.
                refused.set()
                raise

        exe = ThreadPoolExecutor(max_workers=1)
        try:
            future = exe.submit(update)
            try:
                self.bytes_sent = wire.send(self.group, self.info.world_size, specs, iter(self.source),
                                            self.info.chunk_bytes, self.info.mode, self.info.timeout_s,
                                            cancel=refused)
            except wire.Cancelled:
                group, self.group = self.group, None  # a chunk may be half sent: the group is spent
                wire.abort_group(group)
                raise future.exception() from None  # the service's reason
            future.result()
        finally:
            exe.shutdown(wait=False)
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        group, self.group, self.store = self.group, None, None
        wire.abort_group(group)
