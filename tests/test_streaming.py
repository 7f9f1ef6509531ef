"""Submitting groups and streaming samples through the real server and client."""
from __future__ import annotations

import asyncio

from trainer_client import PromptGroup, RolloutClient

from helpers import collect, unique, wait_until


def groups_of(prefix: str, n: int, samples: int, **kw) -> list[PromptGroup]:
    return [
        PromptGroup(prompt_token_ids=[1, 10 + i % 50, 20], num_samples=samples, max_tokens=kw.pop("max_tokens", 256),
                    group_id=f"{prefix}-{i}", **kw)
        for i in range(n)
    ]


async def test_256_samples_stream_every_group_completes_once(client):
    prefix = unique("g")
    ids = await client.submit(groups_of(prefix, 32, 8))
    assert len(ids) == 32
    samples = await collect(client, prefix, 256)
    assert len({s.sample_id for s in samples}) == 256
    cursors = [s.cursor for s in samples]
    assert cursors == sorted(cursors) and len(set(cursors)) == len(cursors)
    completes = [s.group_id for s in samples if s.group_complete]
    assert sorted(completes) == sorted(ids)  # every group completes exactly once
    for gid in ids:
        group = [s for s in samples if s.group_id == gid]
        assert sorted(s.index for s in group) == list(range(8))
        # The complete marker sits on the last sample of the group to arrive.
        assert max(group, key=lambda s: s.cursor).group_complete
    for s in samples:
        assert len(s.logprobs) == len(s.response_token_ids) > 0
        assert sum(n for _, _, n in s.versions) == len(s.response_token_ids)
        assert s.finish_reason in ("stop", "length")


async def test_reconnect_with_same_consumer_id_loses_and_duplicates_nothing(sim_service):
    prefix = unique("rc")
    consumer = unique("trainer")
    address = f"127.0.0.1:{sim_service.grpc_port}"
    async with RolloutClient(address, consumer_id=consumer) as first:
        await first.submit(groups_of(prefix, 16, 8))
        processed = await collect(first, prefix, 100)
        await first.ack()  # the trainer has processed these 100
        unacked = await collect(first, prefix, 20)  # received, never acknowledged
    # A new process (no client-side state) reconnects under the same id.
    async with RolloutClient(address, consumer_id=consumer) as second:
        rest = await collect(second, prefix, 128 - 100)
        await second.ack()
        processed_ids = [s.sample_id for s in processed + rest]
    assert len(processed_ids) == 128 and len(set(processed_ids)) == 128
    # What was received but not acknowledged came back.
    assert {s.sample_id for s in unacked} <= {s.sample_id for s in rest}


async def test_same_client_resumes_after_its_last_cursor_without_acks(client):
    prefix = unique("resume")
    await client.submit(groups_of(prefix, 4, 8))
    part = await collect(client, prefix, 10)
    rest = await collect(client, prefix, 22)
    assert len({s.sample_id for s in part + rest}) == 32


async def test_groups_iterator_yields_complete_groups(client):
    prefix = unique("grp")
    await client.submit(groups_of(prefix, 6, 4))
    got = []

    async def run():
        async for group in client.groups():
            if group[0].group_id.startswith(prefix):
                got.append(group)
                if len(got) == 6:
                    return

    await asyncio.wait_for(run(), 30)
    for group in got:
        assert [s.index for s in group] == [0, 1, 2, 3]
        assert len({s.group_id for s in group}) == 1


async def test_resubmitting_a_group_id_does_not_create_a_second_group(client):
    gid = unique("idem")
    g = groups_of(gid, 1, 4)[0]
    first = await client.submit_detailed([g])
    again = await client.submit_detailed([g])
    assert first == [(g.group_id, True)] and again == [(g.group_id, False)]
    samples = await collect(client, g.group_id, 4)
    assert sorted(s.index for s in samples) == [0, 1, 2, 3]
    # Still idempotent after the group has finished.
    assert await client.submit_detailed([g]) == [(g.group_id, False)]
    status = await client.status()
    assert status.counters["samples_submitted"] >= 4
    await asyncio.sleep(0.2)  # nothing more arrives over a while: a check of absence needs a window
    extra = [s async for s in _drain(client, g.group_id, 0.3)]
    assert extra == []


async def _drain(client, prefix, seconds):
    async def gen():
        async for s in client.stream():
            if s.group_id.startswith(prefix):
                yield s

    it = gen().__aiter__()
    while True:
        try:
            yield await asyncio.wait_for(it.__anext__(), seconds)
        except (asyncio.TimeoutError, StopAsyncIteration):
            return


async def test_abort_keep_partial_returns_tokens_tagged_with_version(sim_service, client):
    gid = unique("abort")
    g = PromptGroup(prompt_token_ids=[1, 5, 6], num_samples=2, max_tokens=1000, group_id=gid,
                    metadata={"sim.target_lengths": "900"})
    await client.submit([g])
    await wait_until(lambda: all(r.token_ids for r in sim_service.core.groups[gid].requests), 30,
                     "both samples under way")
    version = (await client.status()).policy_version
    n, partials = await client.abort([gid], keep_partial=True)
    assert n == 1 and len(partials) == 2
    for s in partials:
        assert s.finish_reason == "aborted"
        assert 0 < len(s.response_token_ids) < 900
        assert len(s.logprobs) == len(s.response_token_ids)
        assert s.token_versions() == [version] * len(s.response_token_ids)
    status = await client.status()
    assert status.counters["groups_aborted"] >= 1
