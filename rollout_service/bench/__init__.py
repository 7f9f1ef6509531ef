"""`rollout-service bench`: load-test a running deployment by address.

The workloads (the bundled PolyTrace traces, synthetic ones, a user's trace
folder or prompt file) and the closed- and open-loop drivers are shared with
the studies on in-process fleets (`research/`, not installed); the targets speak the service's
gRPC API or any OpenAI-compatible `/v1/completions`."""
