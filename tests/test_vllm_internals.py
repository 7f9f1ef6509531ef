"""The vLLM internals the service relies on are checked at engine start, and
a vLLM without one is refused loudly, naming it and the version; draft
weights reach the draft model through model runner V2 (vLLM's default on
CUDA) as through V1. No engine starts: the checks read vLLM's classes, and
V2's runner is exercised with its real `get_draft_model` on an instance
built without a GPU."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from rollout_service.engines.base import EngineError  # noqa: E402
from rollout_service.engines.vllm_internals import TESTED_VLLM, check_internals, missing_internals  # noqa: E402
from rollout_service.engines.vllm_worker import draft_model_of  # noqa: E402


def test_the_installed_vllm_has_every_internal_relied_on():
    import vllm

    assert vllm.__version__ == TESTED_VLLM
    assert missing_internals(spec_enabled=True, draft_model=True) == []


def test_a_model_runner_v2_without_get_draft_model_stops_the_engine_naming_it(monkeypatch):
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    monkeypatch.delattr(GPUModelRunner, "get_draft_model")
    check_internals(spec_enabled=True, draft_model=False, v2_model_runner=True)  # not needed without a drafter
    with pytest.raises(EngineError) as err:
        check_internals(spec_enabled=True, draft_model=True, v2_model_runner=True)
    assert "gpu.model_runner.GPUModelRunner.get_draft_model" in str(err.value)
    assert f"vLLM {TESTED_VLLM}" in str(err.value)


def test_a_front_end_without_a_weight_update_hook_is_refused(monkeypatch):
    from vllm.v1.engine.async_llm import AsyncLLM

    monkeypatch.delattr(AsyncLLM, "pause_generation")
    with pytest.raises(EngineError, match=r"AsyncLLM\.pause_generation"):
        check_internals(spec_enabled=False, draft_model=False)


def test_request_state_without_weight_version_starts_is_refused_not_silently_mis_tagged(monkeypatch):
    from vllm.v1.engine.output_processor import RequestState

    def init(self, *args, **kwargs):  # a release that no longer records version starts
        self.request_id = None

    monkeypatch.setattr(RequestState, "__init__", init)
    with pytest.raises(EngineError, match=r"RequestState\.weight_version_starts"):
        check_internals(spec_enabled=False, draft_model=False)


def test_a_scheduler_without_the_depth_lookup_is_refused_only_when_speculating(monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.setattr(Scheduler, "__init__", lambda self, *a, **k: None)
    assert missing_internals(spec_enabled=False, draft_model=False) == []
    assert missing_internals(spec_enabled=True, draft_model=False) == ["Scheduler.dynamic_sd_lookup"]


def _v2_runner(speculator):
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    runner = object.__new__(GPUModelRunner)  # no GPU: only the attribute get_draft_model reads
    runner.speculator = speculator
    return runner


def test_draft_weights_reach_the_draft_model_of_model_runner_v2():
    # What V2 builds for method "draft_model" (spec_decode.init_speculator).
    from vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator import StandaloneARSpeculator

    assert not hasattr(_v2_runner(None), "drafter")  # V2 has no `drafter`, which V1's path used
    speculator = object.__new__(StandaloneARSpeculator)
    speculator.model = torch.nn.Linear(4, 4)
    assert draft_model_of(_v2_runner(speculator)) is speculator.model
    with pytest.raises(RuntimeError, match="no draft model"):
        draft_model_of(_v2_runner(object()))  # e.g. n-gram drafting: nothing to push


def test_draft_weights_reach_the_draft_model_of_model_runner_v1():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = object.__new__(GPUModelRunner)
    runner.drafter = type("Drafter", (), {})()
    runner.drafter.model = torch.nn.Linear(4, 4)
    assert draft_model_of(runner) is runner.drafter.model
    with pytest.raises(RuntimeError, match="has no get_draft_model"):
        draft_model_of(object())
