"""Generated stubs of the rollout.v1 wire contract (proto/rollout/v1/rollout.proto),
and the code both ends of a weight push need: the checksums (`checksums`),
the dtype sizes (`dtypes`), the collective data plane (`collective`) and its
trainer-side gloo engine (`gloo_trainer`).

Shared by the server and the trainer client, and importing neither;
regenerate the stubs with `python scripts/gen_proto.py`.
"""
from rollout_proto import rollout_pb2, rollout_pb2_grpc

__all__ = ["rollout_pb2", "rollout_pb2_grpc"]
