"""The layer contract of docs/architecture.md (pyproject.toml, import-linter):
dependencies point down only, the api never imports the vLLM engine, the
trainer client speaks only the wire contract, and the server imports its
client only in the client commands (`status`, `demo`)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = str(Path(sys.executable).with_name("lint-imports"))


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([LINT, str(root / "pyproject.toml"), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_code_keeps_the_layer_contract():
    out = _lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "BROKEN" not in out.stdout


def _copy(tmp_path: Path) -> Path:
    for name in ("rollout_service", "trainer_client", "rollout_proto"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("*.safetensors", "__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_an_upward_import_breaks_the_contract(tmp_path):
    root = _copy(tmp_path)
    types = root / "rollout_service" / "engines" / "types.py"
    types.write_text(types.read_text() + "\nfrom rollout_service.core.rollout import RolloutCore  # noqa\n")
    out = _lint(root)
    assert out.returncode != 0
    assert "rollout_service.engines.types -> rollout_service.core.rollout" in out.stdout


def test_a_server_module_importing_the_client_breaks_the_contract(tmp_path):
    root = _copy(tmp_path)
    delivery = root / "rollout_service" / "core" / "delivery.py"
    delivery.write_text(delivery.read_text() + "\nimport trainer_client  # noqa\n")
    out = _lint(root)
    assert out.returncode != 0
    assert "rollout_service.core.delivery -> trainer_client" in out.stdout


# Private names of the standard library that research/ reaches on purpose: (file, name) -> why.
STDLIB_PRIVATE = {("interrupt.py", "_exit"): "os._exit: leave at once from a signal handler",
                  ("interrupt.py", "_exit_function"): "multiprocessing's exit handler, run before os._exit"}


def _private_uses(source: str) -> list[str]:
    """The product's private names a research module uses: `_name` imported
    from rollout_service (or a private module of it), or an attribute
    `x._name` of anything but `self` and `cls`."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rollout_service"):
            parts = node.module.split(".") + [a.name for a in node.names]
            found += [f"import {node.module}.{p}" for p in parts if p.startswith("_") and not p.startswith("__")]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"line {node.lineno}: .{node.attr}")
    return found


def test_research_uses_the_products_public_names_only():
    """research/ (the studies, not installed) drives the product through its
    public modules: a private name it reached would break unannounced."""
    assert _private_uses("from rollout_service.engines.vllm import _alive\nengine._llm.generate()\n") == [
        "import rollout_service.engines.vllm._alive", "line 2: ._llm"]
    for path in sorted((ROOT / "research").rglob("*.py")):
        uses = [u for u in _private_uses(path.read_text())
                if (path.name, u.rsplit(".", 1)[-1]) not in STDLIB_PRIVATE]
        assert not uses, f"{path.relative_to(ROOT)} uses private names: {uses}"
