"""Generate the Python stubs of proto/rollout/v1/rollout.proto into rollout_proto/.

Usage: python scripts/gen_proto.py [OUT_DIR]   (default: the rollout_proto package)

The stubs are committed; tests/test_wire_stubs.py fails when they are stale.
"""
from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto" / "rollout" / "v1" / "rollout.proto"
GENERATED = ("rollout_pb2.py", "rollout_pb2.pyi", "rollout_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{ROOT / 'proto'}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(PROTO),
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in GENERATED:
            text = (Path(tmp) / "rollout" / "v1" / name).read_text()
            # Generated code imports by proto path (rollout.v1); make it package-relative.
            text = re.sub(r"^from rollout\.v1 import", "from . import", text, flags=re.M)
            (out_dir / name).write_text(text)


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "rollout_proto")
