"""The committed stubs match proto/rollout/v1/rollout.proto."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_committed_stubs_are_not_stale(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    gen.generate(tmp_path)
    for name in gen.GENERATED:
        fresh = (tmp_path / name).read_text()
        committed = (ROOT / "rollout_proto" / name).read_text()
        assert fresh == committed, f"rollout_proto/{name} is stale: run `make proto`"
