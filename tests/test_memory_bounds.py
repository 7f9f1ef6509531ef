"""Resident memory of the real server process stays flat while clients
abandon what they started: 100,000 trajectories nobody answers, after
20,000 more that warm the server up (they end at `observation_timeout_s`),
and 1,000 consumers that open a stream and vanish without closing their
connections (keepalives end their streams, `consumer_ttl_s` drops them).
Each prints its figures:

    pytest tests/test_memory_bounds.py -s
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import psutil

from trainer_client import MultiTurn, PromptGroup, RolloutClient

from helpers import free_port, wait_until

ROUNDS = 5


def _serve(*settings: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "rollout_service.cli", "serve", "--engine", "sim", "--num-engines", "2",
         "--grpc-port", str(port), "--http-port", str(free_port()), "--set", "engine.max_seqs=256",
         "--set", 'engine.sim={decode_base_s=0.001, decode_per_seq_s=0.00001, length_median=12}',
         "--set", "log_level=\"WARNING\""] + [a for s in settings for a in ("--set", s)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return server, port


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def _flat(label: str, rss: list[float], warm: int = 1) -> None:
    """The last three rounds together grow the server's RSS by at most 10%.
    The first `warm` rounds warm the process up (allocator arenas, gRPC's
    buffers, the tables' high-water marks: 5-10% more after round 2 whatever
    the code); after them, what a round leaks adds up: 1 KiB kept per sample
    would add 20 MiB a round here."""
    base = rss[warm]
    assert len(rss) == warm + 4, "three rounds measured after the warm-up"
    print(f"{label}: server RSS per round (MiB): {', '.join(f'{r:.0f}' for r in rss)}; "
          f"last / round {warm + 1} = {rss[-1] / base:.3f}")
    assert rss[-1] <= base * 1.10, rss


def test_100k_abandoned_trajectories_end_at_their_deadline_and_memory_stays_flat():
    server, port = _serve("observation_timeout_s=0.5")  # looked for every 0.5 s: a round waits ~1 s for its last
    per_round = 100_000 // ROUNDS
    # A round of 20,000 on a busy host can still raise the high-water marks
    # in round 3 (RSS 186, 193, 211, 212, 213 MiB once): one more round to warm up.
    rounds = ROUNDS + 1

    async def run() -> list[float]:
        rss = []
        async with RolloutClient(f"127.0.0.1:{port}", consumer_id="trainer") as client:
            await client.wait_ready(60)
            stream = client.stream(ack_every=512)
            for r in range(rounds):
                t0 = time.monotonic()
                groups = [PromptGroup(prompt_token_ids=[1, 5, 9] * 10, num_samples=16, max_tokens=8,
                                      multi_turn=MultiTurn(max_turns=4), group_id=f"r{r}-{g}")
                          for g in range(per_round // 16)]
                for i in range(0, len(groups), 1000):
                    await client.submit(groups[i:i + 1000])
                ended = 0
                async for s in stream:  # turn events nobody answers, then each trajectory's end
                    if not s.awaiting_observation:
                        assert s.finish_reason == "aborted" and s.drop_reason.startswith("observation_timeout")
                        ended += 1
                        if ended == per_round:
                            break
                await client.ack()
                status = await client.status()
                assert status.open_groups == 0
                rss.append(_rss_mib(server.pid))
                print(f"round {r + 1}: {per_round} trajectories abandoned and ended in {time.monotonic() - t0:.1f} s, "
                      f"{status.retained_samples} samples retained, RSS {rss[-1]:.0f} MiB")
        return rss

    try:
        rss = asyncio.run(asyncio.wait_for(run(), 600))
    finally:
        _stop(server)
    _flat(f"{per_round * rounds:,} abandoned trajectories", rss, warm=2)


VANISHING = """
import asyncio, sys, grpc
from rollout_proto import rollout_pb2 as pb, rollout_pb2_grpc

async def main(address, tag):
    # 10 connections, 100 streams each, 1,000 consumers; each reads one sample, then the process is frozen.
    channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(10)]
    stubs = [rollout_pb2_grpc.RolloutServiceStub(c) for c in channels]
    calls = [stubs[i % 10].StreamSamples(pb.StreamSamplesRequest(consumer_id=f"{tag}-{i}")) for i in range(1000)]
    print("open", flush=True)
    await asyncio.gather(*(c.read() for c in calls))
    print("ready", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def test_1000_consumers_that_vanish_mid_stream_stop_pinning_samples_and_memory_stays_flat():
    server, port = _serve("keepalive_s=1.0", "keepalive_timeout_s=1.0", "consumer_ttl_s=2.0")

    async def run() -> list[float]:
        rss = []
        async with RolloutClient(f"127.0.0.1:{port}", consumer_id="trainer") as trainer:
            await trainer.wait_ready(60)
            stream = trainer.stream(ack_every=256)
            for r in range(ROUNDS):
                t0 = time.monotonic()
                gone = subprocess.Popen([sys.executable, "-c", VANISHING, f"127.0.0.1:{port}", f"r{r}"],
                                        stdout=subprocess.PIPE, text=True)
                try:
                    assert gone.stdout.readline().strip() == "open"
                    await trainer.submit([PromptGroup(prompt_token_ids=[1, 5], num_samples=1, max_tokens=4,
                                                      group_id=f"r{r}-first")])
                    line = await asyncio.wait_for(asyncio.to_thread(gone.stdout.readline), 60)
                    assert line.strip() == "ready"
                    os.kill(gone.pid, signal.SIGSTOP)  # vanished: its connections stay open, unanswered
                    # Keepalives close the frozen client's connections (its side waits to close them), and
                    # with them its 1,000 streams: idle, they would keep their consumers live.
                    conns = lambda: [c for c in psutil.Process(gone.pid).net_connections("tcp") if c.raddr
                                     and c.raddr.port == port]
                    await wait_until(lambda: conns() and all(c.status == psutil.CONN_CLOSE_WAIT for c in conns()),
                                     30, "keepalives to close the vanished client's connections")
                    groups = [PromptGroup(prompt_token_ids=[1, 5, 9] * 20, num_samples=16, max_tokens=16,
                                          group_id=f"r{r}-{g}") for g in range(1250)]
                    for i in range(0, len(groups), 1000):
                        await trainer.submit(groups[i:i + 1000])
                    got = 0
                    async for _ in stream:
                        got += 1
                        if got == 1 + 20_000:
                            break
                    await trainer.ack()
                    # Its 1,000 consumers no longer pin what the trainer acknowledged.
                    await wait_until(lambda: _retained(trainer), 30, "the delivery log to empty")
                finally:
                    gone.kill()
                    gone.wait()
                rss.append(_rss_mib(server.pid))
                print(f"round {r + 1}: 1,000 consumers vanished, 20,000 samples delivered and freed in "
                      f"{time.monotonic() - t0:.1f} s, RSS {rss[-1]:.0f} MiB")
        return rss

    try:
        rss = asyncio.run(asyncio.wait_for(run(), 600))
    finally:
        _stop(server)
    _flat("1,000 vanished consumers per round", rss)


async def _retained(client: RolloutClient) -> bool:
    return (await client.status()).retained_samples == 0
