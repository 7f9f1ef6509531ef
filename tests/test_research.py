"""The load-test harness: invariants of its quick mode, real vs virtual time, workloads, CLI."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from research.__main__ import main
from research.runner import RunConfig, run_async, run_policy
from rollout_service.bench.workloads import GroupShape, Workload, load_workload
from research.policies import parse_policy

BASELINES = ["static", "least-assigned", "sticky-rr"]


def quick(name: str = "math", **kw) -> Workload:
    return load_workload(name, length_scale=kw.pop("scale", 0.1), steps=kw.pop("steps", 2),
                         groups_per_step=kw.pop("groups", 8), **kw)


def delivered_ids(result) -> list[str]:
    return [c.sample_id for r in result.records for c in r.samples]


@pytest.mark.parametrize("policy", BASELINES)
def test_quick_run_delivers_every_sample_exactly_once_within_the_bound(policy):
    w = quick()
    # A small KV cache forces the engines to preempt and re-prefill.
    cfg = RunConfig(w, engines=3, max_seqs=16, kv_tokens=4000, progress=False)
    result = run_policy(cfg, parse_policy(policy))
    s = result.summary
    expected = {f"{policy}-s{step}-g{g}/{i}" for step, groups in enumerate(w.steps)
                for g, shape in enumerate(groups) for i in range(shape.num_samples)}
    ids = delivered_ids(result)
    assert len(ids) == len(set(ids)) and set(ids) == expected
    assert s["samples_delivered"] == s["samples_submitted"] == len(expected)
    assert s["duplicate_samples"] == 0
    for step in result.steps:
        assert 0 < step["lower_bound_s"] <= step["makespan_s"]
        assert all(0.0 <= b <= 1.0 for b in step["busy_fraction"])
        assert 0.0 < step["slot_utilisation"] <= 1.0
        assert step["groups_complete"] == step["groups_needed"] == 8
    assert s["ratio_to_bound"] >= 1.0
    assert 0.0 <= s["bubble_ratio"] <= 1.0
    assert s["weight_sync_s"] == pytest.approx(0.05)  # the simulated engines' weight update time
    assert s["latency_p50_s"] <= s["latency_p99_s"] <= max(r["makespan_s"] for r in result.steps)


def test_lower_bound_is_exact_for_a_lone_request():
    w = Workload("one", [[GroupShape(50, [300])]], max_tokens=400, source="test")
    result = run_policy(RunConfig(w, engines=1, progress=False), parse_policy("least-assigned"))
    step = result.steps[0]
    assert step["lower_bound_s"] <= step["makespan_s"] <= step["lower_bound_s"] * 1.000001
    assert result.steps[0]["busy_fraction"] == [pytest.approx(1.0)]


def test_open_loop_delivers_every_group_at_a_request_rate():
    w = quick("video", steps=2, groups=6)
    result = run_policy(RunConfig(w, engines=2, mode="open", rate=20.0, progress=False), parse_policy("sticky-rr"))
    s = result.summary
    assert s["samples_delivered"] == s["samples_submitted"] == 12 * 8
    assert result.steps[0]["lower_bound_s"] <= result.steps[0]["makespan_s"]


async def test_real_and_virtual_clocks_agree():
    w = quick("math", steps=2, groups=6)
    policy = parse_policy("least-assigned")
    sim = {"decode_base_s": 0.004}  # the default cost model, stated: real-time steps of 4+ ms

    virtual = await asyncio.to_thread(run_policy, RunConfig(w, engines=2, sim=sim, progress=False), policy)
    real = await run_async(RunConfig(w, engines=2, sim=sim, clock="real", progress=False), policy)

    def lengths(result):
        return {c.sample_id: c.response_len for r in result.records for c in r.samples}

    assert lengths(real) == lengths(virtual)  # the same samples, the same lengths, over gRPC
    for v, r in zip(virtual.steps, real.steps):
        assert r["lower_bound_s"] == pytest.approx(v["lower_bound_s"])
        # Real time adds the network and the event loop's overheads, never less than the model. On a
        # busy 2-core host those overheads reached 0.85x the model; 3x catches a stalled loop or a
        # wait that runs to its timeout, not how busy the machine is.
        assert v["makespan_s"] * 0.99 <= r["makespan_s"] <= v["makespan_s"] * 3 + 0.5
    assert real.summary["samples_delivered"] == virtual.summary["samples_delivered"] == 96
    assert real.summary["weight_sync_s"] >= virtual.summary["weight_sync_s"] > 0


def test_trace_workloads_have_their_published_shapes():
    math = load_workload("math")
    assert (len(math.steps), math.groups_per_step, math.steps[0][0].num_samples) == (6, 96, 8)
    code = load_workload("code")
    assert code.max_tokens == 16000 and len(code.steps) == 5 and code.groups_per_step == 16
    video = load_workload("video", steps=3, groups_per_step=100)  # more groups than a trace step: the next step's follow
    assert len(video.steps) == 3 and video.groups_per_step == 100
    trace = load_workload("video")
    assert video.steps[0][:64] == trace.steps[0] and video.steps[0][64:] == trace.steps[1][:36]


def test_length_scale_keeps_the_shape_and_is_reported():
    full, small = load_workload("code"), load_workload("code", length_scale=0.05)
    assert small.length_scale == 0.05 and small.max_tokens == 800
    assert small.describe()["output_p50"] == pytest.approx(full.describe()["output_p50"] * 0.05, rel=0.01)
    assert small.describe()["slot_utilisation_mean_over_max"] == pytest.approx(
        full.describe()["slot_utilisation_mean_over_max"], rel=0.01)


def test_workloads_dir_follows_the_environment(tmp_path, monkeypatch):
    folder = tmp_path / "math_dapo_32b"
    folder.mkdir()
    (folder / "packed_lengths_step_0.jsonl").write_text(json.dumps({"input": 7, "output": [1, 2, 3]}) + "\n")
    monkeypatch.setenv("ROLLOUT_WORKLOADS_DIR", str(tmp_path))
    w = load_workload("math")
    assert len(w.steps) == 1 and w.steps[0][0].output_lens == [1, 2, 3]
    assert load_workload(str(folder / "packed_lengths_step_0.jsonl")).steps[0][0].prompt_len == 7


def test_generated_workloads_are_seeded():
    for name in ("intern-math", "intern-tool", "synthetic:median=200,sigma=1.0"):
        a, b, c = (load_workload(name, seed=s, steps=1, groups_per_step=8) for s in (1, 1, 2))
        assert (a.output_lengths() == b.output_lengths()).all()
        assert not (a.output_lengths() == c.output_lengths()).all()
        assert a.output_lengths().min() >= 1
    with pytest.raises(ValueError, match="bad parameter 'mediam=3'"):
        load_workload("synthetic:mediam=3")
    with pytest.raises(ValueError, match="unknown workload"):
        load_workload("no-such-workload")


def test_tiny_reasoner_workload_uses_the_task_prompts():
    from rollout_service.tasks import prompt_token_ids

    w = load_workload("tiny-reasoner", steps=1, groups_per_step=4)
    g = w.steps[0][0]
    assert g.prompt_token_ids == prompt_token_ids(g.problem)
    result = run_policy(RunConfig(w, engines=2, progress=False), parse_policy("static"))
    assert result.summary["samples_delivered"] == 32


def test_cli_quick_run_writes_the_report_and_plots(tmp_path, capsys):
    assert main(["run", "--workload", "video", "--engines", "4", "--quick", "--quiet", "--report", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["results"]) == set(BASELINES)
    for r in report["results"].values():
        for key in ("makespan_s", "lower_bound_s", "tokens_per_s", "groups_per_s", "slot_utilisation",
                    "samples_delivered", "samples_submitted", "steps"):
            assert key in r
        assert r["samples_delivered"] == r["samples_submitted"]
    assert report["config"]["length_scale"] == 0.1
    for png in ("makespan.png", "lengths_cdf.png", "timeline_static.png"):
        assert (tmp_path / png).stat().st_size > 1000
    assert "least-assigned" in capsys.readouterr().out  # the table
    assert main(["table", str(tmp_path), "--speedup-over", "static"]) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1]
    assert row.startswith("| video | 4 | 262144 |") and "1.00x /" in row


def test_cli_rejects_an_unknown_policy_before_running():
    with pytest.raises(SystemExit, match="unknown policy 'rebalanse'"):
        main(["run", "--workload", "math", "--policy", "static,rebalanse", "--quick"])


def test_workload_lists_keep_synthetic_parameters_together():
    from research.__main__ import split_workloads

    assert split_workloads("math, synthetic:median=300,sigma=1.2,code") == ["math", "synthetic:median=300,sigma=1.2", "code"]


def test_a_calibration_file_sets_the_simulated_cost_model(tmp_path):
    fit = {"sim_params": {"decode_base_s": 0.002, "decode_per_seq_s": 5e-05,
                          "decode_per_ctx_token_s": 1e-07, "prefill_per_token_s": 3e-05}}
    (tmp_path / "fit.json").write_text(json.dumps(fit))
    out = tmp_path / "report"
    assert main(["run", "--workload", "math", "--engines", "2", "--policy", "static", "--quick", "--quiet",
                 "--no-plots", "--cost-model", str(tmp_path / "fit.json"), "--report", str(out)]) == 0
    cost = json.loads((out / "report.json").read_text())["results"]["static"]["cost_model"]
    assert {k: cost[k] for k in fit["sim_params"]} == fit["sim_params"]


def test_the_calibration_fits_a_memory_bound_floor_and_the_simulated_tail_pays_it(tmp_path):
    """A step flat from batch 1 to 4 (memory-bound) and growing past it:
    `calibrate`'s fit recovers the floor and the linear terms above it, and
    a simulated fleet given the fit runs its tail at the floor: the same
    static run takes longer than with the linear terms alone."""
    from research.calibrate import fit

    floor, base, per_seq, ctx = 0.045, 0.030, 0.0026, 1e-6

    def step(b, p, per_ctx=ctx):
        c = b * (p + 72)
        return {"batch": b, "prompt": p, "context_tokens": c, "step_s": max(floor, base + per_seq * b) + per_ctx * c}

    m = {"decode": [step(b, 16) for b in (1, 2, 4, 16, 64)] + [step(16, 448), step(64, 448)],
         "prefill": [{"prompt": 32, "time_s": 0.1}, {"prompt": 128, "time_s": 0.4}]}
    got = fit(m)
    sim = got["sim_params"]
    assert sim["decode_floor_s"] == pytest.approx(floor + ctx * 88, rel=0.05)
    assert sim["decode_base_s"] == pytest.approx(base, rel=1e-6) and sim["decode_per_seq_s"] == pytest.approx(per_seq, rel=1e-6)
    assert got["max_relative_error"] < 0.05
    # A tail's shape (1 and 4 sequences at long contexts, the floor plus their
    # context) is fitted as the floor plus the context's cost, not as a batch
    # above the floor: the linear terms stay, and the context's cost is found.
    # (At 4 us a context token, as measured on the padded target, 4 sequences
    # of 840 tokens step 30% above the floor.)
    shapes = [(b, 16) for b in (1, 2, 4, 16, 64)] + [(16, 448), (64, 448), (1, 768), (4, 768)]
    tail = fit({**m, "decode": [step(b, p, per_ctx=4e-6) for b, p in shapes]})
    assert tail["sim_params"]["decode_per_ctx_token_s"] == pytest.approx(4e-6, rel=0.05)
    assert tail["sim_params"]["decode_base_s"] == pytest.approx(base, rel=0.05)
    assert tail["max_relative_error"] < 0.05
    makespans = {}
    for name, params in (("floor", sim), ("linear", {**sim, "decode_floor_s": 0.0})):
        (tmp_path / f"{name}.json").write_text(json.dumps({"sim_params": params}))
        out = tmp_path / name
        assert main(["run", "--workload", "math", "--engines", "2", "--policy", "static", "--quick", "--quiet",
                     "--no-plots", "--cost-model", str(tmp_path / f"{name}.json"), "--report", str(out)]) == 0
        makespans[name] = json.loads((out / "report.json").read_text())["results"]["static"]["makespan_s"]
    assert makespans["floor"] > 1.05 * makespans["linear"]


def test_a_calibration_through_the_service_takes_its_speculation_terms_from_a_draft_calibration(tmp_path):
    from research.calibrate import main as calibrate

    with pytest.raises(SystemExit):
        calibrate(["--service", "--draft", "bundled"])  # the service's engines are plain
    with pytest.raises(SystemExit):
        calibrate(["--draft-from", str(tmp_path / "x.json")])  # only with --service
    with pytest.raises(SystemExit):
        calibrate(["--service", "--draft-from", str(tmp_path / "missing.json")])


def test_the_draft_calibration_recovers_the_speculation_costs_it_was_measured_with():
    """`calibrate --draft` fits the simulated engine's draft and verify costs
    to verify steps measured against K = 0 steps of the same engine: steps
    built from known costs give those costs back, and the acceptance per
    position is the measured one."""
    from research.calibrate import fit_draft

    plain = {"decode_base_s": 0.076, "decode_per_seq_s": 0.0034}
    draft_cost, verify_cost, k = 0.03, 0.6, 4

    def k0(n):
        return plain["decode_base_s"] + plain["decode_per_seq_s"] * n + 0.002  # a draft-model engine's K = 0 step

    def verify(n):
        return k0(n) + k * draft_cost * (plain["decode_base_s"] + plain["decode_per_seq_s"] * n) \
            + k * verify_cost * plain["decode_per_seq_s"] * n

    measured = {"k": k, "decode_k0": [{"batch": n, "step_s": k0(n)} for n in (1, 2, 4, 16, 64)],
                "decode_k": [{"batch": n, "step_s": verify(n)} for n in (1, 2, 4)],
                "acceptance": {"rates": [0.7, 0.8, 0.75, 0.7], "mean_acceptance_length": 2.9}}
    out = fit_draft(plain, measured)
    assert out["sim_params"]["spec_draft_cost"] == pytest.approx(draft_cost, rel=1e-6)
    assert out["sim_params"]["spec_verify_cost"] == pytest.approx(verify_cost, rel=1e-6)
    assert out["sim_params"]["spec_acceptance"] == [0.7, 0.8, 0.75, 0.7]
    assert out["k0_over_plain"][64] > 1.0
    # Verify steps no dearer than K = 0 ones: speculation is free, not negative.
    measured["decode_k"] = [{"batch": n, "step_s": k0(n)} for n in (1, 2, 4)]
    free = fit_draft(plain, measured)["sim_params"]
    assert free["spec_draft_cost"] == free["spec_verify_cost"] == 0.0


def test_the_model_free_draft_calibration_prices_the_tokens_the_steps_drafted():
    """`calibrate --draft ngram` fits what a model-free draft costs (the
    verify step's own machinery and the proposer, `spec_ngram_draft_cost`;
    the verified tokens, `spec_verify_cost`) per token the steps actually
    drafted, and leaves the acceptance to the run: steps built from known
    costs with 3.5 of K=4 tokens drafted give those costs back."""
    from research.calibrate import fit_draft

    plain = {"decode_base_s": 0.070, "decode_per_seq_s": 0.0026}
    machinery, verify_cost, k, drafted = 0.2, 0.8, 4, 3.5

    def k0(n):
        return plain["decode_base_s"] + plain["decode_per_seq_s"] * n

    def verify(n):
        return k0(n) + drafted * (machinery * k0(n) + verify_cost * plain["decode_per_seq_s"] * n)

    measured = {"k": k, "model_free": True, "acceptance": None,
                "decode_k0": [{"batch": n, "step_s": k0(n)} for n in (1, 2, 4)],
                "decode_k": [{"batch": n, "step_s": verify(n), "draft_tokens_per_seq_step": drafted} for n in (1, 2, 4)]}
    out = fit_draft(plain, measured)
    sim = out["sim_params"]
    assert sim["spec_ngram_draft_cost"] == pytest.approx(machinery, rel=1e-6)
    assert sim["spec_verify_cost"] == pytest.approx(verify_cost, rel=1e-6)
    assert "spec_draft_cost" not in sim and "spec_acceptance" not in sim
    assert out["verify_over_k0"][1] == pytest.approx(verify(1) / k0(1))


def test_a_calibration_file_s_speculation_costs_reach_the_simulated_engines(tmp_path):
    """A calibration with a draft model's costs and acceptance per position
    (`calibrate --draft`) prices a run with speculation: dearer verification
    or lower acceptance make it slower; a run without it is unchanged."""
    base = {"decode_base_s": 0.004, "decode_per_seq_s": 0.0005}
    cases = {"cheap": {"spec_verify_cost": 0.1, "spec_acceptance": [0.9, 0.9, 0.9, 0.9]},
             "dear": {"spec_verify_cost": 2.0, "spec_acceptance": [0.5, 0.4, 0.3, 0.3]}}
    makespan = {}
    for name, spec in cases.items():
        fit = tmp_path / f"{name}.json"
        fit.write_text(json.dumps({"sim_params": {**base, "spec_draft_cost": 0.05, **spec}}))
        out = tmp_path / name
        assert main(["run", "--workload", "math", "--engines", "2", "--policy", "static,least-assigned+spec",
                     "--quick", "--quiet", "--no-plots", "--cost-model", str(fit), "--report", str(out)]) == 0
        results = json.loads((out / "report.json").read_text())["results"]
        makespan[name] = {p: r["makespan_s"] for p, r in results.items()}
    assert makespan["dear"]["least-assigned+spec"] > 1.2 * makespan["cheap"]["least-assigned+spec"]
    assert makespan["dear"]["static"] == pytest.approx(makespan["cheap"]["static"], rel=1e-6)


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_the_bound_holds_with_speculative_decoding_in_the_simulated_engines(method):
    w = quick("math", steps=2, groups=8)
    result = run_policy(RunConfig(w, engines=2, sim={"spec_method": method}, progress=False), parse_policy("least-assigned"))
    assert result.summary["cost_model"]["spec_speedup"] > 1.5
    for step in result.steps:
        assert step["lower_bound_s"] <= step["makespan_s"]


def test_a_speculating_run_reports_its_acceptance_and_a_plain_one_does_not():
    """The run's result says what speculation did (tokens per verify step,
    per engine and pooled), so a slow speculating run can be told apart from
    one whose drafts were rejected."""
    w = quick("math", steps=2, groups=8)
    cfg = RunConfig(w, engines=2, sim={"spec_acceptance": 0.7}, progress=False)
    spec = run_policy(cfg, parse_policy("least-assigned+spec-ngram")).summary["speculation"]
    assert spec["method"] == "ngram" and set(spec["engines"]) == {"sim-0", "sim-1"}
    assert all(e["verify_steps"] > 0 for e in spec["engines"].values())
    lengths = sorted(e["mean_acceptance_length"] for e in spec["engines"].values())
    assert 1.5 < lengths[0] <= spec["mean_acceptance_length"] <= lengths[-1] <= 1 + spec["max_k"]
    assert all(e["schedule"] and e["schedule"][0][0] == 1 for e in spec["engines"].values())
    assert "drafter_rounds" not in spec  # no model is trained
    assert "speculation" not in run_policy(cfg, parse_policy("least-assigned")).summary


def test_spec_fixed_keeps_the_configured_depth_schedule_without_the_tuner():
    """`+spec-fixed` speculates on the fixed schedule (the tail's depth,
    none in the bulk); a run can then tell the tuner's choices apart from
    the drafter's cost."""
    from rollout_service.engines.spec_config import DEFAULT_SCHEDULE, normalize_schedule

    w = quick("math", steps=2, groups=8)
    cfg = RunConfig(w, engines=2, max_seqs=16, progress=False)
    spec = run_policy(cfg, parse_policy("least-assigned+spec-fixed")).summary["speculation"]
    fixed = [list(e) for e in normalize_schedule(DEFAULT_SCHEDULE, 16, spec["max_k"])]
    assert spec["method"] == "draft_model"
    assert all(e["schedule"] == fixed and e["verify_steps"] > 0 for e in spec["engines"].values())


def test_spec_overrides_set_the_depth_schedule_of_speculating_policies_only():
    """`run --spec schedule=... --spec tune=false`: a speculating policy runs
    on the given schedule (speculation in the tail only, no tuner); a policy
    that does not speculate stays without speculation; a bad field is named."""
    w = quick("math", steps=2, groups=8)
    tail_only = [[1, 2, 3], [3, 16, 0]]
    cfg = RunConfig(w, engines=2, max_seqs=16, progress=False, spec={"schedule": tail_only, "tune": False})
    spec = run_policy(cfg, parse_policy("least-assigned+spec-ngram")).summary["speculation"]
    assert spec["method"] == "ngram"
    assert all(e["schedule"] == tail_only for e in spec["engines"].values())
    plain = run_policy(cfg, parse_policy("least-assigned")).summary
    assert "speculation" not in plain
    with pytest.raises(SystemExit, match=r"schedul=.*'schedule'"):
        main(["run", "--spec", "schedul=[[1,4,3]]", "--quick", "--no-plots"])


def test_kv_load_sums_each_tokens_capped_context():
    import numpy as np

    from research.metrics import kv_load

    for P, L, cap in [(10, 50, 1000), (10, 50, 30), (100, 5, 50), (0, 7, 3)]:
        brute = sum(min(P + k, cap) for k in range(1, L + 1))
        assert kv_load(np.array([P]), np.array([L]), cap)[0] == pytest.approx(brute)


def test_shared_steps_bound_is_exact_for_two_requests_on_one_engine():
    # Both run together from the start: one prefill step for both prompts, then 300 steps of two
    # sequences. The longest-request and total-work bounds miss the second sequence's cost.
    w = Workload("two", [[GroupShape(50, [300, 300])]], max_tokens=400, source="test")
    step = run_policy(RunConfig(w, engines=1, progress=False), parse_policy("least-assigned")).steps[0]
    assert step["bound_longest_s"] < step["bound_shared_s"]
    assert step["lower_bound_s"] <= step["makespan_s"] <= step["lower_bound_s"] * 1.000001


def test_batch_size_bound_counts_that_many_long_responses_need_small_batches():
    # The code replay's first step (lengths x0.1): dozens of long responses must each
    # run in small batches to end in time, and small batches cost the fleet engine time.
    w = load_workload("code", steps=1, length_scale=0.1)
    step = run_policy(RunConfig(w, engines=8, progress=False), parse_policy("least-assigned")).steps[0]
    assert step["bound_batch_s"] > 1.03 * max(step["bound_shared_s"], step["bound_longest_s"], step["bound_work_s"])
    assert step["lower_bound_s"] == pytest.approx(step["bound_batch_s"], rel=1e-6)
    assert step["lower_bound_s"] <= step["makespan_s"]
    # Equal responses sharing one engine from the start: within 1% (each response's own
    # time counts its own prompt's prefill, not the others' in the same first step).
    w = Workload("four", [[GroupShape(50, [300] * 4)]], max_tokens=400, source="test")
    step = run_policy(RunConfig(w, engines=1, progress=False), parse_policy("least-assigned")).steps[0]
    assert 0.99 * step["makespan_s"] <= step["bound_batch_s"] <= step["makespan_s"]


@pytest.mark.parametrize("policy", ["rebalance", "rebalance+isolate", "rebalance+repack", "length-packed+rebalance",
                                    "length-oracle+rebalance", "length-oracle-packed+rebalance",
                                    "length-noisy-0.5-packed+rebalance"])
def test_length_aware_runs_deliver_every_sample_once_within_the_bound(policy):
    w = quick()
    # A small KV cache: the engines preempt, the bound's KV term is on.
    cfg = RunConfig(w, engines=3, max_seqs=16, kv_tokens=4000, progress=False)
    result = run_policy(cfg, parse_policy(policy))
    ids = delivered_ids(result)
    assert len(ids) == len(set(ids)) == result.summary["samples_submitted"]
    for step in result.steps:
        assert 0 < step["lower_bound_s"] <= step["makespan_s"]
        assert step["bound_work_s"] <= step["lower_bound_s"] / (1 - 1e-9)


def test_the_bound_counts_a_small_kv_cache():
    w = Workload("long", [[GroupShape(100, [2000] * 8)]], max_tokens=2100, source="test")
    big = run_policy(RunConfig(w, engines=1, progress=False), parse_policy("least-assigned")).steps[0]
    small = run_policy(RunConfig(w, engines=1, kv_tokens=6000, progress=False), parse_policy("least-assigned")).steps[0]
    assert small["bound_work_s"] > 1.5 * big["bound_work_s"]  # eight 2,100-token contexts need 17K tokens of cache
    assert small["lower_bound_s"] <= small["makespan_s"]


def test_predictor_accuracy_reports_rank_correlations():
    from research.predictor_accuracy import measure

    r = measure("code", 2, steps=2, groups_per_step=4, length_scale=0.05)
    assert r["placement"]["n"] == r["samples"] == 64
    assert r["after_first_sibling"]["n"] > 0
    assert -1.0 <= r["after_first_sibling"]["rho_total"] <= 1.0


def test_noisy_length_references_rank_lengths_as_their_noise_says():
    from scipy import stats

    from research.oracle import NoisyLengthPredictor, true_length
    from rollout_service.engines.types import SamplingParams
    from rollout_service.lifecycle.types import Group, GroupSpec, Request

    w = load_workload("code", steps=1)
    groups = [GroupSpec(f"g{i}", [1] * g.prompt_len, g.num_samples, SamplingParams(max_tokens=w.max_tokens),
                        metadata={"sim.target_lengths": ",".join(map(str, g.output_lens))})
              for i, g in enumerate(w.steps[0])]
    reqs = [Request(f"{s.group_id}/{j}", Group(s), j) for s in groups for j in range(s.num_samples)]
    truth = [true_length(r) for r in reqs]
    rho = {sigma: stats.spearmanr(truth, [NoisyLengthPredictor(sigma).predict(r).median for r in reqs])[0]
           for sigma in (0.25, 1.0)}
    assert rho[0.25] > 0.8 and 0.3 < rho[1.0] < rho[0.25]
    assert NoisyLengthPredictor(0.25).predict(reqs[0]) == NoisyLengthPredictor(0.25).predict(reqs[0])  # fixed per request


def test_information_plot_draws_both_panels_from_quick_runs(tmp_path):
    from research.information_plot import _ratios, plot

    horizon, noisy = tmp_path / "horizon", tmp_path / "noisy"
    assert main(["run", "--workload", "video", "--engines", "4", "--quick", "--quiet", "--no-plots",
                 "--policy", "rebalance,length-oracle-after-16+rebalance,length-oracle+rebalance",
                 "--report", str(horizon)]) == 0
    assert main(["run", "--workload", "code", "--engines", "4", "--quick", "--quiet", "--no-plots",
                 "--policy", "rebalance,length-noisy-0.5+rebalance,length-oracle-packed+rebalance",
                 "--report", str(noisy)]) == 0
    assert set(_ratios(noisy)["code"]) == {"length-aware+rebalance", "length-noisy-0.5+rebalance",
                                          "length-oracle-packed+rebalance"}
    # Video: the service's predictor, lengths after 16 tokens, at placement; code: spread, then packed.
    assert plot(horizon, noisy, tmp_path / "fig.png") == {"left": 1, "right": 1}
    assert (tmp_path / "fig.png").stat().st_size > 10_000


def test_a_trainer_stand_in_is_part_of_each_step_and_partial_rollout_fills_it():
    """`train_s`: the trainer computes that long per step before the push.
    A synchronous loop idles meanwhile, so its step is the makespan plus
    the training; partial rollout keeps its in-flight groups generating,
    delivers more complete groups per second of the loop, and trains no
    token older than the lag bound (older ones are counted as masked)."""
    w = quick(steps=3, groups=8)
    cfg = RunConfig(w, engines=2, max_seqs=16, progress=False, train_s=1.0, max_version_lag=1, over_provision=2.0)
    static = run_policy(cfg, parse_policy("static")).summary
    partial = run_policy(cfg, parse_policy("partial")).summary
    assert static["step_time_s"] >= static["makespan_s"] + 1.0
    assert static["max_trained_lag"] == 0 and static["tokens_masked_stale"] == 0
    assert static["tokens_trained"] == static["tokens"]
    assert partial["groups_per_s_with_trainer"] > 1.2 * static["groups_per_s_with_trainer"]
    assert partial["max_trained_lag"] <= 1
    assert partial["samples_delivered_with_drain"] == partial["samples_submitted"]
    with pytest.raises(ValueError, match="train_s"):
        RunConfig(w, engines=2, train_s=-1).check()
    with pytest.raises(ValueError, match="warm-up"):
        RunConfig(w, engines=2, mode="open", rate=1.0, warmup_steps=1).check()


def _measured_run(tmp_path, *args: str) -> Path:
    """A short real-time run of the math trace on 2 simulated engines behind
    the real service (`args`: policies and the like), its report directory."""
    out = tmp_path / "measured-run"
    assert main(["run", "--workload", "math", "--engines", "2", "--clock", "real", "--length-scale", "0.05",
                 "--steps", "2", "--groups-per-step", "4", *args, "--report", str(out), "--no-plots", "--quiet"]) == 0
    return out


def _predicted(out: Path, fit: Path, tmp_path, name: str, *args: str) -> list[dict]:
    """`predict` of a run with the cost model `fit` (and `args`): its rows."""
    rows = tmp_path / f"{name}.json"
    assert main(["predict", str(out), "--cost-model", str(fit), "--out", str(rows), *args]) == 0
    return json.loads(rows.read_text())


def test_a_real_time_run_writes_what_was_generated_and_predict_replays_it(tmp_path, capsys):
    """A run in real time writes each policy's generated lengths as a trace
    (every group of every step, partial rollout's drained groups too, none
    of the unmeasured warm-up step's); `predict` replays each policy's own
    trace in virtual time and prints measured and predicted figures side by
    side."""
    out = tmp_path / "measured-run"
    assert main(["run", "--workload", "math", "--engines", "2", "--clock", "real", "--length-scale", "0.05",
                 "--steps", "2", "--groups-per-step", "4", "--policy", "static,partial", "--train-s", "0.2",
                 "--warmup-steps", "1", "--report", str(out), "--no-plots", "--quiet"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["warmup_steps"] == 1
    for summary in report["results"].values():
        assert summary["warmup_s"] > 0  # it ran, before the measured steps
        assert summary["samples_submitted"] == 2 * 4 * 8  # and none of its samples is counted
    w = load_workload("math", length_scale=0.05, steps=2, groups_per_step=4)
    from rollout_service.bench.workloads import polytrace

    for policy in ("static", "least-assigned_partial"):
        replay = polytrace.load_trace(out / "measured" / policy, name=policy)
        # Simulated engines generate exactly the hinted lengths: the trace is the workload.
        assert [[g.output_lens for g in s] for s in replay.steps] == [[g.output_lens for g in s] for s in w.steps]
        assert [[g.prompt_len for g in s] for s in replay.steps] == [[g.prompt_len for g in s] for s in w.steps]
    fit = tmp_path / "fit.json"
    fit.write_text(json.dumps({"sim_params": {"decode_base_s": 0.004, "decode_per_seq_s": 0.00015}}))
    capsys.readouterr()
    assert main(["predict", str(out), "--cost-model", str(fit), "--out", str(tmp_path / "rows.json"),
                 "--plot", str(tmp_path / "steps.png")]) == 0
    printed = capsys.readouterr().out
    assert "| static |" in printed and "| least-assigned+partial |" in printed
    rows = json.loads((tmp_path / "rows.json").read_text())
    for row in rows:
        for key in ("makespan_s", "step_time_s", "groups_per_s_with_trainer"):
            assert row[key]["measured"] > 0 and row[key]["predicted"] > 0
        # Step by step, measured beside predicted: where a prediction goes wrong.
        steps = row["step_makespans_s"]
        assert len(steps["measured"]) == len(steps["predicted"]) == 2
        for side in ("measured", "predicted"):
            assert sum(steps[side]) / 2 == pytest.approx(row["makespan_s"][side])
    assert (tmp_path / "steps.png").stat().st_size > 10_000
    with pytest.raises(SystemExit, match="virtual time"):
        virtual = tmp_path / "virtual"
        main(["run", "--workload", "math", "--quick", "--report", str(virtual), "--no-plots", "--quiet"])
        main(["predict", str(virtual), "--cost-model", str(fit)])


def test_two_passes_run_the_policies_there_and_back_on_the_two_halves_of_the_steps(tmp_path, capsys):
    """`--passes 2` runs every policy on the first half of the steps in the
    order given, then on the second half in reverse order (A B B A), each
    time on a fresh fleet; the report pools each policy's passes, says where
    the host's CPU time went during each, and `predict` replays every pass
    and pools its predictions the same way."""
    out = tmp_path / "two-passes"
    w = load_workload("math", length_scale=0.05, steps=4, groups_per_step=4)
    assert [len(h.steps) for h in w.split(2)] == [2, 2]
    assert [len(h.steps) for h in Workload("odd", w.steps[:3], w.max_tokens, "x").split(2)] == [2, 1]
    assert main(["run", "--workload", "math", "--engines", "2", "--clock", "real", "--length-scale", "0.05",
                 "--steps", "4", "--groups-per-step", "4", "--policy", "static,partial", "--train-s", "0.2",
                 "--passes", "2", "--report", str(out), "--no-plots", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "policy (both passes)" in printed
    # Each pass's rows are against the first policy's run in the same pass.
    assert [line.split()[-3] for line in printed.splitlines() if line.startswith("static#")] == ["1.00x", "1.00x"]
    report = json.loads((out / "report.json").read_text())
    runs = ["static#1", "least-assigned+partial#1", "least-assigned+partial#2", "static#2"]
    assert list(report["results"]) == report["config"]["policies"] == runs  # in the order they ran
    from rollout_service.bench.workloads import polytrace

    for name in runs:
        summary = report["results"][name]
        assert summary["steps"] == 2 and summary["samples_submitted"] == 2 * 4 * 8
        half = w.steps[:2] if name.endswith("#1") else w.steps[2:]
        replay = polytrace.load_trace(out / "measured" / name.replace("+", "_"), name=name)
        assert [[g.output_lens for g in s] for s in replay.steps] == [[g.output_lens for g in s] for s in half]
        host = summary["host_cpu"]  # Linux: /proc/stat
        assert host["busy"] > 0 and sum(host.values()) == pytest.approx(1.0)
    for name in ("static", "least-assigned+partial"):
        pooled = report["pooled"][name]
        first, second = (report["results"][f"{name}#{k}"] for k in (1, 2))
        assert pooled["steps"] == 4 and pooled["samples_delivered"] == pooled["samples_submitted"] == 4 * 4 * 8
        assert pooled["makespan_s"] == pytest.approx((first["makespan_s"] + second["makespan_s"]) / 2)
        assert pooled["step_time_s"] == pytest.approx((first["step_time_s"] + second["step_time_s"]) / 2)
        # Groups per second over all the loop's time: between the passes' own.
        rates = sorted(r["groups_per_s_with_trainer"] for r in (first, second))
        assert rates[0] <= pooled["groups_per_s_with_trainer"] <= rates[1]
    fit = tmp_path / "fit.json"
    fit.write_text(json.dumps({"sim_params": {"decode_base_s": 0.004, "decode_per_seq_s": 0.00015}}))
    assert main(["predict", str(out), "--cost-model", str(fit), "--out", str(tmp_path / "rows.json"),
                 "--plot", str(tmp_path / "steps.png")]) == 0
    rows = {r["policy"]: r for r in json.loads((tmp_path / "rows.json").read_text())}
    assert list(rows) == runs + ["static", "least-assigned+partial"]
    assert rows["static"]["pooled"] and "| static (passes pooled) |" in capsys.readouterr().out
    for name in ("static", "least-assigned+partial"):
        passes = [rows[f"{name}#{k}"]["makespan_s"]["predicted"] for k in (1, 2)]
        assert rows[name]["makespan_s"]["predicted"] == pytest.approx(sum(passes) / 2)
    with pytest.raises(SystemExit, match="--passes: two passes are for the closed loop"):
        main(["run", "--workload", "math", "--quick", "--mode", "open", "--rate", "2", "--passes", "2", "--quiet"])


def test_predict_runs_each_policy_at_the_host_speed_its_run_measured(tmp_path, capsys):
    """Where a run and the calibration both timed the host's speed
    reference, `predict` scales the calibrated engine costs by how much
    slower the host ran each policy: a policy whose run read the reference
    twice as slow as the calibration did is predicted to take twice as
    long; `--no-speed-scale` predicts at the calibration's speed, and a
    calibration without a reference says so."""
    out = _measured_run(tmp_path, "--policy", "static,least-assigned")
    report = json.loads((out / "report.json").read_text())
    # Simulated engines time no reference (their speed is the cost model's): give the run two readings.
    for name, ms in (("static", 120.0), ("least-assigned", 60.0)):
        assert "speed_reference" not in report["results"][name]
        report["results"][name]["speed_reference"] = {"ms": ms, "copies": 2}
    (out / "report.json").write_text(json.dumps(report))
    fit = tmp_path / "fit.json"
    fit.write_text(json.dumps({"sim_params": {"decode_base_s": 0.004, "decode_per_seq_s": 0.002},
                               "speed_reference": {"ms": 60.0, "copies": 2}}))
    rows = {}
    for name, extra in (("scaled", []), ("still", ["--no-speed-scale"])):
        capsys.readouterr()
        rows[name] = {r["policy"]: r for r in _predicted(out, fit, tmp_path, name, *extra)}
        printed = capsys.readouterr().out
        assert ("host speed x" in printed) == (name == "scaled")
    assert rows["scaled"]["static"]["speed_scale"] == pytest.approx(2.0)
    assert rows["scaled"]["least-assigned"]["speed_scale"] == pytest.approx(1.0)
    assert rows["still"]["static"]["speed_scale"] is None
    predicted = {side: {p: r["makespan_s"]["predicted"] for p, r in rs.items()} for side, rs in rows.items()}
    assert predicted["scaled"]["static"] == pytest.approx(2 * predicted["still"]["static"], rel=0.01)
    assert predicted["scaled"]["least-assigned"] == pytest.approx(predicted["still"]["least-assigned"], rel=0.01)
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"sim_params": {"decode_base_s": 0.004, "decode_per_seq_s": 0.002}}))
    assert main(["predict", str(out), "--cost-model", str(bare)]) == 0
    assert "has no speed reference" in capsys.readouterr().out


def test_predict_replays_each_policy_at_costs_spread_around_the_calibration_and_gives_the_range(tmp_path, capsys):
    """A replay can swing on a small change of costs (a group done just
    before or after a step's end), so `predict` replays each policy at
    engine costs spread over +-jitter and predicts their mean, with the
    range; `--ensemble 1` is one replay at the calibrated costs."""
    out = _measured_run(tmp_path, "--policy", "static")
    fit = tmp_path / "fit.json"
    fit.write_text(json.dumps({"sim_params": {"decode_base_s": 0.004, "decode_per_seq_s": 0.002}}))
    rows = {}
    for name, extra in (("one", ["--ensemble", "1"]), ("three", ["--ensemble", "3", "--jitter", "0.2"])):
        capsys.readouterr()
        rows[name] = _predicted(out, fit, tmp_path, name, *extra)[0]["makespan_s"]
        assert ("replays' range" in capsys.readouterr().out) == (name == "three")
    assert "spread" not in rows["one"]
    low, high = rows["three"]["spread"]
    # The static split's makespan is its engines' work: proportional to their costs, 0.8x to 1.2x.
    assert low == pytest.approx(0.8 * rows["one"]["predicted"], rel=0.02)
    assert high == pytest.approx(1.2 * rows["one"]["predicted"], rel=0.02)
    assert rows["three"]["predicted"] == pytest.approx(rows["one"]["predicted"], rel=0.02)
    with pytest.raises(SystemExit, match="ensemble must be >= 1"):
        main(["predict", str(out), "--cost-model", str(fit), "--ensemble", "0"])


def test_predict_what_if_replays_every_measured_trace_under_other_policies(tmp_path, capsys):
    """`predict --what-if P1,P2` replays each measured trace under each
    named policy: a trace replayed under the policy that ran it is that
    policy's own prediction, partial rollout makes more of the same lengths
    than the static split, `--spec` switches speculation off for the
    what-if, and a bad policy or a stray `--spec` is refused by name."""
    out = _measured_run(tmp_path, "--policy", "static,partial", "--train-s", "0.2")
    fit = tmp_path / "fit.json"
    fit.write_text(json.dumps({"sim_params": {"decode_base_s": 0.004, "decode_per_seq_s": 0.002}}))
    own = {r["policy"]: r for r in _predicted(out, fit, tmp_path, "own", "--ensemble", "1")}
    capsys.readouterr()
    result = tmp_path / "what-if.json"
    assert main(["predict", str(out), "--cost-model", str(fit), "--ensemble", "1", "--out", str(result),
                 "--plot", str(tmp_path / "what-if.png"),
                 "--what-if", "static,partial,least-assigned+spec-ngram,least-assigned",
                 "--spec", "schedule=[[1,65536,0]]", "--spec", "tune=false"]) == 0
    printed = capsys.readouterr().out
    assert "| static |" in printed and "x static" in printed
    assert (tmp_path / "what-if.png").stat().st_size > 0
    doc = json.loads(result.read_text())
    assert doc["traces"] == ["static", "least-assigned+partial"]
    rows = {r["policy"]: r for r in doc["rows"]}
    for trace, policy in zip(doc["traces"], ("static", "partial")):
        assert rows[policy]["traces"][trace]["makespan_s"] == pytest.approx(own[trace]["makespan_s"]["predicted"])
        assert doc["measured"][trace]["makespan_s"] == pytest.approx(own[trace]["makespan_s"]["measured"])
        groups = {p: r["traces"][trace]["groups_per_s_with_trainer"] for p, r in rows.items()}
        assert groups["partial"] > groups["static"]
        # Speculation off at every batch size: the same as no speculation.
        assert groups["least-assigned+spec-ngram"] == pytest.approx(groups["least-assigned"], rel=0.02)
    mean = rows["partial"]["mean"]["groups_per_s_with_trainer"]
    assert mean == pytest.approx(np.mean([rows["partial"]["traces"][t]["groups_per_s_with_trainer"]
                                          for t in doc["traces"]]))
    with pytest.raises(SystemExit, match="--what-if: unknown policy 'fastest'"):
        main(["predict", str(out), "--cost-model", str(fit), "--what-if", "static,fastest"])
    with pytest.raises(SystemExit, match="--spec goes with --what-if"):
        main(["predict", str(out), "--cost-model", str(fit), "--spec", "tune=false"])


def test_a_run_on_vllm_engines_times_the_host_speed_reference_around_each_policy(tmp_path, capsys, own_vllm_engines):
    """A real-time run on vLLM CPU engines (the bundled model) times the
    host's speed reference before its fleet starts and after it stops, and
    `predict` with a calibration that timed one too scales that policy by
    the ratio of the two."""
    from research import speed_reference

    out = tmp_path / "vllm-run"
    assert main(["run", "--workload", "tiny-reasoner", "--engine", "vllm", "--clock", "real", "--engines", "1",
                 "--steps", "1", "--groups-per-step", "2", "--policy", "static",
                 "--report", str(out), "--no-plots", "--quiet"]) == 0
    ref = json.loads((out / "report.json").read_text())["results"]["static"]["speed_reference"]
    assert ref["before"]["copies"] == ref["after"]["copies"] == 1
    for reading in (ref["before"], ref["after"]):
        assert 0 < reading["batch_ms"]["1"] < reading["batch_ms"]["16"]  # 16 activations cost more than 1
    assert ref["ms"] == pytest.approx((ref["before"]["ms"] + ref["after"]["ms"]) / 2)
    fit = tmp_path / "fit.json"
    fit.write_text(json.dumps({"sim_params": {"decode_base_s": 0.002, "decode_per_seq_s": 0.0001},
                               "speed_reference": {"ms": ref["ms"] / 3}}))
    assert main(["predict", str(out), "--cost-model", str(fit), "--out", str(tmp_path / "rows.json")]) == 0
    assert json.loads((tmp_path / "rows.json").read_text())[0]["speed_scale"] == pytest.approx(3.0)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        speed_reference.measure(str(tmp_path))
    capsys.readouterr()
    # Where it cannot run, a run or a calibration goes on without it, and says so.
    assert speed_reference.measure_or_warn(str(tmp_path)) is None
    assert "no host speed reference" in capsys.readouterr().err


def test_predict_prices_a_verified_draft_token_as_one_more_sequence(tmp_path):
    """`predict` charges speculation's verification by the calibrated cost
    of a token in the batch (spec_verify_cost 1.0) unless told otherwise:
    a run with speculation is predicted slower than with free verification,
    and a run without speculation is predicted the same either way."""
    out = _measured_run(tmp_path, "--policy", "static,least-assigned+spec-ngram")
    fit = tmp_path / "fit.json"
    fit.write_text(json.dumps({"sim_params": {"decode_base_s": 0.004, "decode_per_seq_s": 0.002}}))
    rows = {}
    for name, extra in (("priced", []), ("free", ["--sim", "spec_verify_cost=0"])):
        rows[name] = {r["policy"]: r["makespan_s"]["predicted"] for r in _predicted(out, fit, tmp_path, name, *extra)}
    spec = next(p for p in rows["priced"] if "spec" in p)
    assert rows["priced"][spec] > rows["free"][spec]
    assert rows["priced"]["static"] == pytest.approx(rows["free"]["static"], rel=0.02)


def test_predict_replays_a_run_with_its_own_spec_overrides(tmp_path):
    """A run told `--spec schedule=...` is predicted on that schedule: with
    speculation switched off at every batch size, pricing verification
    changes nothing in the prediction."""
    out = _measured_run(tmp_path, "--policy", "least-assigned+spec-ngram",
                        "--spec", "schedule=[[1,65536,0]]", "--spec", "tune=false")
    assert json.loads((out / "report.json").read_text())["config"]["spec"]["schedule"] == [[1, 65536, 0]]
    fit = tmp_path / "fit.json"
    fit.write_text(json.dumps({"sim_params": {"decode_base_s": 0.004, "decode_per_seq_s": 0.002}}))
    predicted = {}
    for name, extra in (("priced", []), ("free", ["--sim", "spec_verify_cost=0"])):
        predicted[name] = _predicted(out, fit, tmp_path, name, *extra)[0]["makespan_s"]["predicted"]
    assert predicted["priced"] == pytest.approx(predicted["free"], rel=0.02)


def test_the_draft_calibration_measures_real_engines_side_by_side_with_a_draft_model_attached(tmp_path, own_vllm_engines):
    """`calibrate --engines 2 --draft bundled` on the bundled model (batches
    up to 4, the tail's own size): two engines, one per core, measure at
    once; K=0 and verify steps are measured by engine steps, the fit is of
    the engines' mean steps, the acceptance pools both engines' drafts (on
    prompts of their own) as a rate per position, and the fit lands in
    `sim_params` for `run --cost-model`."""
    from research.calibrate import main as calibrate

    out = tmp_path / "fit.json"
    assert calibrate(["--engines", "2", "--quick", "--draft", "bundled", "--batches", "1,4", "--verify-batches", "1,2",
                      "--task-groups", "2", "--repeats", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["engines"] == 2 and [e["cores"] for e in doc["per_engine"]] == ["0", "1"]
    for row in doc["measurements"]["decode"]:
        assert len(row["step_s_per_engine"]) == 2 and row["step_s"] == pytest.approx(sum(row["step_s_per_engine"]) / 2)
    draft = doc["draft_measurements"]
    assert {x["batch"] for x in draft["decode_k0"]} == {1, 2, 4}
    assert all(x["step_s"] > 0 for x in draft["decode_k0"] + draft["decode_k"])
    acceptance = draft["acceptance"]
    assert acceptance["drafts"] > 0 and len(acceptance["rates"]) == 4 and acceptance["prompts"] == 4
    assert all(0.0 <= r <= 1.0 for r in acceptance["rates"])
    lengths = acceptance["mean_acceptance_length_per_engine"]
    assert min(lengths) <= acceptance["mean_acceptance_length"] <= max(lengths)
    sim = doc["sim_params"]
    assert sim["spec_acceptance"] == [round(r, 4) for r in acceptance["rates"]]
    assert sim["spec_draft_cost"] >= 0 and sim["spec_verify_cost"] >= 0

    # Through the service: the same 2 engines behind the gRPC server, as a
    # load-test run starts them, B fixed-length requests on each; the
    # speculation terms fitted to the draft measurements above.
    served = tmp_path / "service.json"
    assert calibrate(["--service", "--engines", "2", "--quick", "--batches", "1,4", "--repeats", "1",
                      "--draft-from", str(out), "--out", str(served)]) == 0
    doc = json.loads(served.read_text())
    assert doc["through_service"] and doc["engines"] == 2
    rows = doc["measurements"]["decode"]
    assert [(r["batch"], r["prompt"] == 16) for r in rows][:2] == [(1, True), (4, True)]
    for row in rows:
        assert len(row["step_s_per_engine"]) == 2 and min(row["step_s_per_engine"]) > 0
    assert all(p["time_s"] > 0 for p in doc["measurements"]["prefill"])
    assert doc["sim_params"]["decode_base_s"] > 0
    assert doc["sim_params"]["spec_acceptance"] == sim["spec_acceptance"]
    assert doc["draft_measurements_from"] == str(out)


def test_the_model_free_draft_calibration_measures_verify_steps_that_draft(tmp_path, own_vllm_engines):
    """`calibrate --draft ngram` on the bundled model: an n-gram engine's
    K=0 and verify steps on long prompts, where nearly every step finds a
    match and drafts, and the fit of what those drafts cost lands in
    `sim_params` for `predict` (no acceptance: the run's own)."""
    from research.calibrate import main as calibrate

    out = tmp_path / "ngram.json"
    assert calibrate(["--quick", "--draft", "ngram", "--batches", "1,4", "--verify-batches", "1,4", "--repeats", "1",
                      "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    # The host's speed over the calibration, as runs time it: what `predict` scales a run's costs by.
    assert doc["speed_reference"]["before"]["ms"] > 0 and doc["speed_reference"]["after"]["ms"] > 0
    draft = doc["draft_measurements"]
    assert draft["model_free"] and draft["acceptance"] is None and draft["prompt"] > 100
    assert {x["batch"] for x in draft["decode_k"]} == {1, 4}
    for x in draft["decode_k"]:
        # A difference of two runs' drafted tokens over their difference in steps: on a loaded host the
        # batch may be scheduled over one more step in one run than the other, a few percent either way.
        assert x["step_s"] > 0 and 0.5 * draft["k"] < x["draft_tokens_per_seq_step"] <= 1.1 * draft["k"]
    sim = doc["sim_params"]
    assert sim["spec_ngram_draft_cost"] >= 0 and sim["spec_verify_cost"] >= 0
    assert "spec_acceptance" not in sim and "spec_draft_cost" not in sim
    assert set(doc["draft_fit"]["verify_over_k0"]) == {"1", "4"}  # JSON keys


def test_spec_tail_pace_per_sequence_does_not_depend_on_how_many_sequences_the_tail_holds():
    """Two steps whose tail sequences all run at 12 tokens/s, one tail of 8
    sequences and one of 2: the tail's tokens/s differ 4x, its tokens per
    running sequence per second do not."""
    from research.spec_tail import tail_figures

    def probe(bulk: int, tail: int, pace: float = 12.0, dt: float = 0.5):
        out, tokens, t = [], 0.0, 0.0
        for n in [bulk] * 20 + [tail] * 40:
            out.append((t, int(tokens), n))
            tokens += n * pace * dt
            t += dt
        out.append((t, int(tokens), 0))
        return out

    wide, narrow = tail_figures(probe(32, 8), 8), tail_figures(probe(32, 2), 8)
    assert wide["tail_start_s"] == narrow["tail_start_s"] == pytest.approx(10.0)
    assert wide["tail_tokens_per_s"] == pytest.approx(4 * narrow["tail_tokens_per_s"], rel=0.01)
    assert wide["tail_tokens_per_seq_s"] == pytest.approx(12.0, rel=0.01)
    assert narrow["tail_tokens_per_seq_s"] == pytest.approx(12.0, rel=0.01)


def test_a_benchmark_stopped_with_sigterm_stops_its_vllm_engines(own_vllm_engines):
    """`kill` (SIGTERM) on a running benchmark: it exits, and the vLLM engine
    processes it started do not outlive it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    # Many steps of a small workload on one engine: the signal lands while
    # steps are left to run, never while a finished run is already winding
    # down (which exits 0).
    proc = subprocess.Popen([sys.executable, "-m", "research.spec_tail", "--routes", "off", "--engines", "1",
                             "--steps", "40", "--warmup-steps", "0", "--groups", "1", "--samples", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        for line in proc.stdout:  # wait for the fleet to be up and generating
            if "[off] step 0" in line:
                break
        engines = [p for p in psutil.Process(proc.pid).children(recursive=True)]
        assert engines, "the benchmark started no engine process"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) != 0

        def running(p: psutil.Process) -> bool:
            try:
                return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return False

        deadline = time.monotonic() + 30
        while any(running(p) for p in engines) and time.monotonic() < deadline:
            time.sleep(0.5)
        alive = [p.pid for p in engines if running(p)]
        assert not alive, f"engine processes {alive} outlived the benchmark"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of its process group
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


def test_a_benchmark_stopped_while_winding_down_still_exits_as_stopped():
    """SIGTERM that lands where the interrupt is swallowed (a finished run
    stopping its engines, threads joining at exit) must not report success:
    the process exits 128 + 15 as a shell reports a killed one."""
    import subprocess
    import sys

    code = ("import os, signal, time\n"
            "from research.interrupt import stop_on_sigterm\n"
            "stop_on_sigterm()\n"
            "try:\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(5)\n"
            "except KeyboardInterrupt:\n"
            "    print('unwound')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "unwound"  # the finally/except blocks ran
    assert done.returncode == 143


def test_the_adaptation_curve_refuses_an_unknown_drafter_before_starting_engines(capsys):
    """`drafter_adaptation --drafters` names the drafters side by side; a typo
    is refused with the valid names, before any engine starts."""
    from research.drafter_adaptation import main as adaptation

    with pytest.raises(SystemExit):
        adaptation(["--drafters", "frozen,distilled"])
    assert "--drafters: unknown distilled; choose from frozen, samples, policy" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        adaptation(["--drafters", "frozen,policy@/nonexistent/drafter"])
    assert "--drafters: no drafter (config.json) in /nonexistent/drafter" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        adaptation(["--k", "0"])
    assert "--k: 0; draft at least 1 token per verify step" in capsys.readouterr().err


def test_the_adaptation_curve_refuses_an_eagle_head_taught_by_samples(tmp_path, capsys):
    """An EAGLE head drafts from the policy's hidden states, so only the
    policy can teach it: `samples@HEAD` is refused naming the entry and what
    to use, before any engine starts."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from research.drafter_adaptation import main as adaptation
    from rollout_service.assets import tiny_model_path
    from rollout_service.drafter import eagle

    policy = AutoModelForCausalLM.from_pretrained(str(tiny_model_path()), dtype=torch.float32)
    head = str(eagle.save(eagle.for_policy(policy), tmp_path / "head"))
    with pytest.raises(SystemExit):
        adaptation(["--drafters", f"frozen,samples@{head}"])
    assert f"--drafters: samples@{head}: an EAGLE head trains from the policy; use policy@DIR" \
        in capsys.readouterr().err


def test_the_adaptation_curve_plots_every_kind_of_drafter_side_by_side(tmp_path):
    """The bundled drafters, drafters of their own (`TEACHER@DIR`) and an
    EAGLE head are plotted on one figure, each line labelled."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    from transformers import AutoModelForCausalLM

    from research.drafter_adaptation import plot
    from rollout_service.assets import tiny_draft_path, tiny_model_path
    from rollout_service.drafter import eagle

    policy = AutoModelForCausalLM.from_pretrained(str(tiny_model_path()), dtype=torch.float32)
    head = str(eagle.save(eagle.for_policy(policy), tmp_path / "head"))
    own = str(tiny_draft_path())
    drafters = ["frozen", "samples", "policy", f"frozen@{own}", f"samples@{own}", f"frozen@{head}", f"policy@{head}"]
    out = {"config": {"drafters": drafters, "k": 5, "draft_sampling": "greedy", "drift": "rft"},
           "versions": [{"policy_version": v, **{d: {"mean_acceptance_length": 4.0 - 0.3 * v - 0.1 * i}
                                                 for i, d in enumerate(drafters)}} for v in range(3)]}
    plot(out, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 10_000


def test_the_spec_tail_benchmark_refuses_an_eagle_route_without_a_head(tmp_path, capsys):
    """`spec_tail --routes eagle` needs `--eagle DIR` holding a head; without
    one, with a directory that is not a head, or with an unknown route, it is
    refused naming the flag before any engine starts."""
    from research.spec_tail import main as spec_tail

    for argv, message in ((["--routes", "off,eagle"], "--eagle: the eagle route needs an EAGLE head directory"),
                          (["--routes", "eagle", "--eagle", str(tmp_path)], f"--eagle {str(tmp_path)!r}: not an EAGLE head"),
                          (["--routes", "off,medusa"], "--routes: unknown route(s) ['medusa']")):
        with pytest.raises(SystemExit):
            spec_tail(argv)
        assert message in capsys.readouterr().err


def test_the_drafter_capacity_study_refuses_a_malformed_grid(capsys):
    """`drafter_capacity --grid` takes LRxSTEPS points; anything else is
    refused with the expected form, before the policy drifts."""
    from research.drafter_capacity import main as capacity

    for bad in ("3e-4", "1e-3x0", "fastx300"):
        with pytest.raises(SystemExit):
            capacity(["--grid", bad])
        assert "--grid:" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["local", "process"])
def test_the_relay_capacity_benchmark_relays_every_generated_token(tmp_path, capsys, backend):
    """`relay_capacity --quick` starts the service in a process of its own,
    relays every token the simulated engines generate (in the server's
    process, or in host processes whose CPU it counts apart) to the client,
    and reports each figure of its table (and the same rows as JSON)."""
    from research.relay_capacity import main as relay

    rows = relay(["--quick", "--backend", backend, "--engines-per-host", "1", "--report", str(tmp_path)])
    assert rows == json.loads((tmp_path / "relay_capacity.json").read_text())
    [row] = rows
    assert row["samples"] == 2 * 4 * 2
    assert row["tokens_relayed"] == row["tokens_generated"] == row["tokens_expected"] == row["samples"] * 16
    for key in ("demand_tokens_per_s", "relayed_tokens_per_s", "time_over_ideal", "server_us_per_token",
                "server_ms_per_sample", "sim_cpu_s", "lag_p50_ms", "lag_p99_ms", "lag_max_ms"):
        assert row[key] is not None and row[key] >= 0, key
    assert row["server_us_per_token_excl_sim"] is not None
    if backend == "process":  # the simulator runs in the hosts, whose CPU is reported apart
        assert row["sim_cpu_s"] == 0 and row["host_cores"] > 0
    else:
        assert row["sim_cpu_s"] > 0 and row["host_cores"] is None
    assert "relayed tok/s" in capsys.readouterr().out
