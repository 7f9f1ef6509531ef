"""Crashes on real processes: SIGKILL the service, start it again, and the
public client sees every sample once (with `state_dir`) or a
ServiceRestarted naming what was lost (without)."""
from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from rollout_service.api.convert import WIRE_SAMPLES
from trainer_client import PromptGroup, RolloutClient, ServiceRestarted

from helpers import free_port, wait_until

WEIGHTS = {"w": np.arange(64, dtype=np.float32).reshape(8, 8)}


class Server:
    """The service as a process of its own on fixed loopback ports, so that
    a restart is found where the killed one was."""

    def __init__(self, state_dir=None, step_s: float = 0.002, *extra: str) -> None:
        self.grpc_port, self.http_port = free_port(), free_port()
        self.args = [sys.executable, "-m", "rollout_service.cli", "serve", "--engine", "sim", "--num-engines", "2",
                     "--grpc-port", str(self.grpc_port), "--http-port", str(self.http_port),
                     "--set", f"engine.sim.decode_base_s={step_s}", "--set", "engine.sim.decode_per_seq_s=0.0",
                     "--set", "log_level=\"WARNING\"", *extra]
        if state_dir is not None:
            self.args += ["--set", f'state_dir="{state_dir}"']
        self.proc: subprocess.Popen | None = None
        self.address = f"127.0.0.1:{self.grpc_port}"
        self.max_file_bytes: int | None = None  # RLIMIT_FSIZE of the next start: writes past it fail (EFBIG)

    def start(self) -> "Server":
        limit = self.max_file_bytes

        def limit_files() -> None:
            import resource

            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                     preexec_fn=limit_files if limit is not None else None)
        return self

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> str:
        """Stop it (if running) and return the end of its stderr."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.stderr.read()[-3000:]


def _groups(prefix: str, n: int, samples: int = 4, length: int = 40, spread: int = 30) -> list[PromptGroup]:
    return [PromptGroup(prompt_token_ids=[1, 5, i % 50], num_samples=samples, max_tokens=length + spread * samples,
                        group_id=f"{prefix}{i}",
                        metadata={"sim.target_lengths": ",".join(str(length + spread * j) for j in range(samples))})
            for i in range(n)]


async def _consume(client: RolloutClient, out: list, until: int, ack_every: int = 3) -> None:
    """Stream until `out` holds `until` samples, acknowledging every
    `ack_every` and all at the end (ack_every=None: none)."""
    async for s in client.stream(ack_every=ack_every or 1 << 62):
        out.append(s)
        if len(out) >= until:
            if ack_every:
                await client.ack()
            return


async def _snoop(address: str, seen: dict[int, str], total: int) -> None:
    """A consumer that never acknowledges: it records which sample each
    cursor carried (from cursor 0, across restarts of one incarnation)."""
    async with RolloutClient(address, consumer_id="snoop", reconnect_timeout_s=60) as snoop:
        async for s in snoop.stream(ack_every=1 << 62, from_cursor=0):
            assert seen.setdefault(s.cursor, s.sample_id) == s.sample_id, f"cursor {s.cursor} changed its sample"
            if len(seen) >= total:
                return


async def test_sigkill_with_state_dir_delivers_every_sample_once_under_its_cursor(tmp_path):
    server = Server(tmp_path, 0.004).start()
    groups = _groups("k", 12)
    got: list = []
    seen: dict[int, str] = {}
    try:
        async with RolloutClient(server.address, consumer_id="trainer", reconnect_timeout_s=60) as client:
            await client.wait_ready(60)
            await client.push_weights(WEIGHTS, version=3)
            await client.submit(groups)
            before = (await client.status()).incarnation
            snoop = asyncio.create_task(_snoop(server.address, seen, 48))
            consumer = asyncio.create_task(_consume(client, got, 48))
            await wait_until(lambda: len(got) >= 12 or consumer.done(), 60, "12 samples before the kill")
            server.kill()
            server.start()  # same ports, same state_dir
            await asyncio.wait_for(consumer, 60)
            status = await client.status()
            await asyncio.wait_for(snoop, 30)
            # Everything acknowledged survives another SIGKILL and never comes again.
            server.kill()
            server.start()
            async with RolloutClient(server.address, consumer_id="trainer", reconnect_timeout_s=60) as again:
                await again.wait_ready(60)
                # Streamed in cursor order: a sample acknowledged before (a lower cursor) would come
                # before the first of a group submitted now.
                await again.submit(_groups("after", 1, samples=1, length=1, spread=0))
                late = []
                await asyncio.wait_for(_consume(again, late, 1), 30)
                assert late[0].group_id == "after0", "an acknowledged sample was delivered again"
                assert (await again.status()).incarnation == before
    finally:
        print(server.stop())
    ids = [s.sample_id for s in got]
    assert len(ids) == 48 and len(set(ids)) == 48, "a sample was lost or delivered twice"
    assert status.incarnation == before, "the same state_dir is the same incarnation"
    assert {s.cursor: s.sample_id for s in got} == seen, "a re-delivered sample changed its cursor"
    assert status.policy_version == 3, "the restarted service does not serve the pushed weights"
    assert all(v == 3 for s in got for v, _, _ in s.versions), "a token is tagged with a version that did not serve"
    assert sorted(s.group_id for s in got if s.group_complete) == sorted(g.group_id for g in groups)


async def test_a_consumer_that_never_acknowledged_keeps_its_samples_across_a_sigkill(tmp_path):
    """Another consumer acknowledging everything does not take, across a
    restart, the samples of one that is connected and never acknowledged."""
    server = Server(tmp_path, 0.002).start()
    got, again = [], []
    try:
        async with RolloutClient(server.address, consumer_id="trainer", reconnect_timeout_s=60) as client:
            await client.wait_ready(60)
            await client.submit(_groups("q", 3, length=5, spread=0))
            async with RolloutClient(server.address, consumer_id="watcher") as watcher:
                await asyncio.wait_for(_consume(watcher, [], 1, ack_every=None), 30)
            await asyncio.wait_for(_consume(client, got, 12), 30)  # and acknowledges all 12
            server.kill()
            server.start()
            async with RolloutClient(server.address, consumer_id="watcher", reconnect_timeout_s=60) as watcher:
                await watcher.wait_ready(60)
                await asyncio.wait_for(_consume(watcher, again, 12, ack_every=None), 30)
    finally:
        print(server.stop())
    assert sorted(s.sample_id for s in again) == sorted(s.sample_id for s in got)


async def test_a_restart_without_state_dir_raises_service_restarted_naming_the_groups():
    server = Server(None, 0.01).start()
    try:
        async with RolloutClient(server.address, consumer_id="trainer", reconnect_timeout_s=60) as client:
            await client.wait_ready(60)
            await client.submit(_groups("a", 2, length=5, spread=0))  # short: complete before the kill
            got: list = []
            await _consume(client, got, 8)
            await client.submit(_groups("b", 3, length=1000, spread=0))
            server.kill()
            server.start()
            t0 = None

            async def consume():
                nonlocal t0
                async for _ in client.stream():
                    pass

            task = asyncio.create_task(consume())
            async with RolloutClient(server.address) as probe:
                await probe.wait_ready(60)
            t0 = time.monotonic()
            with pytest.raises(ServiceRestarted) as err:
                await asyncio.wait_for(task, 30)
            waited = time.monotonic() - t0
    finally:
        print(server.stop())
    assert sorted(err.value.group_ids) == ["b0", "b1", "b2"]
    assert "resubmit_on_restart" in str(err.value) and "b0" in str(err.value)
    assert waited < 10, f"ServiceRestarted came {waited:.1f} s after the service was back"


async def test_resubmit_on_restart_completes_the_groups_without_duplicates():
    server = Server(None, 0.004).start()
    groups = _groups("r", 6, samples=4, length=20, spread=60)
    got: list = []
    try:
        async with RolloutClient(server.address, consumer_id="trainer", reconnect_timeout_s=60,
                                 resubmit_on_restart=True) as client:
            await client.wait_ready(60)
            await client.submit(groups)
            consumer = asyncio.create_task(_consume(client, got, 24))
            await wait_until(lambda: len(got) >= 6 or consumer.done(), 60, "6 samples before the kill")
            server.kill()
            server.start()
            await asyncio.wait_for(consumer, 60)
    finally:
        print(server.stop())
    pairs = [(s.group_id, s.index) for s in got]
    assert len(pairs) == 24 and len(set(pairs)) == 24
    assert sorted(s.group_id for s in got if s.group_complete) == sorted(g.group_id for g in groups)


@pytest.mark.parametrize("version", [1, 99])  # 1: the release before token ids were packed after the JSON
def test_a_journal_of_another_format_version_is_refused_saying_what_to_do(tmp_path, version):
    from rollout_service.core.journal import FORMAT_VERSION, JOURNAL_FILE, frame

    (tmp_path / JOURNAL_FILE).write_bytes(frame({"t": "header", "format": version, "incarnation": "x"}))
    server = Server(tmp_path).start()
    assert server.proc.wait(60) == 2
    err = server.proc.stderr.read()
    assert f"journal format version {version}" in err and f"reads version {FORMAT_VERSION}" in err
    assert "move state_dir" in err
    assert "Traceback" not in err


async def test_replay_and_compaction_give_back_each_sample_as_recorded(tmp_path):
    """Sample records leave the prompt to their group's record: a replay (of
    the journal, and of its compaction once the group is finished) gives
    back every field, the prompt included."""
    import dataclasses
    from array import array

    from rollout_service.core.durable import DurableState
    from rollout_service.core.snapshot import CoreSnapshot
    from rollout_service.engines.types import FinishReason, SamplingParams
    from rollout_service.lifecycle.types import Group, GroupSpec, MultiTurnSpec, Sample, Turn
    from rollout_service.lifecycle.versions import NO_VERSION, VersionTags

    spec = GroupSpec("g", [1, 5, 6, 7], 3, SamplingParams(max_tokens=20, stop_token_ids=(3,), stop=("x",)),
                     metadata={"k": "v"}, batch_id="b", multi_turn=MultiTurnSpec(max_turns=2))
    group = Group(spec, submitted_at=1.5)
    logprobs = array("f", [-0.25 * i for i in range(10)]).tolist()  # float32, as the wire carries them
    sample = Sample(sample_id="g/1", group_id="g", index=1, prompt_id="", prompt_token_ids=spec.prompt_token_ids,
                    response_token_ids=list(range(100, 110)), logprobs=logprobs,
                    versions=VersionTags([[0, 0, 4], [NO_VERSION, 4, 2], [1, 6, 4]]), finish_reason=FinishReason.STOP,
                    engines=["sim-0"], num_migrations=1, queued_at=1.0, first_token_at=2.0, finished_at=3.0,
                    metadata={"k": "v"}, batch_id="b",
                    turns=[Turn("generated", 0, 4, "sim-0", FinishReason.STOP, 1.0, 2.0),
                           Turn("observation", 4, 2, tool_s=0.5), Turn("generated", 6, 4, "sim-1", None, 2.5)],
                    loss_mask=[1] * 4 + [0] * 2 + [1] * 4, awaiting_observation=True)
    # A single-turn sample, quoting and non-ASCII text included.
    plain = dataclasses.replace(sample, sample_id="g/0", index=0, versions=VersionTags([[1, 0, 10]]), turns=[],
                                loss_mask=[], engines=["sim-0", "sim-1"], response_text='é "q"\n', drop_reason="d",
                                awaiting_observation=False)
    state = DurableState(str(tmp_path), 0.002, WIRE_SAMPLES)
    assert state.open() is None
    state.rewrite_now(CoreSnapshot(policy_version=0))  # the header, as at a start
    state.journal.start()
    state.record_submit(group)
    state.record_sample(6, plain, False)
    state.record_sample(7, sample, False)
    await state.journal.commit()
    await state.journal.close()
    snapshot = DurableState(str(tmp_path), 0.002, WIRE_SAMPLES).open()
    assert [g.spec for g in snapshot.groups] == [spec]
    assert [(e.cursor, dataclasses.asdict(e.sample)) for e in snapshot.entries] == [
        (6, dataclasses.asdict(plain)), (7, dataclasses.asdict(sample))]
    # Compacted once the group is done: its prompt comes with its retained sample.
    snapshot.groups, snapshot.done_group_ids = [], ["g"]
    state = DurableState(str(tmp_path), 0.002, WIRE_SAMPLES)
    state.open()
    state.rewrite_now(snapshot)
    again = DurableState(str(tmp_path), 0.002, WIRE_SAMPLES).open()
    assert not again.groups and again.done_group_ids == ["g"]
    assert [dataclasses.asdict(e.sample) for e in again.entries] == [dataclasses.asdict(plain), dataclasses.asdict(sample)]


async def test_a_compaction_while_the_writer_is_busy_keeps_what_came_after_it(tmp_path):
    """The journal is rewritten as a snapshot while records are being
    written: every commit completes (bounded), and a reopen gives back the
    snapshot and what was appended after it, in order."""
    from rollout_service.core.delivery import Consumer
    from rollout_service.core.durable import DurableState
    from rollout_service.core.snapshot import CoreSnapshot

    state = DurableState(str(tmp_path), 0.0, WIRE_SAMPLES)
    assert state.open() is None
    state.rewrite_now(CoreSnapshot(policy_version=0))
    state.journal.start()
    for round_ in range(20):
        for i in range(50):
            state.record_ack("a", round_ * 100 + i)
        await asyncio.sleep(0.0005)  # the writer takes them, and may be writing them
        # The snapshot says "b" acknowledged what "a" did: "a" is in it no more.
        state.compact(CoreSnapshot(policy_version=0, consumers=[Consumer("b", round_ * 100 + 49)]))
        await asyncio.wait_for(state.journal.commit(), 10)
    state.record_ack("a", 5000)
    await asyncio.wait_for(state.journal.commit(), 10)
    await state.journal.close()
    again = DurableState(str(tmp_path), 0.0, WIRE_SAMPLES).open()
    assert sorted((c.consumer_id, c.acked) for c in again.consumers) == [("a", 5000), ("b", 1949)]


async def test_a_torn_tail_is_cut_and_what_came_before_it_survives(tmp_path):
    from rollout_service.core.journal import frame

    from helpers import running, sim_config

    cfg = sim_config(num_engines=1)
    cfg.state_dir = str(tmp_path)
    async with running(cfg) as service:
        async with RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id="c") as client:
            await client.submit(_groups("t", 2, samples=2, length=5, spread=0))
            got: list = []
            await _consume(client, got, 4, ack_every=None)
            await client.ack(got[1].cursor)  # two acknowledged, two not
            unacked = sorted((s.sample_id, s.cursor) for s in got[2:])
    journal = tmp_path / "journal.log"
    # A crash mid-write: the last record (an ack of everything) lost its end.
    with open(journal, "ab") as f:
        f.write(frame({"t": "ack", "consumer": "c", "c": 10**6})[:-7])
    async with running(cfg) as service:
        async with RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id="c") as client:
            again: list = []
            await asyncio.wait_for(_consume(client, again, 2, ack_every=None), 30)
            created = dict(await client.submit_detailed(_groups("t", 2) + _groups("n", 1)))
    assert sorted((s.sample_id, s.cursor) for s in again) == unacked, "the unacknowledged samples under their cursors"
    assert created == {"t0": False, "t1": False, "n0": True}


async def test_weights_after_a_restart_are_the_last_pushed_or_the_version_really_served(tmp_path):
    server = Server(tmp_path).start()
    try:
        async with RolloutClient(server.address, consumer_id="w", reconnect_timeout_s=60) as client:
            await client.wait_ready(60)
            await client.push_weights(WEIGHTS, version=1)
            await client.push_weights({"w": WEIGHTS["w"] + 1}, version=2)
            server.kill()
            assert [p.name for p in tmp_path.glob("weights-*")] == ["weights-v2.safetensors"]
            server.start()
            await client.wait_ready(60)
            status = await wait_until(client.status, 60, "the restarted service")
            assert status.policy_version == 2 and all(e.policy_version == 2 for e in status.engines)
            await client.submit(_groups("w", 1, samples=2, length=5, spread=0))
            got: list = []
            await asyncio.wait_for(_consume(client, got, 2), 30)
            assert all(v == 2 for s in got for v, _, _ in s.versions)
            # Without the weights file the service serves, and says it serves, the model's own weights.
            server.kill()
            (tmp_path / "weights-v2.safetensors").unlink()
            server.start()
            await client.wait_ready(60)
            status = await wait_until(client.status, 60, "the restarted service")
            await client.submit(_groups("x", 1, samples=2, length=5, spread=0))
            got = []
            await asyncio.wait_for(_consume(client, got, 2), 30)
    finally:
        print(server.stop())
    assert status.policy_version == 0
    assert all(v == 0 for s in got for v, _, _ in s.versions)


async def test_a_trajectory_a_weight_push_restarted_stays_restarted_after_a_sigkill(tmp_path):
    """carry_over.mode="restart": a trajectory waiting for an answer to its
    turn 0 starts over at a push. Killed right after the push, the service
    comes back with the trajectory started over under the new version (a
    fresh turn-0 event), not waiting on the discarded turn."""
    from trainer_client import MultiTurn

    server = Server(tmp_path, 0.004, "--set", 'carry_over.mode="restart"').start()
    group = PromptGroup(prompt_token_ids=[1, 5, 6], num_samples=1, max_tokens=300, group_id="traj",
                        metadata={"sim.target_lengths": "300"}, multi_turn=MultiTurn(max_turns=2))
    try:
        async with RolloutClient(server.address, consumer_id="t", reconnect_timeout_s=60) as client:
            await client.wait_ready(60)
            await client.submit([group])
            events: list = []
            await asyncio.wait_for(_consume(client, events, 1, ack_every=1), 30)
            assert events[0].awaiting_observation and {v for v, _, _ in events[0].versions} == {0}
            await client.push_weights(WEIGHTS, version=1)  # turn 0 is discarded: 1.2 s to generate again
            server.kill()
            server.start()
            await client.wait_ready(60)
            again: list = []
            await asyncio.wait_for(_consume(client, again, 1, ack_every=1), 30)
    finally:
        print(server.stop())
    turn = again[0]
    assert turn.sample_id == "traj/0" and turn.awaiting_observation
    assert {v for v, _, _ in turn.versions} == {1}, "turn 0 generated again under the pushed version"
    assert len(turn.response_token_ids) == 300


async def test_a_journal_that_cannot_be_written_fails_submit_and_the_stream_naming_state_dir(tmp_path):
    """The kernel refuses the journal's writes past 64 KiB (RLIMIT_FSIZE,
    as a full disk would): the stream sends what was recorded, then ends
    with FAILED_PRECONDITION naming state_dir; Submit and Ack fail the same
    way, and so do a weight push and a trajectory's Continue (neither
    could be recorded); GetStatus and /readyz say so; a restart without the limit gives
    back every sample streamed before, under its cursor."""
    import aiohttp
    import grpc

    server = Server(tmp_path, 0.001)
    server.max_file_bytes = 64 * 1024
    server.start()
    got: list = []
    try:
        async with RolloutClient(server.address, consumer_id="c", reconnect_timeout_s=5) as client:
            await client.wait_ready(60)
            await client.submit(_groups("f", 10, samples=4, length=20, spread=5))  # ~25 KiB with its samples
            with pytest.raises(grpc.aio.AioRpcError) as submit_error:
                for i in range(30):  # ~24 KiB more each
                    await client.submit(_groups(f"f{i}_", 10, samples=4, length=20, spread=5))
            with pytest.raises(grpc.aio.AioRpcError) as stream_error:
                async with asyncio.timeout(60):
                    async for s in client.stream(ack_every=1 << 62):
                        got.append((s.cursor, s.sample_id))
            with pytest.raises(grpc.aio.AioRpcError) as ack_error:
                await client.ack(got[-1][0])
            with pytest.raises(grpc.aio.AioRpcError) as push_error:  # it would go live unrecorded
                await client.push_weights(WEIGHTS, version=1)
            with pytest.raises(grpc.aio.AioRpcError) as continue_error:
                await client.continue_trajectory("f0-0", 0, [1, 2])
            status = await client.status()
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://127.0.0.1:{server.http_port}/readyz") as r:
                    ready, ready_body = r.status, await r.text()
    finally:
        err = server.stop()
    for exc in (stream_error.value, submit_error.value, ack_error.value, push_error.value, continue_error.value):
        details = exc.details()
        assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, (exc.code(), details)
        assert f"state_dir {str(tmp_path)!r}: the journal cannot be written (File too large)" in details
        assert "/" not in details.replace(str(tmp_path), ""), "no path but state_dir's"
    assert len(got) >= 10, "what was recorded streamed"
    assert status.journal_error == submit_error.value.details()
    assert status.policy_version == 0, "the refused push is not serving"
    assert ready == 503 and '"journal_failed": true' in ready_body and "File too large" not in ready_body
    assert "Traceback" not in err
    # Without the limit: every sample streamed before the failure was on disk, under its cursor.
    server.max_file_bytes = None
    server.start()
    try:
        seen: dict[int, str] = {}
        await asyncio.wait_for(_snoop(server.address, seen, len(got)), 60)
    finally:
        print(server.stop())
    assert all(seen.get(cursor) == sample_id for cursor, sample_id in got)


async def _retry(what: str, call, timeout: float = 90.0):
    """`call()` until the service answers it (a restart in progress), bounded."""
    import grpc

    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL,
                                  grpc.StatusCode.UNKNOWN) or time.monotonic() > deadline:
                raise AssertionError(f"{what} failed: {exc.code().name} {exc.details()}") from exc
            await asyncio.sleep(0.2)


async def test_chaos_five_sigkills_in_a_closed_loop_of_1000_groups_lose_and_repeat_nothing(tmp_path):
    """A closed loop (64 groups in flight, a weight push every 100 groups)
    while the service is SIGKILLed at 5 random moments and restarted."""
    import grpc

    rng = random.Random(38)
    total, in_flight, kills = 1000, 64, sorted(rng.sample(range(60, 940), 5))
    server = Server(tmp_path, 0.001).start()
    got: dict[tuple[str, int], int] = {}  # (group, index) -> times received
    wrong_versions = []
    version = confirmed = 0  # pushed (maybe in flight), and known to serve
    submitted_at: dict[str, int] = {}  # group -> the version confirmed when it was submitted
    completed = killed = 0
    t0 = time.monotonic()

    def group(i: int) -> PromptGroup:
        return PromptGroup(prompt_token_ids=[1, 2, i % 97], num_samples=2, max_tokens=64, group_id=f"c{i}",
                           metadata={"sim.target_lengths": f"{4 + i % 7},{12 + i % 11}"})

    async def submit(i: int) -> None:
        submitted_at[f"c{i}"] = confirmed
        await _retry("submit", lambda: client.submit([group(i)]))

    async def push(v: int) -> None:
        nonlocal confirmed
        deadline = time.monotonic() + 90
        while True:
            try:
                await client.push_weights({"w": np.full((4, 4), v, dtype=np.float32)}, version=v)
                break
            except grpc.aio.AioRpcError as exc:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
                serving = (await _retry("status", client.status)).policy_version
                if serving >= v:  # applied; the reply was lost with the process
                    break
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise
        confirmed = v

    async def chaos() -> None:
        nonlocal killed
        for at in kills:
            await wait_until(lambda: completed >= at, 300, f"{at} groups")
            await asyncio.sleep(rng.uniform(0, 0.2))
            server.kill()
            killed += 1
            server.start()

    try:
        async with RolloutClient(server.address, consumer_id="trainer", reconnect_timeout_s=90) as client:
            await client.wait_ready(60)
            for i in range(in_flight):
                await submit(i)
            next_group = in_flight
            killer = asyncio.create_task(chaos())
            async for samples in client.groups():
                for s in samples:
                    got[(s.group_id, s.index)] = got.get((s.group_id, s.index), 0) + 1
                    tags = [v for v, _, _ in s.versions]
                    if min(tags) < submitted_at[s.group_id] or max(tags) > version:
                        wrong_versions.append((s.sample_id, tags, submitted_at[s.group_id], version))
                completed += 1
                if completed == total:
                    break
                if completed % 100 == 0:
                    version += 1
                    await push(version)
                if next_group < total:
                    await submit(next_group)
                    next_group += 1
            await asyncio.wait_for(killer, 60)
    finally:
        print(server.stop())
    duplicates = sum(n - 1 for n in got.values())
    print(f"chaos: {completed} groups, {len(got)} samples, {duplicates} duplicates, {killed} SIGKILLs, "
          f"{version} weight versions, {len(wrong_versions)} wrong version tags, {time.monotonic() - t0:.1f} s")
    assert killed == 5 and completed == total
    assert len(got) == 2 * total and duplicates == 0
    assert not wrong_versions, wrong_versions[:5]
