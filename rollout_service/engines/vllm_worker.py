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

    def rollout_reload_draft_weights(self, path: str) -> int:
        """Reload the draft model's weights in place from a safetensors file
        in checkpoint format; returns the tensor count. Only engines started
        with `method="draft_model"` have a draft model to reload."""
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        drafter = getattr(self.model_runner, "drafter", None)
        model = getattr(drafter, "model", None)
        if model is None:
            raise RuntimeError("this engine has no draft model")
        items = list(_iter_safetensors(path))
        reload_weights(self.vllm_config, model, weights_iterator=iter(items), weights_path=None,
                       is_checkpoint_format=True)
        return len(items)

    def rollout_spec_sampler_patched(self) -> tuple[int, bool]:
        """(pid, whether this worker runs the exact rejection-sampler
        expansion of `vllm_plugin`)."""
        import os

        from rollout_service.engines.vllm_plugin import sampler_is_patched

        return os.getpid(), sampler_is_patched()
