"""Load tests and benchmarks of the rollout service."""
