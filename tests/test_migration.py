"""Partial-rollout migration on real vLLM CPU engines: exact continuation,
unchanged outcome distribution, bounded migrations."""
from __future__ import annotations

import asyncio
import contextlib
import statistics

import pytest

pytest.importorskip("vllm")

from rollout_service.scheduling.length_predictor import LengthPredictor  # noqa: E402
from rollout_service.scheduling.rebalancer import RebalanceConfig  # noqa: E402
from trainer_client import PromptGroup  # noqa: E402

from helpers import collect, unique  # noqa: E402


def _problems(n):
    from rollout_service.tasks import generate_problems, prompt_token_ids

    return [(p, prompt_token_ids(p)) for p in generate_problems(n, seed=11)]


async def _run(vclient, core, problems, samples, migrate_at=None, max_tokens=256):
    """Generate; with `migrate_at`, move every request once after that many tokens."""
    prefix = unique("dist")
    await vclient.submit([PromptGroup(prompt_token_ids=ids, num_samples=samples, max_tokens=max_tokens,
                                      temperature=1.0, group_id=f"{prefix}-{i}") for i, (_, ids) in enumerate(problems)])
    mover = None
    if migrate_at is not None:
        async def move_all():
            engines = list(core.engines)
            while True:
                for req, _ in list(core.running.values()):
                    if (req.group.group_id.startswith(prefix) and req.num_migrations == 0
                            and req.engine_id is not None and len(req.token_ids) >= migrate_at):
                        await core.migrate(req, next(e for e in engines if e != req.engine_id))
                await asyncio.sleep(0.002)  # the mover's pace: it runs beside the rollout until cancelled

        mover = asyncio.create_task(move_all())
    try:
        return await collect(vclient, prefix, len(problems) * samples, timeout=600)
    finally:
        if mover:
            mover.cancel()


async def test_migration_leaves_the_outcome_distribution_unchanged(vllm_service, vclient):
    from scipy import stats

    from rollout_service.tasks import decode, verify

    core = vllm_service.core
    problems = _problems(16)
    plain = await _run(vclient, core, problems, 16)
    moved = await _run(vclient, core, problems, 16, migrate_at=4)
    assert sum(s.num_migrations for s in moved) >= 0.5 * len(moved)  # most were really moved
    by_group = {f"{i}": p for i, (p, _) in enumerate(problems)}

    def outcome(samples):
        lengths = [len(s.response_token_ids) for s in samples]
        passed = [verify(by_group[s.group_id.rsplit("-", 1)[1]], decode(s.response_token_ids)) for s in samples]
        return lengths, passed

    la, pa = outcome(plain)
    lb, pb = outcome(moved)
    # Two-sample tests at the 1% level: 256 samples each.
    assert stats.mannwhitneyu(la, lb).pvalue > 0.01, (statistics.mean(la), statistics.mean(lb))
    table = [[sum(pa), len(pa) - sum(pa)], [sum(pb), len(pb) - sum(pb)]]
    if min(map(sum, zip(*table))) > 0:
        assert stats.chi2_contingency(table).pvalue > 0.01, table


async def test_rebalancer_never_exceeds_the_migration_bound(vllm_service, vclient):
    core = vllm_service.core
    saved = core.rebalance, core.predictor
    # Aggressive on purpose: every tick finds moves, so only the bound stops them.
    core.rebalance = RebalanceConfig(interval_s=0.01, drained_fraction=1.0, imbalance_ratio=0.0, min_remaining_tokens=0,
                                     prefill_cost=0.0, max_migrations=1, cooldown_s=0.0)
    core.predictor = core.predictor or LengthPredictor()
    task = asyncio.create_task(_tick(core))
    try:
        samples = await _run(vclient, core, _problems(8), 4)
    finally:
        task.cancel()
        core.rebalance, core.predictor = saved
    assert max(s.num_migrations for s in samples) == 1
    assert len({s.sample_id for s in samples}) == 32


async def _tick(core):
    while True:
        with contextlib.suppress(Exception):
            await core.rebalance_once()
        await asyncio.sleep(0.01)  # the rebalancer's pace, until cancelled
