"""Runs inside every vLLM worker process (`worker_extension_cls`).

vLLM mixes this class into its worker, so `collective_rpc("rollout_...")`
reaches these methods in the process that holds the model. Loading from a
staged safetensors file keeps the weights out of vLLM's RPC messages.
"""
from __future__ import annotations

import os
import resource
import time


def _iter_safetensors(path: str):
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


def _usage() -> tuple[float, float, resource.struct_rusage]:
    """(wall clock, this process's CPU seconds, its resource usage)."""
    return time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)


def reload_report(start, end, **extra) -> dict:
    """Where a reload's wall time went: the process's CPU seconds, page
    faults that read from disk, and how often it was preempted. A reload
    whose wall time is far above its CPU time waited: for a core, for
    the disk, or for memory."""
    (w0, c0, u0), (w1, c1, u1) = start, end
    return {"pid": os.getpid(), "wall_s": w1 - w0, "cpu_s": c1 - c0,
            "major_faults": u1.ru_majflt - u0.ru_majflt,
            "involuntary_switches": u1.ru_nivcsw - u0.ru_nivcsw,
            "voluntary_switches": u1.ru_nvcsw - u0.ru_nvcsw, **extra}


def _tied_modules(model) -> list:
    """Modules reachable under two names, or sharing a parameter with an
    earlier module (a tied lm_head and embedding)."""
    seen_modules: set[int] = set()
    seen_params: set[int] = set()
    tied, tied_ids = [], set()
    for _, module in model.named_modules(remove_duplicate=False):
        shared = id(module) in seen_modules
        seen_modules.add(id(module))
        for p in module.parameters(recurse=False):
            shared |= id(p) in seen_params
            seen_params.add(id(p))
        if shared and id(module) not in tied_ids:
            tied.append(module)
            tied_ids.add(id(module))
    return tied


def _repack(modules) -> None:
    """Refresh the kernel copies (CPU repacking) of modules an in-place
    reload processed under one name only (`_tied_modules`)."""
    for module in modules:
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)


def draft_model_of(model_runner):
    """The draft model of a model runner, V1 or V2 (vLLM 0.32's default on
    CUDA, which has no `drafter` attribute): `get_draft_model()`, which also
    unwraps a CUDA-graph wrapper. Raises RuntimeError naming the runner
    when there is none."""
    get = getattr(model_runner, "get_draft_model", None)
    if not callable(get):
        raise RuntimeError(f"{type(model_runner).__qualname__} has no get_draft_model() in this vLLM: "
                           "draft weights cannot be pushed")
    model = get()
    if model is None:
        raise RuntimeError("this engine has no draft model")
    return model


class RolloutWorkerExtension:
    def rollout_reload_weights(self, path: str) -> dict:
        """Reload the target model's weights in place from a safetensors file
        in checkpoint (Hugging Face) format; returns where the time went
        (`reload_report`).

        On the CPU backend a layer keeps a repacked copy of its weight for its
        kernels; an in-place reload refreshes it once per module, which leaves
        the second user of a tied weight (the lm_head of a model with tied
        embeddings) on the old copy. Those modules are repacked again here."""
        count, read_s = 0, 0.0

        def counted():
            nonlocal count, read_s
            t = time.perf_counter()
            for item in _iter_safetensors(path):
                read_s += time.perf_counter() - t
                count += 1
                yield item
                t = time.perf_counter()
            read_s += time.perf_counter() - t  # closing the file

        start = _usage()
        model = self.model_runner.get_model()
        tied = _tied_modules(model)
        self.model_runner.reload_weights(weights_iterator=counted())
        _repack(tied)
        return reload_report(start, _usage(), tensors=count, read_s=read_s)

    def rollout_reload_draft_weights(self, path: str) -> int:
        """Reload the draft model's weights in place from a safetensors file
        in checkpoint format; returns the tensor count. Only engines started
        with `method="draft_model"` or `"eagle"` have a draft model to reload."""
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        model = draft_model_of(self.model_runner)
        tied = _tied_modules(model)  # the drafter's lm_head shares its embedding too
        items = list(_iter_safetensors(path))
        reload_weights(self.vllm_config, model, weights_iterator=iter(items), weights_path=None,
                       is_checkpoint_format=True)
        _repack(tied)
        return len(items)

    # -- staged collective receive (vllm_transfer.GlooWeightTransferEngine) --------

    def _gloo_transfer(self):
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None or not hasattr(engine, "begin_staged_receive"):
            raise RuntimeError("this engine's weight-transfer backend cannot receive staged (gloo only)")
        return engine

    def rollout_begin_staged_receive(self, update_info: dict) -> None:
        self._gloo_transfer().begin_staged_receive(update_info)

    def rollout_staged_receive_state(self) -> tuple[bool, str]:
        return self._gloo_transfer().staged_receive_state()

    def rollout_load_staged(self) -> int:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):  # as the worker's own update_weights loads
            return self._gloo_transfer().load_staged()

    def rollout_drop_staged(self) -> None:
        self._gloo_transfer().drop_staged()

    def rollout_attach_sibling_drafter(self) -> bool:
        """Give the sibling proposer (`vllm_siblings`) the model runner; True
        if this engine drafts from siblings."""
        drafter = getattr(self.model_runner, "drafter", None)
        if not hasattr(drafter, "attach"):
            return False
        drafter.attach(self.model_runner)
        return True

    def rollout_spec_sampler_patched(self) -> tuple[int, bool, str]:
        """(pid, whether this worker runs the exact rejection-sampler
        expansion of `vllm_plugin`, why not if it does not)."""
        from rollout_service.engines.vllm_plugin import sampler_status

        patched, reason = sampler_status()
        return os.getpid(), patched, reason

    def rollout_device(self) -> dict:
        """Where this worker computes: its pid, `CUDA_VISIBLE_DEVICES`, the
        model's device, that GPU's identity (`rollout_proto.devices`: host,
        UUID and PCI bus id; "" on a CPU) and the cores its threads may run on."""
        from rollout_proto.devices import device_of

        device = next(self.model_runner.get_model().parameters()).device
        where = device_of(device)
        cores = set()
        for task in os.listdir("/proc/self/task"):  # the OpenMP threads are bound, not the process
            try:
                cores |= os.sched_getaffinity(int(task))
            except OSError:  # a thread that has exited
                pass
        return {"pid": os.getpid(), "visible": os.environ.get("CUDA_VISIBLE_DEVICES", ""), "device": str(device),
                "uuid": where.uuid, "host": where.host, "pci_bus_id": where.pci_bus_id, "cores": sorted(cores)}
