"""The core's state under `state_dir`: what it journals, and how a restart
rebuilds it (core/journal.py is the file format).

Records, each written before what it records is visible:

    submit   a group as submitted (before Submit replies); its prompt's
             token ids packed after the JSON
    sample   a completed sample (or a trajectory's turn event) with its
             cursor (before any stream can see it); its wire form (rollout.v1
             Sample, see `SampleCodec`) after the JSON, what it shares with
             its group left to the group's submit (or prompt) record
    prompt   a compaction's: the prompt of a finished group whose samples
             are retained
    ack      a consumer's acknowledged cursor (before Ack replies)
    abort    groups aborted by a client
    req      a trajectory's state at a turn boundary; every request's partial
             response at a graceful shutdown
    weights  a policy version now live, and the file in state_dir holding its
             weights (written and fsynced before the record)
    done / cursor / counters   a compaction's summary of what came before

Replaying them gives a `CoreSnapshot`: open groups whose finished samples
are known (only the missing ones run again), the retained samples under
their original cursors, each consumer's acknowledged cursor. Private groups
(the HTTP front ends') are never journaled.
"""
from __future__ import annotations

import base64
import dataclasses
import functools
import logging
import os
import struct
import uuid
from array import array
from json.encoder import encode_basestring_ascii as _json_str  # a str as json.dumps writes it
from pathlib import Path
from typing import Any, Protocol

from rollout_service.core.delivery import Consumer, Entry
from rollout_service.core.journal import (
    JOURNAL_FILE,
    Journal,
    JournalError,
    FORMAT_VERSION,
    check_header,
    frame,
    frame_payload,
    read,
    write_atomically,
)
from rollout_service.core.snapshot import CoreSnapshot
from rollout_service.engines.types import FinishReason, SamplingParams
from rollout_service.engines.weights import StagedWeights, read_safetensors, split_and_verify, write_safetensors
from rollout_service.lifecycle.types import CoreError, Group, GroupSpec, MultiTurnSpec, Request, Sample, Turn
from rollout_service.lifecycle.versions import VersionTags

log = logging.getLogger(__name__)

__all__ = ["DurableState", "JournalError"]

COMPACT_MIN_BYTES = 64 * 1024 * 1024  # a journal grown past this (and past 4x its last compaction) is compacted


_SPEC_FIELDS = [f.name for f in dataclasses.fields(GroupSpec) if f.name != "prompt_token_ids"]
_SAMPLING_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]
_MULTI_TURN_FIELDS = [f.name for f in dataclasses.fields(MultiTurnSpec)]


def _spec_dict(spec: GroupSpec) -> dict:
    """The spec as JSON-ready values, without its prompt (packed apart)."""
    d = {name: getattr(spec, name) for name in _SPEC_FIELDS}
    d["sampling"] = {name: getattr(spec.sampling, name) for name in _SAMPLING_FIELDS}
    if spec.multi_turn is not None:
        d["multi_turn"] = {name: getattr(spec.multi_turn, name) for name in _MULTI_TURN_FIELDS}
    return d


def _spec_from(d: dict, prompt_token_ids: list[int]) -> GroupSpec:
    d = dict(d)
    d["prompt_token_ids"] = prompt_token_ids
    sampling = dict(d.pop("sampling"))
    sampling["stop_token_ids"] = tuple(sampling["stop_token_ids"])
    if "stop" in sampling and isinstance(sampling["stop"], list):
        sampling["stop"] = tuple(sampling["stop"])
    multi_turn = d.pop("multi_turn", None)
    return GroupSpec(sampling=SamplingParams(**sampling), multi_turn=MultiTurnSpec(**multi_turn) if multi_turn else None,
                     **d)


def _turn_dict(t: Turn) -> dict:
    d = dataclasses.asdict(t)
    d["finish_reason"] = None if t.finish_reason is None else int(t.finish_reason)
    return d


def _turn_from(d: dict) -> Turn:
    d = dict(d)
    reason = d.pop("finish_reason")
    return Turn(finish_reason=None if reason is None else FinishReason(reason), **d)


# Token ids (int32) and logprobs (float32, as the wire carries them) go into
# records as their bytes: after the JSON (submit, sample, prompt records), or
# as base64 in it (req records).
def _ints(values: list[int]) -> str:
    return base64.b64encode(array("i", values).tobytes()).decode()


def _floats(values: list[float]) -> str:
    return base64.b64encode(array("f", values).tobytes()).decode()


def _pack_ints(values: list[int]) -> bytes:
    """int32, little endian (struct: about twice as fast as array here)."""
    return struct.pack(f"<{len(values)}i", *values)


def _unpack(typecode: str, data: bytes | memoryview) -> list:
    """What `_pack_ints` ("i") packed."""
    return list(struct.unpack(f"<{len(data) // 4}{typecode}", data))


def _ints_from(text: str) -> list[int]:
    return array("i", base64.b64decode(text)).tolist()


def _floats_from(text: str) -> list[float]:
    return array("f", base64.b64decode(text)).tolist()


class SampleCodec(Protocol):
    """A sample record's body: the sample's wire form (the API layer's),
    so that a journaled sample is converted once, for its record and its
    streams. What every sample of a group shares with it (sample id, prompt
    id, prompt, metadata, batch id) is left to the group's submit (or
    prompt) record."""

    def body(self, sample: Sample) -> Any:
        """The message without what the sample shares with its group."""

    def serialize(self, message: Any) -> bytes:
        """A body's bytes."""

    def complete(self, message: Any, sample: Sample) -> Any:
        """`message` (a stream's copy of a body) with the group's fields added in place: what streams send."""

    def decode(self, data: bytes, prompt_token_ids: list[int], prompt_id: str, metadata: dict[str, str],
               batch_id: str, awaiting_observation: bool) -> Sample:
        """The sample of a body's bytes."""


@dataclasses.dataclass(slots=True)
class _GroupInfo:
    """What a group's samples share with it, as replay learns it."""

    prompt_token_ids: list[int]  # one list, shared by the group's samples (as when they were made)
    prompt_id: str
    metadata: dict[str, str]
    batch_id: str


def _submit_frame(group: Group, finished: list[int] | None = None) -> bytes:
    """A submit record, framed: the spec as JSON, its prompt's token ids packed after it."""
    record = {"t": "submit", "spec": _spec_dict(group.spec), "at": group.submitted_at}
    if finished is not None:
        record["finished"] = finished
    return frame(record, _pack_ints(group.spec.prompt_token_ids))


def _prompt_frame(s: Sample) -> bytes:
    """A prompt record (a compaction's, for a finished group's retained samples), framed."""
    return frame({"t": "prompt", "g": s.group_id, "prompt_id": s.prompt_id, "metadata": s.metadata,
                  "batch_id": s.batch_id}, _pack_ints(s.prompt_token_ids))


def _ints_blob(rec: dict) -> list[int]:
    blob = rec.get("_blob")
    return _unpack("i", blob) if blob is not None else []


def _req_dict(r: Request) -> dict:
    return {"g": r.group.group_id, "i": r.index, "token_ids": _ints(r.token_ids), "logprobs": _floats(r.logprobs),
            "versions": r.versions.segments, "engines": r.engines, "num_migrations": r.num_migrations,
            "first_token_at": r.first_token_at, "turns": [_turn_dict(t) for t in r.turns],
            "turn_index": r.turn_index, "awaiting": r.awaiting, "answered_turn": r.answered_turn,
            "affinity": r.affinity}


def _req_apply(req: Request, d: dict) -> None:
    req.token_ids, req.logprobs = _ints_from(d["token_ids"]), _floats_from(d["logprobs"])
    req.versions = VersionTags([list(x) for x in d["versions"]])
    req.engines, req.num_migrations, req.first_token_at = list(d["engines"]), d["num_migrations"], d["first_token_at"]
    req.turns = [_turn_from(t) for t in d["turns"]]
    req.turn_index, req.awaiting = d["turn_index"], d["awaiting"]
    req.answered_turn, req.affinity = d["answered_turn"], d["affinity"]


def _group_from(d: dict, prompt_token_ids: list[int]) -> Group:
    spec = _spec_from(d["spec"], prompt_token_ids)
    group = Group(spec, submitted_at=d["at"])
    for i in range(spec.num_samples):
        group.requests.append(Request(f"{spec.group_id}/{i}", group, i, queued_at=d["at"]))
    return group


class DurableState:
    """A `state_dir`: its journal, its incarnation, the weights it keeps.

    `open()` (before the core starts) reads and replays the journal, cuts a
    torn tail and refuses another format version; the `record_*` methods
    append; `compact(snapshot)` rewrites the journal as a snapshot."""

    def __init__(self, state_dir: str, commit_interval_s: float, codec: SampleCodec) -> None:
        self.dir = Path(state_dir)
        self.commit_interval_s = commit_interval_s
        self.codec = codec
        self.incarnation = ""
        self.journal: Journal | None = None
        self.weights_file: str | None = None  # of the version last recorded live
        self._compacted_bytes = 0

    # -- start -------------------------------------------------------------------

    def open(self) -> CoreSnapshot | None:
        """Read the journal: the snapshot it holds (None when state_dir is
        empty), with its incarnation kept. JournalError for a journal of
        another format version."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / JOURNAL_FILE
        self.journal = Journal(path, self.commit_interval_s)
        if not path.exists() or path.stat().st_size == 0:
            self.incarnation = uuid.uuid4().hex[:16]
            self._remove_stale_weights(keep=None)
            return None
        records, end, size = read(path)
        if not records and size:
            raise JournalError(f"{path} is not a rollout-service journal (no whole record); move it away or "
                               f"point state_dir at an empty directory")
        header = check_header(records, path)
        if end < size:
            log.warning("journal %s: torn tail of %d bytes cut at the last whole record (offset %d)",
                        path, size - end, end)
        self.incarnation = header["incarnation"]
        snapshot = self._replay(records[1:])
        self._remove_stale_weights(keep=self.weights_file)
        return snapshot

    def _replay(self, records: list[dict]) -> CoreSnapshot:
        groups: dict[str, Group] = {}
        done: dict[str, None] = {}
        shared: dict[str, _GroupInfo] = {}  # group id -> what its samples share with it
        entries: list[Entry] = []
        consumers: dict[str, int] = {}
        snapshot = CoreSnapshot(policy_version=0)
        last_cursor = 0
        for rec in records:
            kind = rec["t"]
            if kind == "submit":
                group = _group_from(rec, _ints_blob(rec))
                spec = group.spec
                shared[spec.group_id] = _GroupInfo(spec.prompt_token_ids, spec.prompt_id, spec.metadata, spec.batch_id)
                if group.group_id not in done:
                    groups[group.group_id] = group
                    for i in rec.get("finished", ()):  # a compaction's: delivered and acknowledged
                        group.requests[i].finish_reason = FinishReason.STOP
                        group.finished += 1
            elif kind == "sample":
                info = shared.get(rec["g"])
                if info is None:
                    raise JournalError(f"{self.dir / JOURNAL_FILE}: a sample of group {rec['g']!r} comes "
                                       f"before its group's submit record; the journal is damaged")
                sample = self.codec.decode(rec["_blob"], info.prompt_token_ids, info.prompt_id, info.metadata,
                                           info.batch_id, rec["aw"])
                entries.append(Entry(rec["c"], sample, rec["gc"]))
                last_cursor = max(last_cursor, rec["c"])
                group = groups.get(sample.group_id)
                if group is None:
                    continue
                req = group.requests[sample.index]
                if sample.awaiting_observation or req.finish_reason is not None:
                    continue  # a turn event: its request's state comes with the `req` record before it
                req.finish_reason = sample.finish_reason
                group.finished += 1
                if group.finished == group.spec.num_samples:
                    del groups[group.group_id]
                    done[group.group_id] = None
            elif kind == "prompt":
                shared[rec["g"]] = _GroupInfo(_ints_blob(rec), rec["prompt_id"], rec["metadata"], rec["batch_id"])
            elif kind == "req":
                group = groups.get(rec["g"])
                if group is not None:
                    _req_apply(group.requests[rec["i"]], rec)
            elif kind == "ack":
                consumers[rec["consumer"]] = max(consumers.get(rec["consumer"], 0), rec["c"])
            elif kind == "abort":
                for gid in rec["groups"]:
                    if groups.pop(gid, None) is not None:
                        done[gid] = None
            elif kind == "weights":
                snapshot.policy_version, self.weights_file = rec["version"], rec["file"]
                for gid, i in rec.get("restart", ()):  # the push's carry-over started these over
                    group = groups.get(gid)
                    if group is not None and group.requests[i].finish_reason is None:
                        group.requests[i].reset()
            elif kind == "done":
                for gid in rec["groups"]:
                    done[gid] = None
            elif kind == "pause":
                snapshot.pause_mode = rec["mode"]
            elif kind == "cursor":
                last_cursor = max(last_cursor, rec["c"])
            elif kind == "counters":
                snapshot.counters = dict(rec["counters"])
            else:
                raise JournalError(f"{self.dir / JOURNAL_FILE}: unknown record type {kind!r} in format "
                                   f"{FORMAT_VERSION}; the journal was written by another release")
        floor = min(consumers.values(), default=0)
        snapshot.groups = list(groups.values())
        snapshot.done_group_ids = list(done)
        snapshot.entries = [e for e in entries if e.cursor > floor]
        snapshot.last_cursor = last_cursor
        snapshot.consumers = [Consumer(cid, acked) for cid, acked in consumers.items()]
        snapshot.weights = self._load_weights(snapshot)
        return snapshot

    def _load_weights(self, snapshot: CoreSnapshot) -> StagedWeights | None:
        """The last live version's weights; where they cannot be read, the
        model's own (version 0), so that no token is tagged with a version
        whose weights do not serve."""
        if snapshot.policy_version == 0:
            return None
        path = self.dir / self.weights_file if self.weights_file else None
        if path is None or not path.exists():
            log.warning("state_dir %s records policy version %d but not its weights (%s); serving the model's own "
                        "weights as version 0 until the next push", self.dir, snapshot.policy_version,
                        "a collective push keeps no copy" if path is None else f"{path} is missing")
            snapshot.policy_version, self.weights_file = 0, None
            return None
        try:
            specs, buffer = read_safetensors(str(path))
            return StagedWeights(split_and_verify(specs, buffer), source_path=str(path))
        except Exception as exc:
            log.warning("state_dir %s: cannot read the weights of version %d (%s); serving the model's own weights "
                        "as version 0 until the next push", self.dir, snapshot.policy_version, exc)
            snapshot.policy_version, self.weights_file = 0, None
            return None

    def _remove_stale_weights(self, keep: str | None) -> None:
        for p in self.dir.glob("weights-v*.safetensors*"):
            if p.name != keep:
                p.unlink(missing_ok=True)

    # -- failure -----------------------------------------------------------------

    @property
    def failure(self) -> str:
        """"" while the journal works; once a write or fsync failed, what a
        client is told: state_dir as configured, the system's reason, what
        to do (no other path)."""
        exc = self.journal.error if self.journal is not None else None
        if exc is None:
            return ""
        reason = (exc.strerror or os.strerror(exc.errno)) if isinstance(exc, OSError) and exc.errno else \
            type(exc).__name__
        return (f"state_dir {str(self.dir)!r}: the journal cannot be written ({reason}); nothing more is recorded, "
                f"so nothing more is accepted or streamed: free space or repair the disk, then restart the service "
                f"(what was recorded is kept)")

    async def commit(self) -> None:
        """Wait until everything recorded so far is durable; CoreError
        (failed_precondition, `failure`) once the journal cannot be written."""
        try:
            await self.journal.commit()
        except Exception:
            if self.journal.error is None:
                raise
            raise CoreError("failed_precondition", self.failure) from None

    # -- records -----------------------------------------------------------------

    # Sample records are encoded here, on the event loop (a few microseconds
    # each): the writer thread then holds the interpreter only to take them
    # and to report them durable. A Submit's are encoded by the writer (a
    # large Submit would hold the loop; a group's spec does not change).

    def record_submit(self, group: Group) -> int:
        return self.journal.append(functools.partial(_submit_frame, group))

    def record_sample(self, cursor: int, sample: Sample, group_complete: bool) -> tuple[int, Any]:
        """Append a sample's record; returns its sequence number and the
        record's body (a stream completes a copy of it: the body does not
        repeat the group's prompt in every retained sample)."""
        body = self.codec.body(sample)
        return self.journal.append(self._sample_frame(cursor, sample, group_complete, body)), body

    def _sample_frame(self, cursor: int, sample: Sample, group_complete: bool, body: Any = None) -> bytes:
        """A sample record, framed: cursor, group and flags as JSON, the
        body's bytes after it."""
        if body is None:
            body = self.codec.body(sample)
        head = (f'{{"t":"sample","c":{cursor:d},"g":{_json_str(sample.group_id)},'
                f'"gc":{"true" if group_complete else "false"},'
                f'"aw":{"true" if sample.awaiting_observation else "false"}}}')
        return frame_payload(head.encode(), self.codec.serialize(body))

    def record_ack(self, consumer_id: str, cursor: int) -> int:
        return self.journal.append({"t": "ack", "consumer": consumer_id, "c": cursor})

    def record_pause(self, mode: str | None) -> int:
        return self.journal.append({"t": "pause", "mode": mode})

    def record_abort(self, group_ids: list[str]) -> int:
        return self.journal.append({"t": "abort", "groups": group_ids})

    def record_request(self, req: Request) -> int:
        return self.journal.append({"t": "req", **_req_dict(req)})

    def write_weights(self, version: int, weights: StagedWeights | None) -> str | None:
        """Write a version's weights into state_dir atomically (in a worker
        thread); returns the file's name, None when there are none to keep
        (a collective push)."""
        if weights is None:
            return None
        name = f"weights-v{version}.safetensors"
        path = self.dir / name
        tmp = path.with_name(name + ".tmp")
        write_safetensors(str(tmp), weights.tensors)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return name

    async def record_weights(self, version: int, file: str | None, restart: list[tuple[str, int]] = ()) -> None:
        """Record `version` live (its weights in `file`) and the requests
        (group id, index) its carry-over restarts, durably; then drop the
        previous version's file."""
        previous, self.weights_file = self.weights_file, file
        record = {"t": "weights", "version": version, "file": file}
        if restart:
            record["restart"] = [list(r) for r in restart]
        self.journal.append(record)
        try:
            await self.commit()
        except CoreError as exc:  # the version serves all the same: its tags must say so
            log.error("version %d is live but not recorded: %s", version, exc)
            return
        if previous and previous != file:
            (self.dir / previous).unlink(missing_ok=True)

    # -- compaction --------------------------------------------------------------

    def due(self) -> bool:
        """Has the journal grown enough since its last compaction to compact it?"""
        j = self.journal
        return j is not None and j.bytes_written > max(COMPACT_MIN_BYTES, 4 * self._compacted_bytes)

    def snapshot_records(self, snapshot: CoreSnapshot) -> list[bytes]:
        """The journal of a snapshot: header, weights, done groups, cursor,
        counters, the pause in force, consumers, retained samples, open
        groups with their progress."""
        out = [frame({"t": "header", "format": FORMAT_VERSION, "incarnation": self.incarnation})]
        if snapshot.policy_version:
            out.append(frame({"t": "weights", "version": snapshot.policy_version, "file": self.weights_file}))
        out.append(frame({"t": "done", "groups": list(snapshot.done_group_ids)}))
        out.append(frame({"t": "cursor", "c": snapshot.last_cursor}))
        out.append(frame({"t": "counters", "counters": dict(snapshot.counters)}))
        if snapshot.pause_mode:
            out.append(frame({"t": "pause", "mode": snapshot.pause_mode}))
        for c in snapshot.consumers:
            out.append(frame({"t": "ack", "consumer": c.consumer_id, "c": c.acked}))
        open_ids = set()
        for group in snapshot.groups:
            open_ids.add(group.group_id)
            out.append(_submit_frame(group, [r.index for r in group.requests if r.finish_reason is not None]))
            for r in group.requests:
                if r.finish_reason is None and (r.token_ids or r.turns):
                    out.append(frame({"t": "req", **_req_dict(r)}))
        # Samples after the groups: replaying one marks its request finished.
        # A finished group's prompt comes before its first retained sample.
        for e in snapshot.entries:
            gid = e.sample.group_id
            if gid not in open_ids:
                open_ids.add(gid)
                out.append(_prompt_frame(e.sample))
            out.append(self._sample_frame(e.cursor, e.sample, e.group_complete))
        return out

    def rewrite_now(self, snapshot: CoreSnapshot) -> None:
        """Compact synchronously (before the journal's writer runs: at start)."""
        records = self.snapshot_records(snapshot)
        write_atomically(self.dir / JOURNAL_FILE, records)
        self._compacted_bytes = sum(map(len, records))

    def compact(self, snapshot: CoreSnapshot) -> None:
        """Replace the journal with `snapshot`'s records at the next commit
        (call it in the same step as the snapshot is taken)."""
        records = self.snapshot_records(snapshot)
        self._compacted_bytes = sum(map(len, records))
        self.journal.rewrite(records)
