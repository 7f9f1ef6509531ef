"""`rollout-service serve` as a user runs it: health check and `status`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from helpers import free_port


def test_serve_answers_health_check_and_status_command():
    grpc_port, http_port = free_port(), free_port()
    exe = [sys.executable, "-m", "rollout_service.cli"]
    server = subprocess.Popen(
        exe + ["serve", "--engine", "sim", "--grpc-port", str(grpc_port), "--http-port", str(http_port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        stub = health_pb2_grpc.HealthStub(channel)
        deadline = time.time() + 60
        while True:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service="rollout.v1.RolloutService"), timeout=2)
                break
            except grpc.RpcError:
                assert server.poll() is None, server.stdout.read()
                assert time.time() < deadline, "server did not come up"
                time.sleep(0.3)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        out = subprocess.run(exe + ["status", "--address", f"127.0.0.1:{grpc_port}"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "sim-0" in out.stdout and "sim-1" in out.stdout and "policy version 0" in out.stdout
        out = subprocess.run(exe + ["status", "--json", "--address", f"127.0.0.1:{grpc_port}"], capture_output=True,
                             text=True, timeout=60)
        status = json.loads(out.stdout)
        assert status["policy_version"] == 0 and [e["engine_id"] for e in status["engines"]] == ["sim-0", "sim-1"]
        assert status["spec"] is None and isinstance(status["counters"], dict)
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/readyz", timeout=5) as r:
            assert r.status == 200
        channel.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert server.returncode == 0


def test_status_of_an_absent_server_fails_clearly():
    port = free_port()
    out = subprocess.run([sys.executable, "-m", "rollout_service.cli", "status", "--address", f"127.0.0.1:{port}",
                          "--timeout", "2"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "cannot reach a rollout service" in out.stderr
