"""`rollout-service selftest` as a user runs it. On GPUs it is the check of
the GPU path; here its CPU mode runs (2 vLLM CPU engines, gloo for the
collective push, cores for devices), so that it does not rot."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

CHECKS = ["plan", "start", "devices", "generate", "push-grpc", "push-collective", "speculation", "push-draft"]


def test_selftest_on_the_cpu_passes_every_check_and_reports_each(own_vllm_engines):
    done = subprocess.run([sys.executable, "-m", "rollout_service.cli", "selftest", "--platform", "cpu", "--json",
                           "--timeout", "600"], capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["platform"] == "cpu" and report["passed"]
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == CHECKS
    # On 2 cores or more nothing is skipped: each engine on its own cores.
    assert all(c["status"] == "pass" and c["seconds"] > 0 for c in checks.values()), report
    assert "version 1 over gRPC" in checks["push-grpc"]["detail"]
    assert "version 2 over gloo" in checks["push-collective"]["detail"]


def test_selftest_for_a_platform_this_machine_lacks_fails_naming_it(capsys):
    pytest.importorskip("vllm")  # the machine's platform, as vLLM sees it
    from rollout_service.cli import main

    assert main(["selftest", "--platform", "cuda"]) == 1
    rows = {line.split()[0]: line.split(maxsplit=3)[1:] for line in capsys.readouterr().out.splitlines()[2:-1]}
    assert list(rows) == CHECKS
    assert rows["plan"][0] == "fail" and rows["plan"][2] == "--platform cuda: this machine runs vLLM's cpu platform"
    assert all(r[0] == "skip" and r[2] == "not run: an earlier check failed" for c, r in rows.items() if c != "plan")
