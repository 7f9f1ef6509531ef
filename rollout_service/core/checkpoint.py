"""Save and restore the service's state across a graceful restart.

On SIGTERM the service stops taking requests, aborts what is running
(keeping every partial response), and writes: unfinished groups with their
partial responses, the delivery log's retained samples with their cursors,
each consumer's acknowledged cursor, the ids of finished groups (Submit stays
idempotent), the policy version and its weights. A restarted service loads
this before it serves, resumes the partials by re-prefill and re-delivers
unacknowledged samples, so every submitted group is delivered once.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

from rollout_service.core.delivery import Consumer, Entry
from rollout_service.core.snapshot import CoreSnapshot
from rollout_service.engines.types import FinishReason, SamplingParams
from rollout_service.lifecycle.types import Group, GroupSpec, MultiTurnSpec, Request, Sample, Turn
from rollout_service.lifecycle.versions import VersionTags
from rollout_service.engines.weights import StagedWeights, read_safetensors, split_and_verify

STATE_FILE = "state.json"
WEIGHTS_FILE = "weights.safetensors"


def _spec_dict(spec: GroupSpec) -> dict:
    d = dataclasses.asdict(spec)
    d["sampling"]["stop_token_ids"] = list(spec.sampling.stop_token_ids)
    return d


def _spec_from(d: dict) -> GroupSpec:
    sampling = d.pop("sampling")
    sampling["stop_token_ids"] = tuple(sampling["stop_token_ids"])
    multi_turn = d.pop("multi_turn", None)
    return GroupSpec(sampling=SamplingParams(**sampling), multi_turn=MultiTurnSpec(**multi_turn) if multi_turn else None,
                     **d)


def _turn_dict(t: Turn) -> dict:
    d = dataclasses.asdict(t)
    d["finish_reason"] = None if t.finish_reason is None else int(t.finish_reason)
    return d


def _turn_from(d: dict) -> Turn:
    reason = d.pop("finish_reason")
    return Turn(finish_reason=None if reason is None else FinishReason(reason), **d)


def _sample_dict(s: Sample) -> dict:
    d = {f.name: getattr(s, f.name) for f in dataclasses.fields(Sample)}
    d["versions"] = s.versions.segments
    d["finish_reason"] = int(s.finish_reason)
    d["turns"] = [_turn_dict(t) for t in s.turns]
    return d


def _sample_from(d: dict) -> Sample:
    d["versions"] = VersionTags([list(x) for x in d["versions"]])
    d["finish_reason"] = FinishReason(d["finish_reason"])
    d["turns"] = [_turn_from(t) for t in d.get("turns", [])]
    return Sample(**d)


def save(snapshot: CoreSnapshot, state_dir: str) -> Path:
    """Write a snapshot (taken after every request was preempted)."""
    out = Path(state_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups = []
    for g in snapshot.groups:
        groups.append({
            "spec": _spec_dict(g.spec),
            "submitted_at": g.submitted_at,
            "requests": [
                {"index": r.index, "token_ids": r.token_ids, "logprobs": r.logprobs, "versions": r.versions.segments,
                 "engines": r.engines, "num_migrations": r.num_migrations, "queued_at": r.queued_at,
                 "first_token_at": r.first_token_at, "finished": r.finish_reason is not None,
                 "turns": [_turn_dict(t) for t in r.turns], "turn_index": r.turn_index, "awaiting": r.awaiting,
                 "answered_turn": r.answered_turn, "affinity": r.affinity}
                for r in g.requests
            ],
        })
    state = {
        "policy_version": snapshot.policy_version,
        "groups": groups,
        "done_groups": list(snapshot.done_group_ids),
        "last_cursor": snapshot.last_cursor,
        "entries": [{"cursor": e.cursor, "group_complete": e.group_complete, "sample": _sample_dict(e.sample)}
                    for e in snapshot.entries],
        "consumers": {c.consumer_id: c.acked for c in snapshot.consumers},
        "counters": dict(snapshot.counters),
    }
    if snapshot.weights is not None:
        shutil.copyfile(snapshot.weights.path_now(), out / WEIGHTS_FILE)
    tmp = out / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, out / STATE_FILE)  # atomic: a crash mid-write leaves the old state
    return out / STATE_FILE


def load(state_dir: str) -> CoreSnapshot | None:
    """Read a saved snapshot (None if there is none). The state file is
    renamed once read, so a second start does not resume it again."""
    path = Path(state_dir) / STATE_FILE
    if not path.exists():
        return None
    state = json.loads(path.read_text())
    groups = []
    for gd in state["groups"]:
        spec = _spec_from(gd["spec"])
        group = Group(spec, submitted_at=gd["submitted_at"])
        for rd in gd["requests"]:
            req = Request(f"{spec.group_id}/{rd['index']}", group, rd["index"], queued_at=rd["queued_at"])
            req.token_ids, req.logprobs = rd["token_ids"], rd["logprobs"]
            req.versions = VersionTags([list(x) for x in rd["versions"]])
            req.engines, req.num_migrations, req.first_token_at = rd["engines"], rd["num_migrations"], rd["first_token_at"]
            req.turns = [_turn_from(t) for t in rd.get("turns", [])]
            req.turn_index, req.awaiting = rd.get("turn_index", 0), rd.get("awaiting", False)
            req.answered_turn, req.affinity = rd.get("answered_turn", -1), rd.get("affinity")
            if rd["finished"]:
                req.finish_reason = FinishReason.STOP  # already delivered; only counted
                group.finished += 1
            group.requests.append(req)
        groups.append(group)
    snapshot = CoreSnapshot(
        policy_version=state["policy_version"],
        groups=groups,
        done_group_ids=list(state["done_groups"]),
        entries=[Entry(e["cursor"], _sample_from(e["sample"]), e["group_complete"]) for e in state["entries"]],
        last_cursor=state["last_cursor"],
        consumers=[Consumer(cid, acked) for cid, acked in state["consumers"].items()],
        counters=state["counters"],
    )
    weights_file = Path(state_dir) / WEIGHTS_FILE
    if weights_file.exists() and snapshot.policy_version > 0:
        specs, buffer = read_safetensors(str(weights_file))
        snapshot.weights = StagedWeights(split_and_verify(specs, buffer), source_path=str(weights_file))
    path.rename(path.with_suffix(".restored"))
    return snapshot
