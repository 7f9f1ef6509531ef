"""`rollout-service bench` against stock vLLM's OpenAI server on the bundled
model, and against this service on the same model with the same workload:
both deliver every sample at its traced length, and `bench compare` puts
the two reports side by side (docs/benchmarking.md keeps that table)."""
from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys
import tempfile
import urllib.request

import pytest

from helpers import free_port, vllm_model, wait_until_sync
from rollout_service.bench.report import compare
from rollout_service.bench.run import BenchOptions, run_bench

WORKLOAD = dict(workload="math", quick=True, steps=2, groups_per_step=4, max_model_len=1024, run_timeout_s=300)


def _vllm_serve(port: int, log) -> subprocess.Popen:
    """`vllm serve` as a user starts it on this CPU: the bundled model, the
    service's engine settings (float32, eager, 32 sequences, 1 GiB of KV cache)."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", vllm_model(), "--dtype", "float32",
         "--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "32", "--seed", "0",
         "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT)


def _healthy(server: subprocess.Popen, port: int, log) -> bool:
    if server.poll() is not None:
        log.seek(0)
        pytest.fail(f"vllm serve exited {server.returncode}: {log.read()[-2000:]}")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


async def _bench(target: str) -> dict:
    return await run_bench(BenchOptions(target=target, **WORKLOAD), out=io.StringIO())


async def test_bench_runs_the_same_workload_against_vllm_serve_and_the_service_side_by_side(vllm_service):
    port = free_port()
    log = tempfile.TemporaryFile(mode="w+")
    server = _vllm_serve(port, log)
    try:
        await asyncio.to_thread(wait_until_sync, lambda: _healthy(server, port, log), 300, "vllm serve's /health", 1.0)
        vllm_doc = await _bench(f"http://127.0.0.1:{port}")
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
    service_doc = await _bench(f"http://127.0.0.1:{vllm_service.http_port}")
    for doc in (vllm_doc, service_doc):
        s = doc["summary"]
        assert s["samples_delivered"] == s["samples_submitted"] > 0 and not s["errors"], s["errors"]
        assert s["lengths_matched"] == 1.0  # min_tokens = max_tokens with ignore_eos: both honour it
        assert s["tokens_per_s"] > 0 and s["ttft_s"]["p50"] > 0
    assert vllm_doc["summary"]["tokens"] == service_doc["summary"]["tokens"]  # the same work
    table = compare(vllm_doc, service_doc, ("vllm serve", "rollout-service"))
    print(table)
    assert "tokens/s" in table and "vllm serve" in table
