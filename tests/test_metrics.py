"""/metrics parses as Prometheus text and its series move under load."""
from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from trainer_client import PromptGroup

from helpers import collect, unique


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


async def _families(port) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain; version=")
            return {f.name: f for f in text_string_to_metric_families(await r.text())}


async def test_every_metric_has_help_and_type_and_the_names_users_scrape(sim_service, client):
    gid = unique("help")
    await client.submit([PromptGroup(prompt_token_ids=[1, 5], num_samples=3, max_tokens=20, group_id=gid)])
    await collect(client, gid, 3)
    families = await _families(sim_service.http_port)
    for f in families.values():
        assert f.documentation and f.type in ("gauge", "counter", "histogram"), f.name
    kinds = {
        "rollout_policy_version": "gauge", "rollout_queued_requests": "gauge", "rollout_running_requests": "gauge",
        "rollout_retained_samples": "gauge", "rollout_samples_completed": "counter",
        "rollout_tokens_generated": "counter", "rollout_samples_by_lag": "counter",
        "rollout_placement_errors": "counter", "rollout_engine_running": "gauge", "rollout_engine_waiting": "gauge",
        "rollout_engine_kv_usage": "gauge", "rollout_engine_tokens_per_s": "gauge",
        "rollout_engine_kv_used_tokens": "gauge", "rollout_engine_kv_capacity_tokens": "gauge",
        "rollout_sample_latency_seconds": "histogram", "rollout_weight_update_seconds": "histogram",
    }
    for name, kind in kinds.items():
        assert families[name].type == kind, name
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    engines = sorted(sim_service.core.engines)
    for eid in engines:
        load = sim_service.core.engines[eid].load()
        assert samples[("rollout_engine_kv_capacity_tokens", (("engine", eid),))] == load.kv_capacity_tokens > 0
        assert ("rollout_engine_kv_used_tokens", (("engine", eid),)) in samples
    assert samples[("rollout_samples_completed_total", ())] >= 3
    assert sum(v for (n, labels), v in samples.items() if n == "rollout_samples_by_lag_total") >= 3
    assert samples[("rollout_sample_latency_seconds_count", ())] >= 3
    assert samples[("rollout_sample_latency_seconds_bucket", (("le", "+Inf"),))] == \
        samples[("rollout_sample_latency_seconds_count", ())]
    assert samples[("rollout_placement_errors_total", ())] == 0


def _status_with(core, **changes):
    import dataclasses

    real = core.status
    return lambda: dataclasses.replace(real(), **changes)


async def test_readyz_is_503_while_the_last_dispatch_failed(sim_service, monkeypatch):
    core = sim_service.core
    url = f"http://127.0.0.1:{sim_service.http_port}"
    monkeypatch.setattr(core, "status", _status_with(core, placement_errors=3,
                                                     placement_error="engine sim-0: connection refused"))
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/readyz") as r:
            body = await r.json()
            assert r.status == 503 and not body["ready"]
            assert body["placement_errors"] == 3 and "placement_error" not in body  # no error text: it is open
        async with s.get(f"{url}/v1/status") as r:
            assert (await r.json())["placement_error"] == "engine sim-0: connection refused"
        families = await _families(sim_service.http_port)
        assert families["rollout_placement_errors"].samples[0].value == 3
        assert families["rollout_placement_last_failed"].samples[0].value == 1
        # A dispatch succeeded since: ready again, the count stays.
        monkeypatch.setattr(core, "status", _status_with(core, placement_errors=3, placement_error=""))
        async with s.get(f"{url}/readyz") as r:
            body = await r.json()
            assert r.status == 200 and body["ready"] and body["placement_errors"] == 3


async def test_spec_metrics_per_engine(monkeypatch):
    """The speculative decoding series, from a service whose simulated
    engines speculate."""
    from rollout_service.service import RolloutService

    from helpers import sim_config

    spec = {"method": "draft_model", "num_speculative_tokens": 3, "schedule": [[1, 4, 3], [5, 64, 0]]}
    service = RolloutService(sim_config(num_engines=1, spec=spec))
    await service.start()
    try:
        from trainer_client import RolloutClient

        async with RolloutClient(f"127.0.0.1:{service.grpc_port}", consumer_id=unique("spec-m")) as c:
            gid = unique("spec-m")
            await c.submit([PromptGroup(prompt_token_ids=[1, 2, 3], num_samples=2, max_tokens=40, group_id=gid)])
            await collect(c, gid, 2)
        families = await _families(service.http_port)
    finally:
        await service.stop()
    [eid] = service.core.engines
    assert families["rollout_spec_draft_tokens"].type == "counter"
    assert families["rollout_spec_draft_tokens"].samples[0].name == "rollout_spec_draft_tokens_total"
    assert families["rollout_spec_draft_tokens"].samples[0].value > 0
    depth = {s.labels["batch"]: s.value for s in families["rollout_spec_depth"].samples if s.labels["engine"] == eid}
    assert depth == {"1-4": 3, "5-64": 0}
    assert [s.labels["position"] for s in families["rollout_spec_acceptance_by_position"].samples] == ["1", "2", "3"]
    for name in ("rollout_spec_accepted_tokens", "rollout_spec_mean_acceptance_length", "rollout_spec_draft_version",
                 "rollout_spec_tokens_per_s_per_seq"):
        assert families[name].documentation, name
