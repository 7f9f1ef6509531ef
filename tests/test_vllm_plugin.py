"""The vLLM plugin's rejection-sampler fix says when it is not in place,
and why (no engine starts: the fix is applied to this process)."""
from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm")

from rollout_service.engines import vllm_plugin  # noqa: E402


@pytest.fixture
def rejection_sampler(monkeypatch):
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler as module

    if not current_platform.is_cpu():
        pytest.skip("the fix applies to vLLM's CPU platform only")
    original = module.expand_batch_to_tokens
    monkeypatch.setattr(module, vllm_plugin.PATCHED_ATTR, False, raising=False)
    yield module
    module.expand_batch_to_tokens = original
    setattr(module, vllm_plugin.PATCHED_ATTR, False)


def test_the_plugin_patches_the_cpu_rejection_sampler(rejection_sampler, monkeypatch):
    monkeypatch.delenv("ROLLOUT_STOCK_SPEC_SAMPLER", raising=False)
    vllm_plugin._patch_rejection_sampler()
    assert rejection_sampler.expand_batch_to_tokens is vllm_plugin.exact_expand_batch_to_tokens
    assert vllm_plugin.sampler_status() == (True, "")


def test_the_stock_sampler_flag_is_reported_as_the_reason(rejection_sampler, monkeypatch):
    monkeypatch.setenv("ROLLOUT_STOCK_SPEC_SAMPLER", "1")
    vllm_plugin._patch_rejection_sampler()
    patched, reason = vllm_plugin.sampler_status()
    assert not patched and "ROLLOUT_STOCK_SPEC_SAMPLER=1" in reason


def test_a_changed_vllm_layout_is_logged_loudly_and_reported(rejection_sampler, monkeypatch, caplog):
    monkeypatch.delenv("ROLLOUT_STOCK_SPEC_SAMPLER", raising=False)
    monkeypatch.delattr(rejection_sampler, "expand_batch_to_tokens")
    with caplog.at_level(logging.ERROR, logger=vllm_plugin.__name__):
        vllm_plugin._patch_rejection_sampler()
    patched, reason = vllm_plugin.sampler_status()
    assert not patched and "expand_batch_to_tokens" in reason
    assert any(r.levelno == logging.ERROR and "inexact" in r.getMessage() for r in caplog.records)
