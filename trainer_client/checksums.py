"""The per-tensor checksums of a weight push, as the service verifies them
(they live in `rollout_proto.checksums`, shared by both ends)."""
from rollout_proto.checksums import ALGOS, hexdigest, new_hasher

__all__ = ["ALGOS", "hexdigest", "new_hasher"]
