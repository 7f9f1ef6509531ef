"""Failures inside the core are loud: counted, shown in the status, retried
where a retry can help, and never lose a sample or strand a group."""
from __future__ import annotations

import asyncio
import dataclasses

from rollout_service.core.clock import Clock, run_virtual
from rollout_service.core.rollout import CoreLimits, RolloutCore
from rollout_service.engines.sim import SimEngine, SimParams
from rollout_service.engines.types import SamplingParams
from rollout_service.lifecycle.types import GroupSpec
from rollout_service.partial.carry_over import CarryOverConfig
from rollout_service.scheduling import make_placement
from rollout_service.scheduling.length_predictor import LengthPredictor
from rollout_service.scheduling.rebalancer import RebalanceConfig

FAST = dict(decode_base_s=0.001, decode_per_seq_s=0.0, prefill_per_token_s=0.0, max_seqs=4096,
            kv_capacity_tokens=10_000_000)


def _engine(engine_id: str = "e0") -> SimEngine:
    return SimEngine(engine_id, SimParams(**FAST))


def _groups(n: int, lengths: list[int], prefix: str = "g", text: str = "", max_tokens: int = 100_000) -> list[GroupSpec]:
    meta = {"sim.target_lengths": ",".join(map(str, lengths))}
    return [GroupSpec(f"{prefix}{i}", [1, 2, 3], len(lengths), SamplingParams(max_tokens=max_tokens),
                      prompt_text=text, metadata=dict(meta)) for i in range(n)]


async def _collect(core: RolloutCore, expected: int, timeout_s: float = 60.0) -> list:
    got = []

    async def read():
        async for entry in core.delivery.stream("c"):
            got.append(entry)
            if len(got) == expected:
                return

    try:
        await asyncio.wait_for(read(), timeout_s)  # virtual seconds: a stranded sample fails fast
    except asyncio.TimeoutError:
        pass
    return got


def _finish_with(core_kwargs: dict, tap=None, text: str = ""):
    async def main():
        core = RolloutCore([_engine()], make_placement("least-assigned"), Clock(), **core_kwargs)
        if tap is not None:
            core.sample_taps.append(tap)
        await core.start()
        core.submit(_groups(2, [3, 5, 7], text=text))
        got = await _collect(core, 6)
        await core.stop()
        return core, got

    return run_virtual(main())


def _assert_delivered_and_counted(core, got) -> None:
    assert len(got) == 6, "every sample is delivered"
    assert sum(e.group_complete for e in got) == 2, "both groups complete"
    assert not core.groups
    assert core.counters["finish_errors"] == 6
    assert core.counters["samples_completed"] == 6


def test_a_raising_sample_tap_still_delivers_the_sample_and_is_counted():
    def tap(sample):
        raise RuntimeError("tap bug")

    _assert_delivered_and_counted(*_finish_with({}, tap=tap))


def test_a_raising_detokenizer_still_delivers_the_sample_and_is_counted():
    class Broken:
        def decode(self, token_ids):
            raise ValueError("bad token")

    core, got = _finish_with({"detokenizer": Broken()}, text="a prompt")
    _assert_delivered_and_counted(core, got)
    assert all(e.sample.response_text == "" for e in got)


def test_a_raising_predictor_still_delivers_the_sample_and_is_counted():
    class Broken(LengthPredictor):
        def observe(self, req, length, group_done):
            raise KeyError("predictor bug")

    _assert_delivered_and_counted(*_finish_with({"predictor": Broken()}))


class _FlakyPlacement:
    """least-assigned, after raising on its first `failures` calls."""

    name = "flaky"
    predictor = None

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.inner = make_placement("least-assigned")

    def place(self, queue, loads, assigned, in_flight=None):
        if self.failures:
            self.failures -= 1
            raise RuntimeError("placement bug")
        return self.inner.place(queue, loads, assigned)


def test_a_failing_placement_is_retried_counted_and_shown_in_the_status():
    async def main():
        core = RolloutCore([_engine()], _FlakyPlacement(3), Clock())
        await core.start()
        core.submit(_groups(2, [3, 4]))
        got = await _collect(core, 4)
        status = core.status()
        await core.stop()
        return got, status

    got, status = run_virtual(main())
    assert len(got) == 4, "the queue is served once placement recovers"
    assert status.placement_errors == 3
    assert status.placement_error == ""  # recovered
    assert status.counters["placement_errors"] == 3


def test_a_failing_placement_leaves_its_last_error_in_the_status():
    async def main():
        core = RolloutCore([_engine()], _FlakyPlacement(10**9), Clock())
        await core.start()
        core.submit(_groups(1, [3]))
        await asyncio.sleep(1.0)
        status = core.status()
        await core.stop()
        return status

    status = run_virtual(main())
    assert "placement bug" in status.placement_error
    assert status.placement_errors >= 3  # retried with back-off while the queue waits


class _Dying(SimEngine):
    """A simulated engine that can be declared dead; its restart then takes an hour."""

    dead = False

    def load(self):
        load = super().load()
        return dataclasses.replace(load, state="dead") if self.dead else load

    async def start(self) -> None:
        if self.dead:
            await asyncio.sleep(3600)
        await super().start()


def test_no_task_the_core_created_is_pending_after_stop():
    async def main():
        before = asyncio.all_tasks()
        engines = [_engine("e0"), _Dying("e1", SimParams(**FAST))]
        core = RolloutCore(engines, make_placement("length-aware"), Clock(), CoreLimits(health_interval_s=0.05),
                           rebalance=RebalanceConfig(enabled=True, interval_s=0.01),
                           carry_over=CarryOverConfig(max_version_lag=0, stale_action="drop"))
        await core.start()
        core.submit(_groups(4, [5, 100_000]))
        await asyncio.sleep(0.5)
        from rollout_service.engines.weights import StagedWeights

        await core.update_weights(1, StagedWeights([]))  # drops every group still running
        core.submit(_groups(4, [5, 100_000], prefix="h"))
        await asyncio.sleep(0.2)
        engines[1].dead = True
        await asyncio.sleep(0.2)  # the watcher has started its restart
        await core.stop()
        me = asyncio.current_task()
        return [t for t in asyncio.all_tasks() - before if t is not me and not t.done()]

    assert run_virtual(main()) == []


def test_aborted_groups_leave_no_state_in_the_length_predictor():
    # Through the core's abort path, a sample of each group finished first:
    # rounds of 2,000 groups (an abort pass quadratic in the groups it stops
    # shows at that size), and not one group may stay open in the predictor.
    groups, rounds = 10_000, 5

    async def main():
        predictor = LengthPredictor()
        core = RolloutCore([_engine()], make_placement("least-assigned"), Clock(), predictor=predictor)
        await core.start()
        per_round = groups // rounds
        for r in range(rounds):
            specs = _groups(per_round, [1, 100_000], prefix=f"r{r}-")
            core.submit(specs)
            got = await _collect(core, per_round)  # the short sample of every group
            assert len(got) == per_round
            core.delivery.ack("c", got[-1].cursor)
            await core.abort([s.group_id for s in specs])
        await core.stop()
        return predictor

    predictor = run_virtual(main())
    assert predictor.open_groups == 0


def test_the_predictor_forgets_100k_given_up_groups():
    from rollout_service.lifecycle.types import Group, Request

    predictor = LengthPredictor()
    for i in range(100_000):
        group = Group(_groups(1, [1, 2], prefix=f"x{i}-")[0])
        req = Request(f"x{i}/0", group, 0)
        predictor.observe(req, 1, group_done=False)
        predictor.predict(Request(f"x{i}/1", group, 1))
        predictor.forget_group(group.group_id)
    assert predictor.open_groups == 0


def test_a_request_every_engine_refuses_is_given_up_and_reported_not_retried_forever():
    """An engine that raises on `add` for one request (a sampling setting it
    does not support) while serving the others: after a few attempts the
    sample is delivered aborted with the engine's error, and the rest of the
    group and the service go on."""
    from rollout_service.core.clock import Clock, run_virtual
    from rollout_service.core.rollout import MAX_FAILURES_WITHOUT_PROGRESS, RolloutCore
    from rollout_service.engines.base import EngineError
    from rollout_service.engines.sim import SimEngine, SimParams
    from rollout_service.engines.types import FinishReason, SamplingParams
    from rollout_service.lifecycle.types import GroupSpec
    from rollout_service.scheduling import make_placement

    class Picky(SimEngine):
        def add(self, request):
            if request.request_id.endswith("/1"):
                raise EngineError("temperature must be at most 2")
            return super().add(request)

    async def main():
        core = RolloutCore([Picky(f"e{i}", SimParams(seed=i)) for i in range(2)], make_placement("least-assigned"), Clock())
        core.submit([GroupSpec("g", [1, 2, 3], 3, SamplingParams(max_tokens=50),
                               metadata={"sim.target_lengths": "20"})])
        await core.start()
        got = []
        async for entry in core.delivery.stream("c"):
            got.append(entry)
            if entry.group_complete:
                break
        await core.stop()
        return core, {e.sample.index: e.sample for e in got}

    core, got = run_virtual(main())
    assert sorted(got) == [0, 1, 2]
    assert got[1].finish_reason == FinishReason.ABORTED and "temperature must be at most 2" in got[1].drop_reason
    assert got[0].finish_reason == got[2].finish_reason == FinishReason.STOP
    assert core.counters["requests_requeued"] == MAX_FAILURES_WITHOUT_PROGRESS - 1


def test_an_engine_that_dies_while_a_pause_resume_push_pauses_its_requests_delivers_each_sample_once():
    """Under `pause-resume` the push pauses every running request. An engine
    that stops while the push is still aborting requests on another engine
    hands its requests back to the queue, and they may finish elsewhere
    before the push ends: the push must not queue them again (each would
    then run twice and be delivered twice)."""
    from rollout_service.engines.weights import StagedWeights

    class SlowAbort(SimEngine):
        async def abort(self, request_id):
            await asyncio.sleep(1.0)
            return await super().abort(request_id)

    async def main():
        slow, other = SlowAbort("e0", SimParams(**FAST)), _engine("e1")
        core = RolloutCore([slow, other], make_placement("least-assigned"), Clock(),
                           carry_over=CarryOverConfig(mode="pause-resume"))
        await core.start()
        core.submit(_groups(2, [2000, 2000, 2000, 2000]))
        await asyncio.sleep(0.1)
        assert {core.requests.get(r).engine_id for r in core.running} == {"e0", "e1"}

        async def stop_other_mid_push():
            await asyncio.sleep(0.5)  # the push is aborting e0's requests, one by one
            await other.close()

        await asyncio.gather(core.update_weights(1, StagedWeights([])), stop_other_mid_push())
        queued = [r.request_id for r in core.queue]
        got = await _collect(core, 8)
        await core.stop()
        return queued, got

    queued, got = run_virtual(main())
    assert len(queued) == len(set(queued)), f"a request is queued twice: {sorted(queued)}"
    ids = [(e.sample.group_id, e.sample.index) for e in got]
    assert len(ids) == len(set(ids)) == 8, f"each sample exactly once, got {sorted(ids)}"
