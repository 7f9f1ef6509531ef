"""rollout-service: an asynchronous rollout service for RL of LLMs."""
__version__ = "0.1.0"
