"""Multi-turn trajectories on 2 real vLLM CPU engines (the bundled tiny
model, prefix caching on, as vLLM defaults): with session affinity a
trajectory's later turns find their context in vLLM's prefix cache, read
from vLLM's own counters; placed anew each turn they often do not."""
from __future__ import annotations

import statistics
import time

import pytest

pytest.importorskip("vllm")

from rollout_service.config import EngineConfig, ServiceConfig  # noqa: E402
from rollout_service.engines.types import SamplingParams  # noqa: E402
from rollout_service.lifecycle.types import EnvReply, EnvRequest, GroupSpec, MultiTurnSpec  # noqa: E402

from conftest import running, unique, vllm_model  # noqa: E402

pytestmark = pytest.mark.vllm
TURNS = 3
OBSERVATION = 120  # tokens a tool call returns


async def observe(req: EnvRequest) -> EnvReply:
    """A tool that answers each turn with a fixed-length observation and ends
    the trajectory after its third turn."""
    if req.turn >= TURNS - 1:
        return EnvReply(done=True)
    return EnvReply(observation_token_ids=[3 + (req.turn * 31 + i * 7 + req.index) % 90 for i in range(OBSERVATION)])


@pytest.fixture(scope="module")
async def service():
    cfg = ServiceConfig(grpc_port=0, http_port=0,
                        engine=EngineConfig(kind="vllm", num_engines=2, model=vllm_model(), max_model_len=1024,
                                            max_seqs=8),
                        environments={"obs": {"entry_point": "test_vllm_multiturn:observe"}})
    async with running(cfg) as s:
        yield s


async def _replay(core, affinity: bool, trajectories: int = 8) -> dict:
    """Run `trajectories` 3-turn trajectories (distinct 400-token prompts);
    vLLM's prefix-cache counters over the run, the seconds per later turn,
    and the moves."""
    core.affinity = affinity
    tag = unique("mt")
    before = core.status()
    moves0 = core.counters.get("trajectory_moves", 0)
    specs = [GroupSpec(f"{tag}-{i}", [1] + [3 + (hash((tag, i)) + 13 * k) % 90 for k in range(399)], 1,
                       SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                       multi_turn=MultiTurnSpec(max_turns=TURNS, environment="obs"))
             for i in range(trajectories)]
    t0 = time.monotonic()
    core.submit(specs)
    samples = []
    async for entry in core.delivery.stream(tag):
        s = entry.sample
        if s.group_id.startswith(tag) and not s.awaiting_observation:
            samples.append(s)
            if len(samples) == trajectories:
                break
    wall = time.monotonic() - t0
    after = core.status()
    queried = after.prefix_cache_queried_tokens - before.prefix_cache_queried_tokens
    hits = after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
    later = [t.finished_at - t.started_at for s in samples for t in s.turns[1:] if t.kind == "generated"]
    return {"samples": samples, "hit_rate": hits / queried if queried else 0.0, "hits": hits, "wall_s": wall,
            "later_turn_s": statistics.mean(later), "moves": core.counters.get("trajectory_moves", 0) - moves0}


async def test_affinity_raises_vllms_measured_prefix_cache_hit_rate(service):
    core = service.core
    placed_anew = await _replay(core, affinity=False)
    affine = await _replay(core, affinity=True)
    for run in (placed_anew, affine):
        assert all(len([t for t in s.turns if t.kind == "generated"]) == TURNS for s in run["samples"])
        assert all(s.loss_mask.count(0) == OBSERVATION * (TURNS - 1) for s in run["samples"])
    print(f"\nvLLM prefix cache, 8 trajectories x {TURNS} turns on 2 engines: hit rate of all prompt tokens "
          f"looked up {placed_anew['hit_rate']:.3f} placed anew ({placed_anew['moves']} moves) -> "
          f"{affine['hit_rate']:.3f} with affinity ({affine['moves']} moves); seconds per later turn "
          f"{placed_anew['later_turn_s']:.3f} -> {affine['later_turn_s']:.3f}")
    assert affine["moves"] == 0
    # Placed anew, a turn lands on its previous engine only by chance; each
    # move re-prefills a context the other engine holds.
    if placed_anew["moves"] > 0:
        assert affine["hit_rate"] > placed_anew["hit_rate"]
    else:
        assert affine["hit_rate"] >= placed_anew["hit_rate"]
    # Every later turn with affinity finds at least the prompt's whole blocks cached.
    assert affine["hits"] >= 8 * (TURNS - 1) * 200
