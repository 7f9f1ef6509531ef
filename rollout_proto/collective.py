"""The collective weight-transfer data plane: how a push's bytes travel over a
`torch.distributed` process group between the trainer and the engines.

Both ends import this module (the trainer through `trainer_client`, the
engines' receivers through `rollout_service`), so they cut the stream the
same way. It depends on torch only, imported lazily.

Rank 0 is the trainer; ranks 1..world_size-1 receive. The push is the
manifest's tensors' bytes, in manifest order, cut into chunks of at most
`chunk_bytes` (`plan_chunks`). A chunk inside one tensor is sent and received
in place, without a copy; a chunk spanning small tensors is packed.

Two modes:

- "chain" (default): rank r receives each chunk from r-1 and forwards it to
  r+1 while it receives the next one, so the trainer sends every byte once
  whatever the number of receivers (the pipeline adds one chunk time per hop).
- "broadcast": each chunk is a `broadcast` of the group (gloo sends it from
  the root to every receiver; NCCL pipelines it).

Every wait is bounded by the group's timeout: a peer that dies or stalls
fails the transfer on every rank after `timeout_s`, it does not hang it.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterable, Iterator, Sequence

from rollout_proto.dtypes import DTYPE_SIZES

DEFAULT_CHUNK_BYTES = 32 << 20
DEFAULT_TIMEOUT_S = 60.0
MODES = ("chain", "broadcast")


@dataclass(frozen=True, slots=True)
class Spec:
    name: str
    dtype: str  # "float32", "bfloat16", ...
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= int(d)
        return n


# A chunk: [(tensor index, start byte, end byte), ...], in stream order.
Chunk = list[tuple[int, int, int]]


def plan_chunks(sizes: Sequence[int], chunk_bytes: int) -> list[Chunk]:
    """Cut the byte stream of tensors of `sizes` bytes into chunks of at
    most `chunk_bytes`; a chunk ends where a tensor ends when the next tensor
    would not fit whole (big tensors are split, small ones packed)."""
    chunk_bytes = max(1, int(chunk_bytes))
    chunks: list[Chunk] = []
    cur: Chunk = []
    room = chunk_bytes
    for i, size in enumerate(sizes):
        pos = 0
        while pos < size:
            if room == 0:
                chunks.append(cur)
                cur, room = [], chunk_bytes
            take = min(room, size - pos)
            cur.append((i, pos, pos + take))
            pos += take
            room -= take
    if cur:
        chunks.append(cur)
    return chunks


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def open_store(address: str, port: int, rank: int, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S):
    """The group's rendezvous store: rank 0 hosts it at address:port (create
    it before the other ranks try to reach it: they back off otherwise)."""
    import torch.distributed as dist

    return dist.TCPStore(address, int(port), world_size, rank == 0, timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def group_on(store, backend: str, address: str, rank: int, world_size: int,
             timeout_s: float = DEFAULT_TIMEOUT_S, prefix: str = "rollout-weights"):
    """`rank`'s process group of `world_size` over `store` (not the default
    group: an engine process has its own); returns once every rank joined."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        return dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")


def open_group(backend: str, address: str, port: int, rank: int, world_size: int,
               timeout_s: float = DEFAULT_TIMEOUT_S, prefix: str = "rollout-weights"):
    """(process group, store) of `rank`; keep the store alive with the group."""
    store = open_store(address, port, rank, world_size, timeout_s)
    return group_on(store, backend, address, rank, world_size, timeout_s, prefix), store


def abort_group(group) -> None:
    """Leave a process group at once, whatever state it is in (a peer that
    died or stalled, a transfer half done); None is a no-op."""
    if group is None:
        return
    try:
        group.abort()
    except Exception:  # already broken or closed: nothing is left to release
        pass


class Cancelled(Exception):
    """A send stopped by its caller (the service refused the push)."""


def _wait(work, timeout_s: float, cancel=None) -> None:
    """Wait for `work` (its error raised), at most `timeout_s`; with `cancel`
    (a threading.Event), the wait runs in a daemon thread and setting the
    event ends it at once (gloo's work completes only inside `wait`, and a
    timed-out `wait` fails the work, so it cannot be polled)."""
    if cancel is None:
        work.wait(timedelta(seconds=timeout_s))
        return
    done = threading.Event()
    failed: list[BaseException] = []

    def wait() -> None:
        try:
            work.wait(timedelta(seconds=timeout_s))
        except BaseException as exc:
            failed.append(exc)
        finally:
            done.set()

    threading.Thread(target=wait, name="collective-wait", daemon=True).start()
    while not done.wait(0.05):
        if cancel.is_set():
            raise Cancelled("the send was cancelled")
    if failed:
        raise failed[0]


def _bytes_of(tensor):
    """A flat uint8 view of a contiguous tensor's bytes."""
    import torch

    return tensor.reshape(-1).view(torch.uint8)


def send(pg, world_size: int, specs: Sequence[Spec], pairs: Iterable, chunk_bytes: int,
         mode: str = "chain", timeout_s: float = DEFAULT_TIMEOUT_S, device=None, cancel=None) -> int:
    """Rank 0: send `pairs` ((name, tensor) in `specs` order, each checked
    against its spec) to every receiver. `pairs` may be lazy: each tensor is
    materialised when its first chunk goes and dropped after its last.
    Returns the bytes this rank sent (the payload once in chain mode).
    `cancel` (a threading.Event) set: `Cancelled` at once; the group is then
    unusable (a chunk may be half sent)."""
    import torch

    if world_size < 2:
        return 0
    chunks = plan_chunks([s.nbytes for s in specs], chunk_bytes)
    it: Iterator = iter(pairs)
    live: dict[int, object] = {}
    fetched = 0
    pack = None
    pending = []  # the sends in flight (chain mode: two chunks at most)
    sent = 0

    def fetch(i: int):
        nonlocal fetched
        while fetched <= i:
            try:
                name, t = next(it)
            except StopIteration:
                raise ValueError(f"the state dict ended after {fetched} of the manifest's {len(specs)} tensors") from None
            spec = specs[fetched]
            if name != spec.name:
                raise ValueError(f"tensor {fetched} is {name!r}, the manifest says {spec.name!r}")
            if str(t.dtype).removeprefix("torch.") != spec.dtype or tuple(t.shape) != tuple(spec.shape):
                raise ValueError(f"tensor {spec.name!r} is {str(t.dtype).removeprefix('torch.')} {list(t.shape)}, "
                                 f"the manifest says {spec.dtype} {list(spec.shape)}")
            if not t.is_contiguous():
                t = t.contiguous()
            if device is not None and t.device != device:
                t = t.to(device)
            live[fetched] = _bytes_of(t.detach())
            fetched += 1
        return live[i]

    def settle(keep: int) -> None:
        """Wait for all but `keep` sends in flight; drop the tensors they finished."""
        while len(pending) > keep:
            work, finished = pending.pop(0)
            _wait(work, timeout_s, cancel)
            for j in [j for j in live if j <= finished]:
                del live[j]

    for chunk in chunks:
        if len(chunk) == 1:
            i, a, b = chunk[0]
            buf = fetch(i)[a:b]
        else:
            n = sum(b - a for _, a, b in chunk)
            settle(0)  # the pack buffer is free again
            if pack is None or pack.numel() < n:
                pack = torch.empty(max(n, chunk_bytes), dtype=torch.uint8, device=device)
            buf = pack[:n]
            pos = 0
            for i, a, b in chunk:
                buf[pos : pos + b - a].copy_(fetch(i)[a:b])
                pos += b - a
        i, _, b = chunk[-1]
        finished = i if b == specs[i].nbytes else i - 1
        if mode == "chain":
            pending.append((pg.send([buf], 1, 0), finished))
            sent += buf.numel()
        else:
            pending.append((pg.broadcast(buf, 0), finished))
            sent += buf.numel() * (world_size - 1)
        settle(0 if len(chunk) > 1 else 1)
    settle(0)
    if fetched < len(specs):
        for i in range(fetched, len(specs)):
            fetch(i)
    try:
        next(it)
    except StopIteration:
        pass
    else:
        raise ValueError(f"the state dict has more tensors than the manifest's {len(specs)}")
    return sent


def receive(pg, rank: int, world_size: int, specs: Sequence[Spec], chunk_bytes: int,
            on_tensors: Callable[[list[tuple[str, object]]], None], mode: str = "chain",
            timeout_s: float = DEFAULT_TIMEOUT_S, device=None, batch_bytes: int | None = None) -> int:
    """A receiving rank: receive the push and hand complete tensors to
    `on_tensors([(name, tensor), ...])` as they complete, in manifest order
    (batched up to `batch_bytes`); forwards each chunk to rank+1 in chain
    mode. Holds one tensor in flight plus one chunk buffer, never the whole
    push. Returns the bytes received."""
    import torch

    chunks = plan_chunks([s.nbytes for s in specs], chunk_bytes)
    batch_bytes = chunk_bytes if batch_bytes is None else batch_bytes
    forward = mode == "chain" and rank + 1 < world_size
    current: dict[int, object] = {}  # index -> tensor being received
    ready: list[tuple[str, object]] = []
    ready_bytes = 0
    scratch = [None, None]
    pending: list = []  # forwards in flight
    received = 0

    def target(i: int):
        t = current.get(i)
        if t is None:
            s = specs[i]
            t = current[i] = torch.empty(s.shape, dtype=torch_dtype(s.dtype), device=device)
        return t

    def flush():
        nonlocal ready, ready_bytes
        if ready:
            batch, ready, ready_bytes = ready, [], 0
            on_tensors(batch)

    for k, chunk in enumerate(chunks):
        n = sum(b - a for _, a, b in chunk)
        if len(chunk) == 1:
            i, a, b = chunk[0]
            buf = _bytes_of(target(i))[a:b]
        else:
            slot = k % 2
            if scratch[slot] is None or scratch[slot].numel() < n:
                while pending:
                    _wait(pending.pop(0), timeout_s)
                scratch[slot] = torch.empty(max(n, chunk_bytes), dtype=torch.uint8, device=device)
            buf = scratch[slot][:n]
        if mode == "chain":
            _wait(pg.recv([buf], rank - 1, 0), timeout_s)
        else:
            _wait(pg.broadcast(buf, 0), timeout_s)
        received += n
        if forward:
            pending.append(pg.send([buf], rank + 1, 0))
        if len(chunk) > 1:
            pos = 0
            for i, a, b in chunk:
                _bytes_of(target(i))[a:b].copy_(buf[pos : pos + b - a])
                pos += b - a
        # At most two forwards in flight (a scratch slot is reused two chunks
        # on). A complete tensor is handed on at once: loading only reads it,
        # as the forward does, and the forward's work keeps it alive.
        while len(pending) > 1:
            _wait(pending.pop(0), timeout_s)
        for i, _, b in chunk:
            if b == specs[i].nbytes:
                ready.append((specs[i].name, current.pop(i)))
                ready_bytes += specs[i].nbytes
        if ready_bytes >= batch_bytes:
            flush()
    while pending:
        _wait(pending.pop(0), timeout_s)
    for i, s in enumerate(specs):  # empty tensors have no chunk
        if s.nbytes == 0:
            ready.append((s.name, torch.empty(s.shape, dtype=torch_dtype(s.dtype), device=device)))
    flush()
    return received
