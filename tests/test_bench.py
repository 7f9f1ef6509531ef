"""`rollout-service bench` against a real service on loopback (simulated
engines), over gRPC and over its OpenAI-compatible side server."""
from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import numpy as np
import pytest

from helpers import free_port, running, self_signed, sim_config
from rollout_service.bench.run import BenchOptions, run_bench
from rollout_service.bench.targets import TargetError
from rollout_service.cli import main

BOUND_S = 60  # every run here takes a few seconds; this only keeps a broken one from hanging


async def bench(service, scheme: str, tmp_path: Path | None = None, **kw) -> dict:
    port = service.grpc_port if scheme == "grpc" else service.http_port
    opts = BenchOptions(target=f"{scheme}://127.0.0.1:{port}", report=str(tmp_path) if tmp_path else None,
                        run_timeout_s=BOUND_S, **kw)
    return await asyncio.wait_for(run_bench(opts, out=io.StringIO()), BOUND_S)


def assert_complete(doc: dict) -> None:
    s = doc["summary"]
    assert s["samples_submitted"] > 0
    assert s["samples_delivered"] == s["samples_submitted"]
    assert s["samples_failed"] == 0 and s["errors"] == {} and s["duplicates"] == 0
    assert s["groups_complete"] == s["groups_submitted"]
    for key in ("groups_per_s", "samples_per_s", "tokens_per_s"):
        assert s[key] > 0, key
    if s["trajectories"]:  # inter-token latency and the lower bound are of single-turn samples
        assert s["itl_s"] is None and all(step["lower_bound_s"] is None for step in s["per_step"])
        return
    for key in ("latency_s", "ttft_s", "itl_s"):
        assert s[key]["p50"] <= s[key]["p90"] <= s[key]["p99"], key
    # The trace's lower bound: no step beats its longest sample at the fastest per-token time.
    for step in s["per_step"]:
        assert 0 < step["lower_bound_s"] <= step["makespan_s"], step
    assert s["makespan_over_bound"]["max"] >= s["makespan_over_bound"]["mean"] >= 1.0


async def test_bench_over_grpc_delivers_every_sample_at_the_trace_lengths_and_writes_the_report(tmp_path):
    async with running(sim_config(num_engines=2)) as service:
        doc = await bench(service, "grpc", tmp_path, quick=True)
    assert_complete(doc)
    s = doc["summary"]
    assert s["steps"] == 2 and len(s["per_step"]) == 2
    assert s["lengths_matched"] == 1.0  # simulated engines take the trace's lengths exactly
    assert "simulated engines only" in doc["config"]["lengths"]  # what a real engine cannot do is stated
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["summary"]["samples_delivered"] == s["samples_delivered"]
    assert "| tokens/s |" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "bench.png").stat().st_size > 0


async def test_bench_over_http_streams_and_measures_ttft_and_inter_token_latency(tmp_path):
    async with running(sim_config(num_engines=2)) as service:
        doc = await bench(service, "http", tmp_path, quick=True)
    assert_complete(doc)
    s = doc["summary"]
    assert s["lengths_matched"] == 1.0  # max_tokens = min_tokens with ignore_eos
    assert "server-sent events" in s["timing_source"]
    assert doc["config"]["model"] == "tiny-reasoner"


async def test_open_loop_and_a_trainer_with_weight_pushes_deliver_every_sample():
    async with running(sim_config(num_engines=2)) as service:
        open_doc = await bench(service, "grpc", quick=True, mode="open", rate=50.0)
        closed = await bench(service, "grpc", quick=True, need_groups=4, train_s=0.05, push_bytes=4096)
    assert_complete(open_doc)
    assert open_doc["summary"]["steps"] == 1
    assert_complete(closed)  # the groups the steps did not wait for are collected at the end
    assert all(p["weight_push_s"] > 0 and p["train_s"] >= 0.05 for p in closed["summary"]["per_step"])


async def test_a_multi_turn_trace_replays_over_grpc_with_its_turns_observations_and_tool_latencies(tmp_path):
    from rollout_service.bench.run import resolve_workload

    kw = dict(workload="search-r1", quick=True, steps=1, groups_per_step=4)
    traced = [t for g in resolve_workload(BenchOptions(target="grpc://x:1", **kw)).steps[0] for t in g.trajectories]
    async with running(sim_config(num_engines=2)) as service:
        doc = await bench(service, "grpc", **kw)
        with pytest.raises(ValueError, match="multi-turn: it replays over grpc:// only"):
            await bench(service, "http", **kw)
    assert_complete(doc)
    t = doc["summary"]["trajectories"]
    assert t["count"] == len(traced) == doc["summary"]["samples_delivered"]
    assert t["turns_mean"] == pytest.approx(np.mean([len(x.turn_lens) for x in traced]))
    assert t["generated_tokens"] == sum(x.generated for x in traced)
    assert doc["summary"]["lengths_matched"] == 1.0  # every turn as long as traced (simulated engines)
    assert t["tool_s_mean"] >= np.mean([sum(x.tool_s) for x in traced])  # each tool waited as traced
    assert any(sum(x.tool_s) > 0 for x in traced)


async def test_a_held_out_trace_folder_replays_its_steps_and_lengths(tmp_path):
    trace = tmp_path / "held_out"
    trace.mkdir()
    steps = [[(12, [5, 9, 30]), (40, [7, 7, 2])], [(3, [11, 1, 4]), (25, [60, 6, 8]), (8, [3, 3, 3])]]
    for k, groups in enumerate(steps):
        lines = [json.dumps({"step": k, "input": p, "output": out, "n_sampling": len(out)}) for p, out in groups]
        (trace / f"packed_lengths_step_{k}.jsonl").write_text("\n".join(lines) + "\n")
    async with running(sim_config(num_engines=2)) as service:
        doc = await bench(service, "grpc", workload=str(trace))
    assert_complete(doc)
    s = doc["summary"]
    assert [p["samples_submitted"] for p in s["per_step"]] == [6, 9]
    assert s["tokens"] == sum(L for groups in steps for _, out in groups for L in out)
    assert s["lengths_matched"] == 1.0
    assert doc["workload"]["source"] == "PolyTrace held_out"


async def test_a_prompt_file_of_token_ids_and_text_replays_with_its_lengths(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": [5, 6, 7, 8], "output_len": [4, 9]},
        {"prompt": [9, 10], "output_len": 6, "n": 3},
        {"prompt": "12+30=", "output_len": 5, "n": 2},
    ]) + "\n")
    async with running(sim_config(num_engines=2)) as service:
        doc = await bench(service, "http", workload=str(prompts))
    assert_complete(doc)
    assert doc["summary"]["tokens"] == 4 + 9 + 3 * 6 + 2 * 5
    assert doc["config"]["prompt_ids"] == "the workload's"


async def test_the_report_shows_the_fleet_idle_in_a_tail_and_busy_on_a_wide_step(tmp_path):
    # One long sample keeps one engine of two busy; sixteen keep both.
    lone, wide = tmp_path / "lone.jsonl", tmp_path / "wide.jsonl"
    lone.write_text(json.dumps({"prompt": [5, 6, 7], "output_len": 600, "n": 1}) + "\n")
    wide.write_text(json.dumps({"prompt": [5, 6, 7], "output_len": 600, "n": 16}) + "\n")
    async with running(sim_config(num_engines=2)) as service:
        tail = await bench(service, "grpc", tmp_path / "tail", workload=str(lone), status_every_s=0.05)
        busy = await bench(service, "grpc", workload=str(wide), status_every_s=0.05)
    for doc in (tail, busy):
        assert_complete(doc)
        f = doc["summary"]["fleet"]
        assert f["engines"] == 2 and f["polls_while_generating"] >= 5, f
    assert 0.3 < tail["summary"]["fleet"]["busy_fraction"] <= 0.6, tail["summary"]["fleet"]
    assert busy["summary"]["fleet"]["busy_fraction"] >= 0.8, busy["summary"]["fleet"]
    # The bound is the 600-token sample at the run's fastest per-token time.
    s = tail["summary"]
    assert s["per_step"][0]["lower_bound_s"] == pytest.approx(599 * s["fastest_token_s"])
    assert "| fleet busy while generating | " in (tmp_path / "tail" / "report.md").read_text()
    polls = json.loads((tmp_path / "tail" / "report.json").read_text())["fleet_polls"]
    assert {p["busy"] for p in polls} >= {1} and max(p["busy"] for p in polls) <= 1


def test_an_unreachable_target_fails_in_seconds_naming_it(capsys):
    port = free_port()
    for target in (f"grpc://127.0.0.1:{port}", f"http://127.0.0.1:{port}"):
        assert main(["bench", "--target", target, "--quick", "--connect-timeout-s", "5"]) == 1
        err = capsys.readouterr().err
        assert f"--target {target}" in err and "cannot be reached" in err


async def test_a_target_of_the_wrong_kind_is_named(tmp_path):
    async with running(sim_config(num_engines=1)) as service:
        # The HTTP side server's port given as gRPC, and the gRPC port given as HTTP.
        for scheme, port in (("grpc", service.http_port), ("http", service.grpc_port)):
            opts = BenchOptions(target=f"{scheme}://127.0.0.1:{port}", quick=True, connect_timeout_s=5)
            with pytest.raises(TargetError) as info:
                await asyncio.wait_for(run_bench(opts, out=io.StringIO()), BOUND_S)
            assert f"--target {scheme}://127.0.0.1:{port}" in str(info.value)
            assert ("not gRPC" if scheme == "grpc" else "a gRPC port?") in str(info.value)


async def test_weight_pushes_over_http_go_through_vllms_weight_routes_to_every_engine():
    """`--push-bytes` against the side server: the bench, as a trainer on
    vLLM's weight-transfer routes, forms one group with both engines and
    pushes after each step; every engine serves each pushed version and each
    push's stall shows in its step."""
    async with running(sim_config(num_engines=2)) as service:
        before = service.core.policy_version
        doc = await bench(service, "http", quick=True, need_groups=4, train_s=0.05, push_bytes=1 << 20)
        after = service.core.policy_version
        assert {e.load().policy_version for e in service.core.engines.values()} == {after}
        assert service.core.collective.plan_in_force is None  # the bench left its group at the end
    assert_complete(doc)
    assert after == before + doc["summary"]["steps"]
    assert all(p["weight_push_s"] > 0 and p["train_s"] >= 0.05 for p in doc["summary"]["per_step"])


async def test_a_push_the_target_refuses_fails_before_the_run_naming_the_route_and_why():
    """A weight route that refuses the bench's token: the run stops in
    seconds, naming the route and the server's reason, and nothing was
    submitted."""
    cfg = sim_config(num_engines=1)
    cfg.auth.submit_tokens, cfg.auth.weights_tokens = ["subm1t"], ["w3ights"]
    async with running(cfg) as service:
        with pytest.raises(TargetError, match="group .* did not form .*POST /init_weight_transfer_engine: 40[13]: "):
            await bench(service, "http", quick=True, push_bytes=4096, token="subm1t", weights_token="wrong")
        assert service.core.counters["groups_submitted"] == 0


def test_bad_flags_are_refused_naming_them(capsys):
    assert main(["bench", "--target", "localhost:50051"]) == 2
    assert "--target must be grpc://HOST:PORT" in capsys.readouterr().err
    assert main(["bench", "--target", "http://127.0.0.1:1", "--workload", "search-r1", "--quick"]) == 2
    assert "--workload search-r1 is multi-turn: it replays over grpc:// only" in capsys.readouterr().err
    assert main(["bench", "--target", "http://127.0.0.1:1", "--mode", "open", "--rate", "5", "--push-bytes", "64"]) == 2
    assert "--push-bytes pushes after each step: it needs --mode closed" in capsys.readouterr().err


async def test_compare_prints_two_reports_side_by_side(tmp_path, capsys):
    async with running(sim_config(num_engines=2)) as service:
        await bench(service, "grpc", tmp_path / "a", quick=True)
        await bench(service, "http", tmp_path / "b", quick=True)
    assert main(["bench", "compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("A: grpc://") and "\nB: http://" in out
    rows = {line.split("  ")[0]: line.split() for line in out.splitlines()}
    delivered = rows["samples delivered"]
    assert delivered[-3] == delivered[-2] and delivered[-1] == "1.00"  # same workload, all delivered on both
    assert "tokens/s" in rows
    assert main(["bench", "compare", str(tmp_path / "a")]) == 2


def test_every_bundled_trace_is_package_data_and_the_named_workloads_load_from_it():
    import fnmatch
    import tomllib

    from rollout_service.bench.workloads import BUNDLED_TRACES, load_workload

    root = BUNDLED_TRACES.parent.parent  # the rollout_service package
    patterns = tomllib.loads((root.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "rollout_service"]
    files = [p.relative_to(root).as_posix() for p in BUNDLED_TRACES.rglob("*") if p.is_file()]
    assert len(files) >= 30 and "bench/traces/README.md" in files  # the README names the source and licence

    def packaged(path: str) -> bool:  # setuptools' globs: a '*' never crosses a '/'
        return any(len(pat.split("/")) == len(path.split("/")) and
                   all(fnmatch.fnmatchcase(a, b) for a, b in zip(path.split("/"), pat.split("/"))) for pat in patterns)

    assert [f for f in files if not packaged(f)] == []
    assert [len(load_workload(name).steps) for name in ("math", "code", "video")] == [6, 5, 10]


def test_the_wheel_carries_the_bench_and_its_traces_and_bench_help_runs_from_it(tmp_path):
    import os
    import subprocess
    import sys
    import zipfile

    repo = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(repo)], check=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("rollout_service-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "rollout_service/bench/run.py" in names and "rollout_service/bench/traces/README.md" in names
    assert sum(n.startswith("rollout_service/bench/traces/") for n in names) >= 30
    assert not any(n.startswith(("research/", "tests/")) for n in names)  # the studies stay out of the product

    site = tmp_path / "site"  # a non-editable install of the wheel alone (its dependencies are this environment's)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, timeout=300)
    env = dict(os.environ, PYTHONPATH=str(site))
    where = subprocess.run([sys.executable, "-c", "import rollout_service.bench.workloads as w; print(w.BUNDLED_TRACES)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=True)
    assert Path(where.stdout.strip()).is_relative_to(site)  # the installed copy, not this checkout
    help_ = subprocess.run([sys.executable, str(site / "bin" / "rollout-service"), "bench", "--help"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=60)
    assert help_.returncode == 0, help_.stderr
    assert "--target" in help_.stdout and "--workload" in help_.stdout


async def test_trace_lengths_past_the_model_context_are_cut_to_fit_and_counted():
    async with running(sim_config(num_engines=2)) as service:  # the bundled model's context: 1,024 tokens
        doc = await bench(service, "http", workload="math", steps=1, groups_per_step=4)
    assert_complete(doc)  # nothing refused for its length
    assert doc["config"]["max_model_len"] == 1024  # read from /v1/models
    assert doc["config"]["samples_cut_to_context"] > 0
    assert doc["summary"]["lengths_matched"] == 1.0


def test_a_malformed_prompt_file_is_refused_naming_the_line(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": [5, 6], "output_len": 4}\n{"prompt": 7}\n')
    assert main(["bench", "--target", "grpc://127.0.0.1:1", "--workload", str(prompts)]) == 2
    assert f"{prompts}:2: 'prompt' must be" in capsys.readouterr().err


async def test_a_service_with_tokens_and_tls_is_benched_with_token_and_ca_and_refuses_a_wrong_token(tmp_path):
    cert, key = self_signed(tmp_path)
    cfg = sim_config(num_engines=1)
    cfg.tls.cert_file, cfg.tls.key_file = cert, key
    cfg.auth.submit_tokens = ["s3cret"]
    async with running(cfg) as service:
        for scheme, port in (("grpc", service.grpc_port), ("https", service.http_port)):
            target = f"{scheme}://localhost:{port}"
            doc = await asyncio.wait_for(run_bench(BenchOptions(
                target=target, token="s3cret", tls_ca=cert, quick=True, steps=1), out=io.StringIO()), BOUND_S)
            assert_complete(doc)
            assert "s3cret" not in json.dumps(doc)  # the token is not written into the report
            with pytest.raises(TargetError, match=f"--target {target} refused the token"):
                await asyncio.wait_for(run_bench(BenchOptions(
                    target=target, token="wrong", tls_ca=cert, quick=True), out=io.StringIO()), BOUND_S)
