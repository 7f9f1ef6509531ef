"""A graceful restart: SIGTERM mid-rollout, start again, nothing lost or repeated."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

from trainer_client import PromptGroup, RolloutClient

from helpers import free_port


def _serve(grpc_port, http_port, state_dir):
    return subprocess.Popen(
        [sys.executable, "-m", "rollout_service.cli", "serve", "--engine", "sim", "--num-engines", "2",
         "--grpc-port", str(grpc_port), "--http-port", str(http_port),
         "--set", f'state_dir="{state_dir}"', "--set", "engine.sim.decode_base_s=0.005"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


async def test_sigterm_checkpoints_and_a_restarted_server_delivers_each_group_once(tmp_path):
    grpc_port, http_port = free_port(), free_port()
    server = _serve(grpc_port, http_port, tmp_path)
    groups = [PromptGroup(prompt_token_ids=[1, 5, i], num_samples=4, max_tokens=1000, group_id=f"r{i}",
                          metadata={"sim.target_lengths": f"{50 + 40 * i},{300},{120},{400}"}) for i in range(12)]
    received = []
    try:
        async with RolloutClient(f"127.0.0.1:{grpc_port}", consumer_id="trainer", reconnect_timeout_s=90) as client:
            await client.wait_ready(60)
            await client.submit(groups)

            async def consume():
                async for s in client.stream(ack_every=5):
                    received.append(s)
                    if len(received) == 48:
                        return

            task = asyncio.create_task(consume())
            deadline = time.time() + 120
            while len(received) < 10:
                assert not task.done() and time.time() < deadline, "the stream delivered fewer than 10 samples"
                await asyncio.sleep(0.05)
            server.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(server.wait, 60) == 0, server.stderr.read()
            assert (tmp_path / "journal.log").exists()
            server = _serve(grpc_port, http_port, tmp_path)  # same ports, same state
            await asyncio.wait_for(task, 120)
            status = await client.status()
            # Re-submitting after the restart does not create the groups again.
            assert all(not created for _, created in await client.submit_detailed(groups))
    finally:
        server.terminate()
        server.wait(60)
        print(server.stderr.read()[-3000:])
    ids = [s.sample_id for s in received]
    assert len(ids) == 48 and len(set(ids)) == 48
    assert sorted(s.group_id for s in received if s.group_complete) == sorted(g.group_id for g in groups)
    assert status.counters["samples_completed"] >= 48
    # Partial responses survived: some samples were resumed by re-prefill on the new server.
    assert status.counters.get("tokens_reprefilled", 0) > 0
