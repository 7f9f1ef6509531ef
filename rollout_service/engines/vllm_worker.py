"""Runs inside every vLLM worker process (`worker_extension_cls`).

vLLM mixes this class into its worker, so `collective_rpc("rollout_...")`
reaches these methods in the process that holds the model. Loading from a
staged safetensors file keeps the weights out of vLLM's RPC messages.
"""
from __future__ import annotations


def _iter_safetensors(path: str):
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


class RolloutWorkerExtension:
    def rollout_reload_weights(self, path: str) -> int:
        """Reload the target model's weights in place from a safetensors file
        in checkpoint (Hugging Face) format; returns the tensor count."""
        count = 0

        def counted():
            nonlocal count
            for item in _iter_safetensors(path):
                count += 1
                yield item

        self.model_runner.reload_weights(weights_iterator=counted())
        return count
