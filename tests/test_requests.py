"""The request table keeps running / assigned / req.engine_id consistent
through every way a request starts and stops."""
from __future__ import annotations

import asyncio

from rollout_service.api.convert import WIRE_SAMPLES
from rollout_service.core.clock import Clock, run_virtual
from rollout_service.core.requests import RequestTable
from rollout_service.core.rollout import RolloutCore
from rollout_service.engines.sim import SimEngine, SimParams
from rollout_service.engines.types import SamplingParams
from rollout_service.engines.weights import StagedWeights
from rollout_service.lifecycle.types import Group, GroupSpec, Request
from rollout_service.partial.carry_over import CarryOverConfig
from rollout_service.scheduling import make_placement

FAST = dict(decode_base_s=0.001, decode_per_seq_s=0.0, prefill_per_token_s=0.0)


def _request(i: int) -> Request:
    group = Group(GroupSpec(f"g{i}", [1, 2], 1, SamplingParams(max_tokens=8)))
    return Request(f"g{i}/0", group, 0)


def test_the_table_counts_slots_until_release_and_detach_keeps_the_slot():
    table = RequestTable()
    a, b = _request(0), _request(1)
    table.start(a, "e0", None)
    table.start(b, "e0", None)
    assert (table.assigned("e0"), len(table), a.engine_id) == (2, 2, "e0")
    assert table.detach(a) == "e0" and a.engine_id is None
    assert table.assigned("e0") == 2 and table.running_on("e0") == [b]  # a preemption in flight holds its slot
    table.check()
    assert table.release(a) == "e0" and table.release(a) is None  # idempotent
    table.start(a, "e1", None)
    assert (table.assigned("e0"), table.assigned("e1")) == (1, 1)
    table.check()


def test_running_assigned_and_engine_ids_agree_through_start_preempt_migrate_drop_and_release():
    async def main():
        engines = [SimEngine(f"e{i}", SimParams(**FAST)) for i in range(2)]
        core = RolloutCore(engines, make_placement("least-assigned"), Clock(),
                           carry_over=CarryOverConfig(max_version_lag=0, stale_action="drop"))
        await core.start()
        lengths = {"sim.target_lengths": "3,5000,5000,5000"}
        core.submit([GroupSpec(f"g{i}", [1, 2, 3], 4, SamplingParams(max_tokens=10_000), metadata=dict(lengths))
                     for i in range(3)])
        await asyncio.sleep(0.05)
        core.requests.check()
        running = [r for r, _ in core.running.values()]
        assert running and all(r.engine_id in core.engines for r in running)
        await core.preempt(running[0])  # start -> preempt
        core.requests.check()
        assert running[0].request_id not in core.running and running[0].engine_id is None
        src = running[1]
        target = next(e for e in core.engines if e != src.engine_id)
        await core.migrate(src, target)  # start -> migrate
        core.requests.check()
        assert src.engine_id == target and core.running[src.request_id][0] is src
        await core.abort(["g2"])  # abort
        core.requests.check()
        await core.update_weights(1, StagedWeights([]))  # the staleness drop gives everything up
        core.requests.check()
        assert len(core.running) == 0 and all(core.assigned[e] == 0 for e in core.engines)
        await core.stop()

    run_virtual(main())


def test_a_graceful_stop_journals_partials_and_a_new_core_resumes_every_open_group(tmp_path):
    specs = [GroupSpec(f"g{i}", [1, 2, 3], 2, SamplingParams(max_tokens=10_000),
                       metadata={"sim.target_lengths": "2,400"}) for i in range(3)]

    async def first():
        core = RolloutCore([SimEngine("e0", SimParams(**FAST))], make_placement("least-assigned"), Clock())
        assert not core.open_state(str(tmp_path), 0.002, WIRE_SAMPLES)
        await core.start()
        core.submit(specs)
        await asyncio.sleep(0.1)  # the short samples are delivered, the long ones part-way
        await core.checkpoint()
        await core.stop()
        return core.snapshot()

    saved = run_virtual(first())
    assert len(saved.groups) == 3 and saved.last_cursor == 3
    partial = {r.request_id: len(r.token_ids) for g in saved.groups for r in g.requests if r.finish_reason is None}
    assert len(partial) == 3 and all(n > 0 for n in partial.values())

    async def second():
        core = RolloutCore([SimEngine("e0", SimParams(**FAST))], make_placement("least-assigned"), Clock())
        assert core.open_state(str(tmp_path), 0.002, WIRE_SAMPLES)
        assert [r.request_id for r in core.queue] == sorted(partial) and core.knows("g0")
        await core.start()
        got = []
        async for entry in core.delivery.stream("c"):
            got.append(entry)
            if len(got) == 6:
                break
        await core.stop()
        return got

    got = run_virtual(second())
    assert sorted(e.sample.sample_id for e in got) == sorted(f"g{i}/{j}" for i in range(3) for j in range(2))
    resumed = [e.sample for e in got if e.sample.sample_id in partial]
    assert all(len(s.response_token_ids) == 400 and s.engines == ["e0", "e0"] for s in resumed)
