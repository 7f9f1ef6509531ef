"""The rebalancer and the length predictor as pure functions (no event loop)."""
from __future__ import annotations

import dataclasses

import pytest

from rollout_service.engines.types import SamplingParams
from rollout_service.lifecycle.types import Group, GroupSpec, Request
from research.predictor_accuracy import predicted_total, spearman
from rollout_service.scheduling.length_predictor import LengthPredictor
from rollout_service.scheduling.rebalancer import (
    EngineView,
    RebalanceConfig,
    RequestView,
    is_drained,
    plan_moves,
    predicted_time,
)

CFG = RebalanceConfig(drained_fraction=0.25, imbalance_ratio=2.0, min_remaining_tokens=32, max_migrations=2,
                      cooldown_s=1.0, prefill_cost=0.02, per_sequence_cost=0.5, min_gain=0.05)


def _engines(*running):
    return [EngineView(f"e{i}", n, 0, 16) for i, n in enumerate(running)]


def _req(i, engine, remaining, **kw):
    return RequestView(f"r{i}", engine, remaining, remaining * 2, 100, **kw)


def test_drained_engine_takes_the_longest_requests_from_the_loaded_one():
    reqs = [_req(i, "e0", 100 * (i + 1)) for i in range(8)]
    moves = plan_moves(CFG, _engines(8, 0), reqs, now=10.0)
    assert moves and all(m.source == "e0" and m.target == "e1" for m in moves)
    assert moves[0].request_id == "r7"  # the longest first
    assert len(moves) <= 4  # it stops once the target is no longer drained


def test_requests_about_to_finish_are_never_moved():
    reqs = [_req(i, "e0", 10) for i in range(8)]
    assert plan_moves(CFG, _engines(8, 0), reqs, now=10.0) == []


def test_migration_bound_cooldown_and_no_ping_pong():
    reqs = [
        _req(0, "e0", 900, migrations=2),             # at the bound
        _req(1, "e0", 800, moved_at=9.5),             # moved half a second ago
        _req(2, "e0", 700, previous_engine="e1"),     # would go straight back
        _req(3, "e0", 20), _req(4, "e0", 10),     # about to finish
    ]
    assert plan_moves(CFG, _engines(5, 0), reqs, now=10.0) == []


def test_reprefill_cost_must_be_repaid():
    expensive = RequestView("big", "e0", 60, 120, context_tokens=10_000)  # 60 < 0.02 * 10000
    cheap = RequestView("small", "e0", 60, 120, context_tokens=100)
    moves = plan_moves(CFG, _engines(2, 0), [expensive, cheap], now=10.0)
    assert [m.request_id for m in moves] == ["small"]


def test_a_request_that_has_not_started_moves_first():
    # Same predicted gain either way: the one without a token on e0 yet loses no generated work.
    running = RequestView("running", "e0", 600, 1200, context_tokens=100)
    waiting = RequestView("waiting", "e0", 600, 1200, context_tokens=100, started=False)
    moves = plan_moves(CFG, _engines(2, 0), [running, waiting], now=10.0)
    assert [m.request_id for m in moves] == ["waiting"]


def test_moves_must_pay_for_themselves():
    # With a cheap extra sequence per step, splitting two long requests saves little:
    # below min_gain, nothing moves.
    cheap_seqs = RebalanceConfig(per_sequence_cost=0.04, min_gain=0.05)
    reqs = [_req(0, "e0", 600), _req(1, "e0", 600)]
    assert plan_moves(cheap_seqs, _engines(2, 0), reqs, now=10.0) == []
    # A step that costs much more per sequence makes the same move worth it.
    assert len(plan_moves(RebalanceConfig(per_sequence_cost=0.5), _engines(2, 0), reqs, now=10.0)) == 1


def test_lightly_loaded_fleet_of_long_requests_stays_put():
    # Every engine below drained_fraction * max_seqs (16 of 64) with similar predicted
    # work: none is drained relative to the others, so nothing moves.
    cfg = RebalanceConfig()
    engines = [EngineView(f"e{i}", 16, 0, 64) for i in range(4)]
    reqs = [RequestView(f"r{i}.{j}", f"e{i}", 9000 + 300 * ((i * 7 + j) % 5), 16000, 500)
            for i in range(4) for j in range(16)]
    assert plan_moves(cfg, engines, reqs, now=10.0) == []


def test_an_engine_with_a_full_kv_cache_is_not_drained():
    cfg = RebalanceConfig()
    assert is_drained(cfg, EngineView("e0", 2, 0, 64, kv_used=100, kv_capacity=65536))
    assert not is_drained(cfg, EngineView("e0", 2, 0, 64, kv_used=60_000, kv_capacity=65536))
    assert not is_drained(cfg, EngineView("e0", 2, 1, 64))  # something waits there


def test_predicted_time_counts_steps_sequences_kv_and_prefill():
    cfg = RebalanceConfig(per_sequence_cost=0.1, prefill_cost=0.01)
    engine = EngineView("e0", 2, 0, 64)
    reqs = [RequestView("a", "e0", 1000, 2000, 100), RequestView("b", "e0", 500, 900, 100)]
    # 1000 steps for the longest, 1500 tokens at 0.1 each, a moved-in 100-token context's prefill.
    assert predicted_time(cfg, engine, reqs, reprefill=100) == pytest.approx(1000 + 150 + 1)
    # A small KV cache stretches the steps: the remaining KV load over the capacity.
    small = EngineView("e0", 2, 0, 64, kv_capacity=400)
    load = 1000 * 100 + 1000 ** 2 / 2 + 500 * 100 + 500 ** 2 / 2
    assert predicted_time(cfg, small, reqs) == pytest.approx(load / 400 + 150)


def test_balanced_fleet_stays_put():
    reqs = [_req(i, f"e{i % 2}", 300) for i in range(8)]
    assert plan_moves(CFG, _engines(4, 4), reqs, now=10.0) == []


def _request(group_id, index, prompt_id="", prompt_len=10, generated=0):
    spec = GroupSpec(group_id, [1] * prompt_len, 8, SamplingParams(max_tokens=10_000), prompt_id=prompt_id)
    req = Request(f"{group_id}/{index}", Group(spec), index)
    req.token_ids = [5] * generated
    return req


def test_predictor_learns_from_siblings_and_prompt_history():
    p = LengthPredictor(default_length=100)
    for length in (1000, 1100, 900):
        p.observe(_request("g1", 0, prompt_id="hard"), length, group_done=False)
    for length in (20, 25):
        p.observe(_request("g2", 0, prompt_id="easy"), length, group_done=False)
    hard, easy = _request("g1", 5, "hard"), _request("g2", 5, "easy")
    assert p.predict(hard).median > 10 * p.predict(easy).median
    # Conditioning on what was generated: a request past every known length is predicted long.
    runaway = _request("g2", 6, "easy", generated=400)
    assert p.predict(runaway).median >= 400


def test_rank_correlation_of_predictions_on_a_correlated_workload():
    import random

    rng = random.Random(0)
    p = LengthPredictor()
    preds, truth = [], []
    for step in range(3):
        for g in range(40):
            scale = 30 * (1 + g % 10) ** 2  # some prompts are much longer than others
            lengths = [max(1, int(rng.lognormvariate(0, 0.3) * scale)) for _ in range(8)]
            for i, n in enumerate(lengths):
                req = _request(f"s{step}g{g}", i, prompt_id=f"p{g}")
                if step > 0:
                    preds.append(predicted_total(p, req))
                    truth.append(n)
                p.observe(req, n, group_done=i == 7)
    assert spearman(preds, truth) > 0.7


def test_predictor_scales_siblings_by_how_much_longer_groups_ran_than_their_first_sample():
    p = LengthPredictor()
    for g in range(20):  # completed groups: the others ran 1.2-1.6x the first finished sample
        first = 100 * (1 + g)
        for i, n in enumerate([first, int(1.2 * first), int(1.4 * first), int(1.6 * first)]):
            p.observe(_request(f"done{g}", i, prompt_len=50), n, group_done=i == 3)
    p.observe(_request("short", 0, prompt_len=50), 300, group_done=False)
    p.observe(_request("long", 0, prompt_len=50), 3000, group_done=False)
    short = predicted_total(p, _request("short", 1, prompt_len=50, generated=300))
    long = predicted_total(p, _request("long", 1, prompt_len=50, generated=3000))
    assert 300 < short < 600 and 3000 < long < 6000


ISO = RebalanceConfig(isolate_tail=True, per_sequence_cost=0.04, prefill_cost=0.005, min_gain=0.05,
                      min_remaining_tokens=32, max_migrations=2, cooldown_s=1.0)


def _tail_fleet(co_remaining=1000, target_running=8):
    """e0 runs one long response and 15 co-runners; e1 and e2 run
    `target_running` shorter requests each (none drained)."""
    engines = [EngineView("e0", 16, 0, 16), EngineView("e1", target_running, 0, 16),
               EngineView("e2", target_running, 0, 16)]
    reqs = [RequestView("tail", "e0", 5000, 15000, 400)]
    reqs += [RequestView(f"co{i}", "e0", co_remaining, 2 * co_remaining, 400) for i in range(15)]
    reqs += [RequestView(f"{e}-{i}", e, 1000, 2000, 400) for e in ("e1", "e2") for i in range(target_running)]
    return engines, reqs


def test_isolation_moves_the_co_runners_off_the_engine_that_ends_the_step():
    engines, reqs = _tail_fleet()
    assert plan_moves(RebalanceConfig(per_sequence_cost=0.04), engines, reqs, now=10.0) == []  # off by default
    moves = plan_moves(ISO, engines, reqs, now=10.0)
    moved = {m.request_id for m in moves}
    assert moved == {f"co{i}" for i in range(15)}  # all of them, never the tail itself
    assert all(m.source == "e0" and m.target in ("e1", "e2") for m in moves)  # 16 free slots there
    # Each target still ends long before the tail would alone.
    after = {e.engine_id: [r for r in reqs if r.engine_id == e.engine_id] for e in engines}
    for m in moves:
        after[m.target].append(next(r for r in reqs if r.request_id == m.request_id))
    tail_alone = predicted_time(ISO, engines[0], [reqs[0]])
    assert all(predicted_time(ISO, e, after[e.engine_id]) < tail_alone for e in engines[1:])


def test_isolation_sends_co_runners_to_the_queue_when_the_other_engines_are_full():
    engines, reqs = _tail_fleet(target_running=16)
    moves = plan_moves(ISO, engines, reqs, now=10.0)
    assert moves and all(m.target is None for m in moves)


def test_isolation_leaves_co_runners_that_barely_slow_the_tail():
    # 15 co-runners with 40 tokens left add 0.04 * 600 = 24 lone steps to a 5,200-step tail: under min_gain.
    engines, reqs = _tail_fleet(co_remaining=40)
    assert plan_moves(ISO, engines, reqs, now=10.0) == []


def test_isolation_respects_the_migration_bound_and_cooldown():
    engines, reqs = _tail_fleet()
    reqs = [RequestView(r.request_id, r.engine_id, r.remaining, r.remaining_high, r.context_tokens,
                        migrations=2 if r.request_id.startswith("co") and int(r.request_id[2:]) % 2 else 0,
                        moved_at=9.5 if r.request_id == "co0" else float("-inf")) for r in reqs]
    # Moving the 7 others saves 4.8% of e0's predicted time.
    moved = {m.request_id for m in plan_moves(dataclasses.replace(ISO, min_gain=0.03), engines, reqs, now=10.0)}
    assert moved and "co0" not in moved and not any(int(i[2:]) % 2 for i in moved)


def _mixed_fleet(informed=True):
    """Two engines, each running two 1,000-token responses and twenty of 200."""
    engines = [EngineView("e0", 22, 0, 64), EngineView("e1", 22, 0, 64)]
    reqs = []
    for e in ("e0", "e1"):
        reqs += [RequestView(f"{e}-long{i}", e, 1000, 2000, 100, informed=informed) for i in range(2)]
        reqs += [RequestView(f"{e}-short{i}", e, 200, 400, 100, informed=informed) for i in range(20)]
    return engines, reqs


def test_repack_regroups_long_responses_onto_one_engine():
    cfg = RebalanceConfig(repack=True, per_sequence_cost=0.04, prefill_cost=0.005, max_moves_per_tick=64)
    engines, reqs = _mixed_fleet()
    assert plan_moves(RebalanceConfig(per_sequence_cost=0.04), engines, reqs, now=10.0) == []  # off by default
    moves = plan_moves(cfg, engines, reqs, now=10.0)
    where = {r.request_id: r.engine_id for r in reqs}
    where.update({m.request_id: m.target for m in moves})
    long_engines = {e for r, e in where.items() if "long" in r}
    assert len(long_engines) == 1  # all four long responses together...
    assert all(e not in long_engines for r, e in where.items() if "short" in r)  # ...the short ones elsewhere
    # Only what the predictor knows about (a finished sibling, the prompt's history) moves.
    engines, reqs = _mixed_fleet(informed=False)
    assert plan_moves(cfg, engines, reqs, now=10.0) == []
