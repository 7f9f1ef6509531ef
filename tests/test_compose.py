"""docker-compose.yml is valid and everything it references exists.
(No Docker engine runs here: the file is checked, not run.)"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_compose_file_validates_with_docker_compose():
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose is not installed (.ci/run installs the Debian package)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    out = subprocess.run([exe, "-f", str(ROOT / "docker-compose.yml"), "config", "--quiet"],
                         capture_output=True, text=True, cwd=ROOT, env={**env, "ROLLOUT_WEIGHTS_TOKENS": "t"})
    assert out.returncode == 0, out.stderr
    # Closed by default: without a token the file does not start anything, and says what to set.
    out = subprocess.run([exe, "-f", str(ROOT / "docker-compose.yml"), "config", "--quiet"],
                         capture_output=True, text=True, cwd=ROOT, env=env)
    assert out.returncode != 0 and "ROLLOUT_WEIGHTS_TOKENS" in out.stderr


def test_every_service_that_serves_gets_the_tokens_shared_memory_and_a_grace_period():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    serving = {name: svc for name, svc in compose["services"].items() if (svc.get("command") or [""])[0] == "serve"}
    assert set(serving) == {"rollout", "rollout-gpu"}
    for name, svc in serving.items():
        assert {"ROLLOUT_SUBMIT_TOKENS", "ROLLOUT_WEIGHTS_TOKENS"} <= set(svc["environment"]), name
        # Weight pushes stage in /dev/shm: room of its own, or the host's (ipc: host).
        assert (svc.get("shm_size") or svc.get("ipc") == "host") and svc["stop_grace_period"], name


def test_every_file_and_command_the_compose_file_names_exists():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name, svc in compose["services"].items():
        build = svc.get("build")
        if build:
            dockerfile = ROOT / build.get("context", ".") / build.get("dockerfile", "Dockerfile")
            assert dockerfile.exists(), (name, dockerfile)
            for src in re.findall(r"^COPY\s+(\S+)", dockerfile.read_text(), flags=re.M):
                assert (ROOT / src).exists(), (dockerfile.name, src)
        for volume in svc.get("volumes", []):
            host = volume.split(":")[0]
            if host.startswith("./"):
                assert (ROOT / host).exists(), (name, host)
        entry = svc.get("entrypoint") or []
        scripts = [a for a in entry if a.endswith(".py")]
        for script in scripts:
            assert (ROOT / script).exists(), (name, script)
        command = svc.get("command") or []
        if command and command[0] in ("serve", "status", "demo"):
            from rollout_service.cli import main

            with pytest.raises(SystemExit) as exc:
                main([command[0], "--help"])
            assert exc.value.code == 0
