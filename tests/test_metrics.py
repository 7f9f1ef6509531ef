"""/metrics parses as Prometheus text and its series move under load."""
from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from trainer_client import PromptGroup

from conftest import unique
from test_streaming import collect


async def _scrape(port) -> dict[str, list]:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
            assert r.status == 200
            text = await r.text()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _value(families, name, **labels):
    """Sum of the samples called `name` (or `name`_total for counters)."""
    return sum(s.value for samples in families.values() for s in samples
               if s.name in (name, f"{name}_total") and all(s.labels.get(k) == v for k, v in labels.items()))


async def test_metrics_series_change_under_load(sim_service, client):
    port = sim_service.http_port
    before = await _scrape(port)
    for series in ("rollout_policy_version", "rollout_queued_requests", "rollout_engine_running",
                   "rollout_engine_kv_usage", "rollout_engine_tokens_per_s", "rollout_sample_latency_seconds",
                   "rollout_weight_update_seconds"):
        assert series in before, series
    gid = unique("metrics")
    await client.submit([PromptGroup(prompt_token_ids=[1, 5], num_samples=8, max_tokens=200, group_id=gid,
                                     metadata={"sim.target_lengths": "150"})])
    during = await _scrape(port)
    assert _value(during, "rollout_engine_running") > 0
    await collect(client, gid, 8)
    import numpy as np

    await client.push_weights({"w": np.ones(8, np.float32)}, version=(await client.status()).policy_version + 1)
    after = await _scrape(port)
    assert _value(after, "rollout_samples_completed") >= _value(before, "rollout_samples_completed") + 8
    assert _value(after, "rollout_tokens_generated") >= _value(before, "rollout_tokens_generated") + 8 * 150
    assert _value(after, "rollout_sample_latency_seconds_count") >= _value(before, "rollout_sample_latency_seconds_count") + 8
    assert _value(after, "rollout_weight_update_seconds_count") == _value(before, "rollout_weight_update_seconds_count") + 1
    assert _value(after, "rollout_policy_version") == _value(before, "rollout_policy_version") + 1


async def test_readyz_reports_engines_up(sim_service):
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{sim_service.http_port}/readyz") as r:
            body = await r.json()
            assert r.status == 200 and body["ready"]
