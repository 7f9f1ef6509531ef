"""Generated stubs of the rollout.v1 wire contract (proto/rollout/v1/rollout.proto).

Shared by the server's api layer and the trainer client; regenerate with
`python scripts/gen_proto.py`.
"""
from rollout_proto import rollout_pb2, rollout_pb2_grpc

__all__ = ["rollout_pb2", "rollout_pb2_grpc"]
