"""Generate the Python stubs of proto/rollout/v1/rollout.proto into rollout_proto/.

Usage: python scripts/gen_proto.py [OUT_DIR]   (default: the rollout_proto package)

The stubs are committed; tests/test_wire_stubs.py fails when they are stale.
The grpc stub's version check names the grpcio floor of pyproject.toml, not
the grpcio-tools that generated it, so that a newer release of the tools
regenerates the same file (and an older grpcio is still refused).
"""
from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "proto" / "rollout" / "v1" / "rollout.proto"
GENERATED = ("rollout_pb2.py", "rollout_pb2.pyi", "rollout_pb2_grpc.py")


def grpcio_floor() -> str:
    """The lowest grpcio pyproject.toml accepts ("grpcio>=X")."""
    found = re.search(r'"grpcio>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    if found is None:
        raise SystemExit("pyproject.toml names no grpcio>= floor")
    return found.group(1)


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
            text = re.sub(r"^GRPC_GENERATED_VERSION = '[^']*'", f"GRPC_GENERATED_VERSION = '{grpcio_floor()}'",
                          text, flags=re.M)
            (out_dir / name).write_text(text)


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "rollout_proto")
