"""Placement baselines and policy names: pure functions, no event loop."""
from __future__ import annotations

from collections import Counter, deque

import pytest

from rollout_service.engines.types import EngineLoad, SamplingParams
from rollout_service.lifecycle.types import Group, GroupSpec, Request
from rollout_service.scheduling import PLACEMENTS, make_placement, parse_policies, parse_policy
from rollout_service.scheduling.placement import LeastAssigned, LoadView, split_evenly
from rollout_service.scheduling.policy import MECHANISMS


def loads(n: int, max_seqs: int = 4, state: str = "ready", **states) -> list[EngineLoad]:
    return [
        EngineLoad(f"e{i}", "sim", states.get(f"e{i}", state), 0, 0, max_seqs, 0, 1000, 0.0, 0)
        for i in range(n)
    ]


def queue_of(groups: int, samples: int, prefix: str = "g") -> deque[Request]:
    q: deque[Request] = deque()
    for g in range(groups):
        group = Group(GroupSpec(f"{prefix}{g}", [1, 2], samples, SamplingParams(max_tokens=8)))
        for i in range(samples):
            req = Request(f"{prefix}{g}/{i}", group, i)
            group.requests.append(req)
            q.append(req)
    return q


def by_engine(decisions) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for req, eid in decisions:
        out.setdefault(eid, []).append(req.request_id)
    return out


def groups_on(decisions) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for req, eid in decisions:
        out.setdefault(req.group.group_id, set()).add(eid)
    return out


def test_baselines_are_registered_by_name():
    assert {"static", "least-assigned", "sticky-rr"} <= set(PLACEMENTS)
    for name in ("static", "least-assigned", "sticky-rr"):
        assert make_placement(name).name == name
    with pytest.raises(ValueError, match="unknown placement policy 'lpt'"):
        make_placement("lpt")


def test_static_splits_the_batch_into_contiguous_even_chunks_of_groups():
    q = queue_of(10, 3)
    decisions = make_placement("static").place(q, loads(4), {})
    assert not q  # everything placed at once, whatever the engines' batch size
    per_engine = by_engine(decisions)
    # 10 groups on 4 engines: 3, 3, 2, 2 groups, in order (TRL's chunking).
    assert [len(per_engine[f"e{i}"]) // 3 for i in range(4)] == [3, 3, 2, 2]
    assert {r.split("/")[0] for r in per_engine["e0"]} == {"g0", "g1", "g2"}
    assert {r.split("/")[0] for r in per_engine["e3"]} == {"g8", "g9"}
    assert all(len(engines) == 1 for engines in groups_on(decisions).values())


def test_static_ignores_load():
    busy = {"e0": 100, "e1": 0}
    decisions = make_placement("static").place(queue_of(2, 2), loads(2), busy)
    assert Counter(eid for _, eid in decisions) == {"e0": 2, "e1": 2}


def test_static_spreads_small_batches_across_the_fleet():
    policy = make_placement("static")
    first = policy.place(queue_of(1, 2, "a"), loads(3), {})
    second = policy.place(queue_of(1, 2, "b"), loads(3), {})
    assert {eid for _, eid in first} != {eid for _, eid in second}


def test_split_evenly_sizes_differ_by_at_most_one():
    chunks = split_evenly(list(range(11)), 4)
    assert [len(c) for c in chunks] == [3, 3, 3, 2]
    assert sum(chunks, []) == list(range(11))
    assert split_evenly([1], 3) == [[1], [], []]


def test_least_assigned_sends_each_request_to_the_engine_with_fewest_in_flight():
    q = queue_of(1, 6)
    decisions = make_placement("least-assigned").place(q, loads(3), {"e0": 2, "e1": 0, "e2": 1})
    assert not q  # verl sends everything; engines queue what exceeds their batch
    counts = Counter(eid for _, eid in decisions)
    # Final in-flight counts are level: 2+1, 0+3, 1+2.
    assert counts == {"e0": 1, "e1": 3, "e2": 2}
    assert decisions[0][1] == "e1"  # the least loaded first
    # Samples of a group are spread, not kept together.
    assert len(groups_on(decisions)["g0"]) == 3


def test_least_assigned_with_cap_keeps_the_rest_queued():
    q = queue_of(1, 10)
    decisions = LeastAssigned(cap_at_max_seqs=True).place(q, loads(2, max_seqs=4), {"e0": 1})
    assert Counter(eid for _, eid in decisions) == {"e0": 3, "e1": 4}
    assert len(q) == 3


def test_sticky_round_robin_keeps_every_sample_of_a_group_on_one_engine():
    policy = make_placement("sticky-rr")
    decisions = policy.place(queue_of(5, 4), loads(3), {})
    homes = groups_on(decisions)
    assert all(len(e) == 1 for e in homes.values())
    assert [homes[f"g{i}"].pop() for i in range(5)] == ["e0", "e1", "e2", "e0", "e1"]
    # The round robin continues across calls; a re-queued sample goes home.
    later = policy.place(queue_of(1, 1, "h"), loads(3), {})
    assert later[0][1] == "e2"
    again = deque([Request("g1/2", Group(GroupSpec("g1", [1], 4, SamplingParams(max_tokens=8))), 2)])
    assert policy.place(again, loads(3), {})[0][1] == "e1"


def test_sticky_round_robin_moves_a_group_off_an_engine_that_is_gone():
    policy = make_placement("sticky-rr")
    policy.place(queue_of(2, 1), loads(2), {})  # g0 -> e0, g1 -> e1
    q = deque([Request("g0/0", Group(GroupSpec("g0", [1], 1, SamplingParams(max_tokens=8))), 0)])
    assert policy.place(q, loads(2, e0="dead"), {})[0][1] == "e1"


@pytest.mark.parametrize("name", ["static", "least-assigned", "sticky-rr"])
def test_no_request_goes_to_an_engine_that_is_not_ready(name):
    fleet = loads(3, e1="dead", e2="starting")
    decisions = make_placement(name).place(queue_of(4, 2), fleet, {})
    assert decisions and {eid for _, eid in decisions} == {"e0"}
    q = queue_of(1, 2)
    assert make_placement(name).place(q, loads(2, state="dead"), {}) == [] and len(q) == 2


def test_policy_names_join_a_placement_and_mechanisms_with_plus():
    assert parse_policy("sticky-rr").placement == "sticky-rr"
    assert parse_policy(" static ").name == "static"
    assert [p.name for p in parse_policies("static,least-assigned, sticky-rr")] == ["static", "least-assigned", "sticky-rr"]
    mechanisms = {**MECHANISMS, "probe-mechanism": "a mechanism a caller brings"}
    spec = parse_policy("probe-mechanism+static", mechanisms=mechanisms)
    assert (spec.placement, spec.mechanisms, spec.name) == ("static", ("probe-mechanism",), "static+probe-mechanism")
    assert parse_policy("probe-mechanism", mechanisms=mechanisms).placement == "least-assigned"  # the default placement
    with pytest.raises(ValueError, match="twice"):
        parse_policy("probe-mechanism+probe-mechanism", mechanisms=mechanisms)
    with pytest.raises(ValueError, match="unknown policy"):
        parse_policy("probe-mechanism")  # not in the default vocabulary


def test_callers_bring_their_own_placements_without_registering_them():
    made = make_placement("mine", extra={"mine": lambda: LeastAssigned(cap_at_max_seqs=True)})
    assert made.cap_at_max_seqs
    assert "mine" not in PLACEMENTS
    with pytest.raises(ValueError, match="unknown placement"):
        make_placement("mine")
    assert parse_policy("mine+rebalance", placements={**PLACEMENTS, "mine": LeastAssigned}).placement == "mine"


@pytest.mark.parametrize("bad, message", [
    ("teleport+static", "unknown policy 'teleport'"),
    ("static+sticky-rr", "two placements"),
    ("static+", "empty policy name"),
    ("", "empty policy name"),
    ("static+isolate", "write 'rebalance\\+isolate'"),
])
def test_unknown_or_malformed_policy_names_are_clear_errors(bad, message):
    with pytest.raises(ValueError, match=message) as exc:
        parse_policy(bad)
    if "unknown" in message:  # the error lists what is known
        assert all(repr(name) in str(exc.value) for name in ("least-assigned", "static", "sticky-rr"))


# -- length-aware placement -------------------------------------------------------


class _Lengths:
    """A predictor stand-in: a fixed remaining length per request id (default 10)."""

    def __init__(self, lengths: dict[str, float]) -> None:
        self.lengths = lengths

    def predict(self, req):
        from rollout_service.scheduling.length_predictor import LengthEstimate

        n = self.lengths.get(req.request_id, 10.0)
        return LengthEstimate(n, 2 * n)


def _length_aware(lengths: dict[str, float], in_flight: dict[str, tuple[float, float]] | None = None,
                  hold: bool = True):
    from rollout_service.scheduling.length_aware import LengthAwarePlacement

    return _WithLoad(LengthAwarePlacement(_Lengths(lengths), hold=hold), in_flight or {})


class _WithLoad:
    """A length-aware placement with a fixed predicted load in flight."""

    def __init__(self, placement, in_flight):
        self.placement, self.in_flight = placement, in_flight

    def __getattr__(self, name):
        return getattr(self.placement, name)

    def place(self, queue, loads, assigned):
        return self.placement.place(queue, loads, assigned, LoadView.of(self.in_flight))


def _packed(lengths: dict[str, float]):
    from rollout_service.scheduling.length_aware import LengthPackedPlacement

    return _WithLoad(LengthPackedPlacement(_Lengths(lengths)), {})


def test_length_aware_places_the_longest_predicted_first_and_keeps_the_rest_queued():
    q = queue_of(3, 2)  # six requests, four slots
    lengths = {"g0/0": 5, "g0/1": 50, "g1/0": 500, "g1/1": 40, "g2/0": 400, "g2/1": 4}
    policy = _length_aware(lengths, hold=False)
    decisions = policy.place(q, loads(2, max_seqs=2), {})
    assert [r.request_id for r, _ in decisions] == ["g1/0", "g2/0", "g0/1", "g1/1"]
    assert len(by_engine(decisions)["e0"]) == len(by_engine(decisions)["e1"]) == 2  # never over max_seqs
    assert [r.request_id for r in q] == ["g0/0", "g2/1"]  # late binding: placed when a slot frees
    # With holding on (the default), g1/1 would slow e0's 500-token response down while e1,
    # full, ends sooner: it waits for e1's slot instead.
    q = queue_of(3, 2)
    decisions = _length_aware(lengths).place(q, loads(2, max_seqs=2), {})
    assert by_engine(decisions) == {"e0": ["g1/0"], "e1": ["g2/0", "g0/1"]}
    assert [r.request_id for r in q] == ["g0/0", "g1/1", "g2/1"]


def test_length_aware_spreads_a_groups_samples():
    decisions = _length_aware({}).place(queue_of(1, 4), loads(4), {})
    assert groups_on(decisions) == {"g0": {"e0", "e1", "e2", "e3"}}


def test_an_engine_running_a_long_response_does_not_take_the_overflow():
    # e0 runs a response predicted to need 3,000 more tokens; e1 is full of short work that
    # ends sooner. A short request waits for a slot on e1 rather than slowing e0 down.
    q = queue_of(1, 1)
    policy = _length_aware({}, in_flight={"e0": (3000.0, 3000.0), "e1": (40.0, 10.0)})
    assert policy.place(q, loads(2, max_seqs=4), {"e0": 1, "e1": 4}) == [] and len(q) == 1
    # With a free slot on e1 it goes there; with no engine ending sooner it goes to e0.
    assert policy.place(q, loads(2, max_seqs=4), {"e0": 1, "e1": 3})[0][1] == "e1"
    policy = _length_aware({}, in_flight={"e0": (3000.0, 3000.0)})
    assert policy.place(queue_of(1, 1), loads(1, max_seqs=4), {"e0": 1})[0][1] == "e0"


def test_packing_puts_long_responses_together_and_short_ones_in_large_batches():
    # Four 1,000-token responses and forty of 200 on two engines. Longest-first spreading puts
    # two long ones on each engine, each then slowed by twenty short ones (predicted time
    # 1,000 + 0.04 * 6,000 = 1,240 lone steps per engine); packing ends sooner: the four long
    # ones together (1,000 + 0.04 * 4,000 = 1,160), the short ones in one large batch (520).
    lengths = {f"g0/{i}": 1000 for i in range(4)}
    lengths.update({f"g{g}/{i}": 200 for g in range(1, 11) for i in range(4)})
    spread = _length_aware(lengths, hold=False)
    by = by_engine(spread.place(queue_of(11, 4), loads(2, max_seqs=64), {}))
    assert sorted(sum(r.startswith("g0/") for r in ids) for ids in by.values()) == [2, 2]
    packed = _packed(lengths)
    q = queue_of(11, 4)
    by = by_engine(packed.place(q, loads(2, max_seqs=64), {}))
    long_engine = next(e for e, ids in by.items() if "g0/0" in ids)
    assert sorted(by[long_engine]) == [f"g0/{i}" for i in range(4)] and len(q) == 0
    # Never more than max_seqs per engine: the rest waits in the queue.
    q = queue_of(11, 4)
    decisions = packed.place(q, loads(2, max_seqs=8), {})
    assert max(len(ids) for ids in by_engine(decisions).values()) <= 8 and len(q) == 44 - len(decisions) > 0
