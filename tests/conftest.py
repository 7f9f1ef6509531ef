"""Shared fixtures: a real service on loopback ports, talked to by the real
client; the fleets of real vLLM CPU engines; the Ray cluster; the markers.

Each fleet of vLLM engines is one fixture per configuration, started on
first use (~20 s per engine here) and kept for the session by `Fleets`:
starting one closes the live fleets that the running test module does not
use, and a fleet closes after the last module that uses it, so memory holds
only the engines of the running module (24 GiB here; 1 GiB of KV cache per
engine). Test modules are ordered so that the modules on one fleet run
together (each in its own order), after the modules that start no fleet:
each configuration starts once. A module on `vllm_service` begins on the
bundled weights, whatever the module before it pushed.

Markers come from the fixtures a test uses (`item.fixturenames`): `vllm`
for real vLLM engines, `ray` for the Ray cluster, `slow` for the rest that
take long. `make test-fast` runs the tests with none of them."""
from __future__ import annotations

import os

import pytest

from helpers import (RAY_STORE, SPEC_MAX_SEQS, add_ray_node, connect, eagle_cfg, ray_config, running, sim_config,
                     spec_cfg, vllm_model, wait_until)
from rollout_service.config import EngineConfig, ServiceConfig

# The fleets, in the order their test modules run.
FLEETS = ("vllm_service", "spec_service", "eagle_service", "plain_engine", "ray_vllm_service")
# Fixtures that put a test on real vLLM engines: the fleets, and engines a
# test starts for itself (directly, or through a command-line tool).
VLLM_FIXTURES = frozenset(FLEETS) | {"sampled_drafts_engine", "stock_engine", "own_vllm_engines"}
RAY_FIXTURES = frozenset({"ray_cluster"})
# Tests on simulated engines (or none) that still take seconds, no fixture
# of theirs saying so: what each costs here, and why.
SLOW = {
    "test_core_failures.py::test_100k_aborted_groups_leave_no_state_in_the_length_predictor": "~50 s: 100,000 groups",
    "test_tiny_model.py::test_sampled_batch_pass_rate_and_long_tail": "~12 s: a batch sampled with transformers",
    "test_restart.py::test_sigterm_checkpoints_and_a_restarted_server_delivers_each_group_once":
        "~10 s: a server started twice as a subprocess",
    "test_load_tests.py::test_two_passes_run_the_policies_there_and_back_on_the_two_halves_of_the_steps":
        "~7 s: load-test runs",
    "test_load_tests.py::test_predict_runs_each_policy_at_the_host_speed_its_run_measured": "~7 s: load-test runs",
    "test_load_tests.py::test_a_real_time_run_writes_what_was_generated_and_predict_replays_it":
        "~6 s: a real-time load-test run",
    "test_load_tests.py::test_predict_prices_a_verified_draft_token_as_one_more_sequence": "~5 s: load-test runs",
}


def pytest_collection_modifyitems(config, items):
    """Mark each test from its fixtures, and run the modules on one fleet
    together (modules without a fleet first; order kept within a module)."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & VLLM_FIXTURES:
            item.add_marker(pytest.mark.vllm)
        if names & RAY_FIXTURES:
            item.add_marker(pytest.mark.ray)
        if item.nodeid.split("[")[0].removeprefix("tests/") in SLOW:
            item.add_marker(pytest.mark.slow)
    fleet_of: dict[str, int] = {}
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        module = _module(item)
        first_seen.setdefault(module, i)
        used = [FLEETS.index(f) for f in getattr(item, "fixturenames", ()) if f in FLEETS]
        if used:
            fleet_of[module] = min(fleet_of.get(module, len(FLEETS)), min(used))
    position = {id(item): i for i, item in enumerate(items)}

    def key(item):
        module = _module(item)
        return fleet_of.get(module, -1), first_seen[module], position[id(item)]

    items.sort(key=key)


# -- simulated engines ----------------------------------------------------------------

@pytest.fixture(scope="session")
async def sim_service():
    """One service on 2 simulated engines for the whole session."""
    async with running(sim_config(num_engines=2)) as service:
        yield service


@pytest.fixture
async def client(sim_service):
    async with connect(sim_service, "test") as c:
        yield c


# -- real vLLM engines -------------------------------------------------------------------

class Fleets:
    """The session's live fleets, by fixture name. `acquire` starts one on
    first use and closes the fleets the requesting module does not use."""

    def __init__(self) -> None:
        self.live: dict[str, tuple[object, object]] = {}  # name -> (fleet, async close)
        self.bundled_version: dict[int, int] = {}  # id(service) -> the version that serves the bundled weights

    async def acquire(self, name: str, request, start):
        """The fleet `name`, started with `start()` -> (fleet, close) if it is
        not live; any live fleet that no test of `request`'s module uses is
        closed first."""
        if name in self.live:
            return self.live[name][0]
        needed = _fleets_of_module(request)
        for other in [n for n in self.live if n not in needed]:
            await self.release(other)
        fleet, close = await start()
        self.live[name] = (fleet, close)
        return fleet

    async def done(self, name: str, request) -> None:
        """Close `name` when no test after `request`'s module uses it."""
        module = _module(request.node)
        items = request.session.items
        last = max((i for i, item in enumerate(items) if _module(item) == module), default=len(items))
        if name in self.live and not any(name in getattr(item, "fixturenames", ()) for item in items[last + 1:]):
            await self.release(name)

    async def release(self, name: str) -> None:
        _, close = self.live.pop(name)
        await close()

    async def close(self) -> None:
        for name in list(self.live):
            await self.release(name)


def _module(node) -> str:
    return node.nodeid.split("::")[0]


def _fleets_of_module(request) -> set[str]:
    module = _module(request.node)
    return {f for item in request.session.items if _module(item) == module
            for f in getattr(item, "fixturenames", ()) if f in FLEETS}


@pytest.fixture(scope="session")
async def fleets():
    registry = Fleets()
    yield registry
    await registry.close()


def _service_starter(cfg: ServiceConfig):
    async def start():
        cm = running(cfg)
        return await cm.__aenter__(), lambda: cm.__aexit__(None, None, None)
    return start


def _engine_starter(engine):
    async def start():
        await engine.start()
        return engine, engine.close
    return start


async def _on_bundled_weights(fleets: Fleets, service) -> None:
    """Every engine ready and serving the bundled weights (pushed as the next
    version when a module before pushed others)."""
    await wait_until(lambda: all(e.load().state == "ready" for e in service.core.engines.values())
                     and not any(service.core.is_restarting(e) for e in service.core.engines),
                     240, "every engine of the fleet to be ready")
    if service.core.policy_version != fleets.bundled_version.get(id(service), 0):
        version = service.core.policy_version + 1
        async with connect(service, "fleet") as c:
            await c.push_weights_file(os.path.join(vllm_model(), "model.safetensors"), version=version)
        fleets.bundled_version[id(service)] = version


@pytest.fixture(scope="module")
async def vllm_service(fleets, request):
    """2 real vLLM CPU engines behind the service (the bundled tiny model,
    float32, prefix caching on, up to 32 sequences each), with the `check`
    environment for multi-turn trajectories (`helpers.check_step`)."""
    pytest.importorskip("vllm")
    cfg = ServiceConfig(
        grpc_port=0, http_port=0,
        engine=EngineConfig(kind="vllm", num_engines=2, model=vllm_model(), max_model_len=1024, max_seqs=32),
        environments={"check": {"entry_point": "helpers:check_step", "timeout_s": 60}})
    service = await fleets.acquire("vllm_service", request, _service_starter(cfg))
    await _on_bundled_weights(fleets, service)
    yield service
    await fleets.done("vllm_service", request)


@pytest.fixture
async def vclient(vllm_service):
    async with connect(vllm_service, "v") as c:
        yield c


@pytest.fixture(scope="module")
async def spec_service(fleets, request):
    """1 real vLLM engine that speculates with the bundled drafter (K=3
    drafts at every batch size, up to 64 sequences)."""
    pytest.importorskip("vllm")
    cfg = ServiceConfig(grpc_port=0, http_port=0, engine=EngineConfig(
        kind="vllm", num_engines=1, model=vllm_model(), max_model_len=1024, max_seqs=SPEC_MAX_SEQS, spec=spec_cfg()))
    yield await fleets.acquire("spec_service", request, _service_starter(cfg))
    await fleets.done("spec_service", request)


@pytest.fixture(scope="session")
def head_dir(tmp_path_factory) -> str:
    """An EAGLE head built for the bundled reasoner by `rollout-service
    build-eagle` (a short build: 64 responses, 200 steps at draft depths 1-3)."""
    from rollout_service.drafter.build_eagle import build

    out = tmp_path_factory.mktemp("eagle")
    summary = build(out, target=vllm_model(), samples=64, held_out=16, max_tokens=120, steps=200, depth=3, threads=1)
    assert summary["held_out_acceptance"]["greedy"] > 0.3, summary  # the build learnt something
    # The report by response position: responses of at most 120 tokens all fall in the first range, and no
    # greedy draft is accepted more often than the policy's own argmax would be.
    by_position = summary["held_out_acceptance"]["greedy_by_position"]
    assert by_position["0-150"]["tokens"] > 100 and not any(v["tokens"] for k, v in by_position.items() if k != "0-150")
    assert 0.3 < by_position["0-150"]["head"] <= by_position["0-150"]["policy_ceiling"] <= 1.0 + 1e-6
    return str(out)


@pytest.fixture(scope="module")
async def eagle_service(fleets, request, head_dir):
    """1 real vLLM engine that speculates with the EAGLE head of `head_dir`."""
    pytest.importorskip("vllm")
    cfg = ServiceConfig(grpc_port=0, http_port=0, engine=EngineConfig(
        kind="vllm", num_engines=1, model=vllm_model(), max_model_len=1024, max_seqs=SPEC_MAX_SEQS,
        spec=eagle_cfg(head_dir)))
    yield await fleets.acquire("eagle_service", request, _service_starter(cfg))
    await fleets.done("eagle_service", request)


@pytest.fixture(scope="module")
async def plain_engine(fleets, request):
    """1 real vLLM engine without speculation (the reference of the
    speculative engines; prefix caching on), on the second core."""
    pytest.importorskip("vllm")
    from rollout_service.engines.vllm import VllmEngine

    engine = VllmEngine("plain", vllm_model(), max_seqs=SPEC_MAX_SEQS, max_model_len=1024, cpu_bind="1", seed=1)
    yield await fleets.acquire("plain_engine", request, _engine_starter(engine))
    await fleets.done("plain_engine", request)


@pytest.fixture
async def sampled_drafts_engine():
    """1 engine whose drafts are sampled from the drafter (not argmax)."""
    pytest.importorskip("vllm")
    from rollout_service.engines.vllm import VllmEngine

    engine = VllmEngine("sampled-drafts", vllm_model(), max_seqs=SPEC_MAX_SEQS, max_model_len=1024, cpu_bind="0",
                        seed=3, spec=spec_cfg(draft_sample_method="probabilistic"))
    await engine.start()
    yield engine
    await engine.close()


@pytest.fixture
async def stock_engine():
    """1 speculating engine on vLLM's stock CPU rejection sampler
    (ROLLOUT_STOCK_SPEC_SAMPLER=1 in its processes, its refusal to run
    without the fix waived): the negative control of exactness."""
    pytest.importorskip("vllm")
    from rollout_service.engines.vllm import VllmEngine

    engine = VllmEngine("stock", vllm_model(), max_seqs=SPEC_MAX_SEQS, max_model_len=1024, cpu_bind="0", seed=2,
                        spec=spec_cfg(), env={"ROLLOUT_STOCK_SPEC_SAMPLER": "1"}, require_exact_sampler=False)
    await engine.start()
    yield engine
    await engine.close()


@pytest.fixture
def own_vllm_engines():
    """The test starts real vLLM engines of its own: through the command
    line tool under test (a load-test run, a calibration, a benchmark), or
    one whose start-up is what the test checks."""
    pytest.importorskip("vllm")


# -- Ray ----------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster: a head node and one worker node, each a separate
    set of Ray processes on this machine; 1 CPU each, so that a placement
    group of 1-CPU bundles spreads over both."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, object_store_memory=RAY_STORE,
                                                          include_dashboard=False))
    worker = add_ray_node(c)
    ray.init(address=c.address, include_dashboard=False, log_to_driver=True)
    c.worker = worker
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
async def ray_vllm_service(fleets, request, ray_cluster):
    """2 real vLLM engines as Ray actors, one on each node of `ray_cluster`
    (up to 32 sequences each); unfinished work is paused and re-prefilled
    across a push (carry-over `pause-resume`)."""
    pytest.importorskip("vllm")
    cfg = ray_config(ray_cluster, kind="vllm", num_engines=2, model=vllm_model(), max_model_len=1024, max_seqs=32)
    # Paused and resumed across a push: every token's context is computed by
    # the weights its tag names, so a recomputation is exact.
    # (Under `continue`, tokens after a push attend to KV the old weights computed.)
    cfg.carry_over.mode = "pause-resume"
    yield await fleets.acquire("ray_vllm_service", request, _service_starter(cfg))
    await fleets.done("ray_vllm_service", request)
