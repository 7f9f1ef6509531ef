"""Shared fixtures: a real service on loopback ports, talked to by the real
client; the fleets of real vLLM CPU engines; the Ray cluster; the markers.

Each fleet of vLLM engines is one fixture per configuration, kept for the
session by `Fleets`. Test modules are ordered so that the modules on one
fleet run together (each in its own order), after the modules that start no
fleet: each configuration starts once. A fleet starts (~20 s per engine
here, mostly imports on one core) in the background while the modules
before its first run (from the start of the session, or of the group of
modules before), and closes after its last, so memory holds the engines of
the running group and of the next (24 GiB here; 1 GiB of KV cache per
engine). The EAGLE head builds in a subprocess from the start of
the session. A module on `vllm_service` begins on the bundled weights,
whatever the module before it pushed.

Markers come from the fixtures a test uses (`item.fixturenames`): `vllm`
for real vLLM engines, `ray` for the Ray cluster, `slow` for the rest that
take long. `make test-fast` runs the tests with none of them. A test on
engines of its own and on no shared fleet or cluster is also `own_vllm`:
`make test` runs those beside the fleets (scripts/test_suite.sh)."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from helpers import (RAY_STORE, SPEC_MAX_SEQS, add_ray_node, connect, eagle_cfg, ray_config, running, sim_config,
                     spec_cfg, vllm_model, wait_until)
from rollout_service.config import EngineConfig, ServiceConfig

# The fleets, in the order their test modules run.
FLEETS = ("vllm_service", "spec_service", "plain_engine", "sampled_drafts_engine", "stock_engine", "eagle_service",
          "ray_vllm_service")
# Fixtures that put a test on real vLLM engines: the fleets, and engines a
# test starts for itself (directly, or through a command-line tool).
VLLM_FIXTURES = frozenset(FLEETS) | {"own_vllm_engines"}
RAY_FIXTURES = frozenset({"ray_cluster"})
# Tests on simulated engines (or none) that still take seconds, no fixture
# of theirs saying so: what each costs here, and why.
SLOW = {
    "test_crash_restart.py::test_resubmit_on_restart_completes_the_groups_without_duplicates":
        "~6 s: a server started twice as a subprocess",
    "test_crash_restart.py::test_a_restart_without_state_dir_raises_service_restarted_naming_the_groups":
        "~6 s: a server started twice as a subprocess",
    "test_crash_restart.py::test_a_trajectory_a_weight_push_restarted_stays_restarted_after_a_sigkill":
        "~8 s: a server started twice as a subprocess",
    "test_crash_restart.py::test_a_journal_that_cannot_be_written_fails_submit_and_the_stream_naming_state_dir":
        "~8 s: a server started twice as a subprocess",
    "test_collective_sharded.py::test_every_rank_of_a_sharded_trainer_takes_part_and_learns_the_applied_version":
        "~5 s: two trainer ranks with torch.distributed",
    "test_tiny_model.py::test_sampled_batch_pass_rate_and_long_tail": "~12 s: a batch sampled with transformers",
    "test_fuzz_routes.py::test_every_rpc_answers_random_and_oversized_values_with_a_status_naming_them":
        "~5 s: 500 random calls",
    "test_fuzz_routes.py::test_every_http_route_answers_random_and_oversized_values_without_a_500":
        "~15 s: 300 random requests",
    "test_memory_bounds.py::test_100k_abandoned_trajectories_end_at_their_deadline_and_memory_stays_flat":
        "~1 min: 120,000 trajectories through a server subprocess",
    "test_memory_bounds.py::test_1000_consumers_that_vanish_mid_stream_stop_pinning_samples_and_memory_stays_flat":
        "~1-2 min: 5 rounds of 1,000 vanishing streams and 20,000 samples",
    "test_restart.py::test_sigterm_checkpoints_and_a_restarted_server_delivers_each_group_once":
        "~8 s: a server started twice as a subprocess",
    "test_nothing_hangs.py::test_after_an_abort_and_with_a_request_in_flight_sigterm_stops_promptly":
        "~5 s: a server started as a subprocess",
    "test_research.py::test_two_passes_run_the_policies_there_and_back_on_the_two_halves_of_the_steps":
        "~7 s: load-test runs",
    "test_research.py::test_predict_runs_each_policy_at_the_host_speed_its_run_measured": "~7 s: load-test runs",
    "test_research.py::test_a_real_time_run_writes_what_was_generated_and_predict_replays_it":
        "~6 s: a real-time load-test run",
    "test_research.py::test_predict_prices_a_verified_draft_token_as_one_more_sequence": "~5 s: load-test runs",
    "test_selftest.py::test_selftest_for_a_platform_this_machine_lacks_fails_naming_it": "~8 s: imports vLLM",
    "test_process_hosts.py::test_engines_in_hosts_serve_push_weights_and_survive_a_killed_host":
        "~6 s: 128 samples of up to 300 one-token steps, a host killed and started again",
    "test_process_hosts.py::test_a_killed_server_leaves_no_host_behind": "~3 s: a server started as a subprocess",
    "test_crash_restart.py::test_chaos_five_sigkills_in_a_closed_loop_of_1000_groups_lose_and_repeat_nothing":
        "~40-60 s: 1,000 groups, a server started six times as a subprocess",
    "test_crash_restart.py::test_sigkill_with_state_dir_delivers_every_sample_once_under_its_cursor":
        "~15 s: a server started three times as a subprocess",
    "test_bench.py::test_the_wheel_carries_the_bench_and_its_traces_and_bench_help_runs_from_it":
        "~4 s: builds the wheel and installs it",
    "test_crash_restart.py::test_weights_after_a_restart_are_the_last_pushed_or_the_version_really_served":
        "~17 s: a server started three times as a subprocess",
}


def pytest_collection_modifyitems(config, items):
    """Mark each test from its fixtures, and run the modules on one fleet
    together (modules without a fleet first; order kept within a module)."""
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & VLLM_FIXTURES:
            item.add_marker(pytest.mark.vllm)
            if not names & (set(FLEETS) | RAY_FIXTURES):
                item.add_marker(pytest.mark.own_vllm)
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

def _service_starter(cfg: ServiceConfig):
    async def start():
        cm = running(cfg)
        return await cm.__aenter__(), lambda: cm.__aexit__(None, None, None)
    return start


def _engine_starter(engine_id: str, **kw):
    async def start():
        from rollout_service.engines.vllm import VllmEngine

        engine = VllmEngine(engine_id, vllm_model(), max_seqs=SPEC_MAX_SEQS, max_model_len=1024, **kw)
        try:
            await engine.start()
        except BaseException:
            await engine.close()
            raise
        return engine, engine.close
    return start


def _vllm_service_config() -> ServiceConfig:
    return ServiceConfig(
        grpc_port=0, http_port=0,
        engine=EngineConfig(kind="vllm", num_engines=2, model=vllm_model(), max_model_len=1024, max_seqs=32),
        weights_file_dirs=[vllm_model(), tempfile.gettempdir()],  # file pushes: the bundled model, tests' tmp_path
        environments={"check": {"entry_point": "helpers:check_step", "timeout_s": 60}})


# How each fleet starts: (fleet, async close). Those started from other
# fixtures' values (the EAGLE head, the Ray cluster) take the request.
STARTERS = {
    "vllm_service": lambda request: _service_starter(_vllm_service_config()),
    "spec_service": lambda request: _service_starter(ServiceConfig(grpc_port=0, http_port=0, engine=EngineConfig(
        kind="vllm", num_engines=1, model=vllm_model(), max_model_len=1024, max_seqs=SPEC_MAX_SEQS, spec=spec_cfg()))),
    "plain_engine": lambda request: _engine_starter("plain", cpu_bind="1", seed=1),
    "sampled_drafts_engine": lambda request: _engine_starter(
        "sampled-drafts", cpu_bind="0", seed=3, spec=spec_cfg(draft_sample_method="probabilistic")),
    "stock_engine": lambda request: _engine_starter(
        "stock", cpu_bind="0", seed=2, spec=spec_cfg(), env={"ROLLOUT_STOCK_SPEC_SAMPLER": "1"},
        require_exact_sampler=False),
    "eagle_service": lambda request: _service_starter(ServiceConfig(grpc_port=0, http_port=0, engine=EngineConfig(
        kind="vllm", num_engines=1, model=vllm_model(), max_model_len=1024, max_seqs=SPEC_MAX_SEQS,
        spec=eagle_cfg(request.getfixturevalue("head_dir"))))),
    "ray_vllm_service": lambda request: _service_starter(_ray_vllm_config(request.getfixturevalue("ray_cluster"))),
}
# Fleets started ahead of their modules, while the modules before them run
# (an engine's start-up is mostly imports, on one core). Engines spawn one at
# a time, so an engine killed by a test restarts only after the start-ups
# ahead of it: these are started when a module begins, not later. Not the
# engines only test_spec_decode uses (memory), nor the Ray fleet, whose
# actors need the CPUs that the simulated Ray tests use first; the EAGLE
# fleet once its head is built.
PRESTART = {
    "vllm_service": lambda request: True,
    "spec_service": lambda request: True,
    "plain_engine": lambda request: True,
    "eagle_service": lambda request: _eagle_built(request.config),
}


class Fleets:
    """The session's fleets, by fixture name: started when a module first
    needs them (all of a module's at once) or ahead of it, closed after the
    last module that uses them."""

    def __init__(self) -> None:
        self.live: dict[str, tuple[object, object]] = {}  # name -> (fleet, async close)
        self.starting: dict[str, asyncio.Task] = {}  # name -> the task starting it
        self.bundled_version: dict[int, int] = {}  # id(service) -> the version that serves the bundled weights
        self.closing: list[asyncio.Task] = []  # fleets closing in the background

    def _start(self, name: str, request) -> asyncio.Task:
        if name not in self.starting:
            self.starting[name] = asyncio.ensure_future(STARTERS[name](request)())
        return self.starting[name]

    async def _ready(self, name: str) -> None:
        if name not in self.live:
            self.live[name] = await self.starting[name]

    async def acquire(self, name: str, request):
        """The fleet `name` for `request`'s module: the module's fleets are
        started together if they are not live; then the fleets of the next
        module on others start in the background."""
        for other in [n for n in self.live if not _used_from(request, n)]:
            await self.release(other)
        if name not in self.live:
            module = _fleets_of_module(request)
            for n in sorted(module, key=FLEETS.index):
                self._start(n, request)
            await asyncio.gather(*(self._ready(n) for n in module if n in self.starting))
            self.prestart_next(request)
        return self.live[name][0]

    def prestart_next(self, request) -> None:
        """Start, in the background, the fleets of the next module that uses
        one not started yet (nothing when it needs one that cannot be)."""
        items = request.session.items
        for item in items[_last_index(request) + 1:]:
            if {f for f in getattr(item, "fixturenames", ()) if f in FLEETS} - set(self.starting):
                for n in sorted(_fleets_of_module_of(item, items) - set(self.starting), key=FLEETS.index):
                    if n in PRESTART and PRESTART[n](request):
                        self._start(n, request)
                return

    async def done(self, name: str, request) -> None:
        """Close `name` when no test after `request`'s module uses it."""
        after = request.session.items[_last_index(request) + 1:]
        if name in self.live and not any(name in getattr(item, "fixturenames", ()) for item in after):
            await self.release(name)

    async def release(self, name: str) -> None:
        """Close `name`: in the background (engines take seconds to exit),
        but for the Ray fleet, which must be gone before its cluster."""
        _, close = self.live.pop(name)
        del self.starting[name]
        if name == "ray_vllm_service":
            await close()
        else:
            self.closing.append(asyncio.ensure_future(close()))

    async def close(self) -> None:
        for name, task in list(self.starting.items()):
            if name not in self.live:
                try:
                    self.live[name] = await task
                except Exception:
                    del self.starting[name]
        for name in list(self.live):
            await self.release(name)
        await asyncio.gather(*self.closing)


def _module(node) -> str:
    return node.nodeid.split("::")[0]


def _last_index(request) -> int:
    """The index in the session's items of the last test of `request`'s
    module (-1 for a session-scoped request)."""
    if request.node is request.session:
        return -1
    module = _module(request.node)
    return max(i for i, item in enumerate(request.session.items) if _module(item) == module)


def _fleets_of_module_of(item, items) -> set[str]:
    module = _module(item)
    return {f for other in items if _module(other) == module for f in getattr(other, "fixturenames", ()) if f in FLEETS}


def _fleets_of_module(request) -> set[str]:
    module = _module(request.node)
    return {f for item in request.session.items if _module(item) == module
            for f in getattr(item, "fixturenames", ()) if f in FLEETS}


def _used_from(request, name: str) -> bool:
    """Whether a test of `request`'s module, or of a later one, uses `name`."""
    module = _module(request.node)
    items = request.session.items
    first = min(i for i, item in enumerate(items) if _module(item) == module)
    return any(name in getattr(item, "fixturenames", ()) for item in items[first:])


def _import_for_fleets() -> None:
    """What a fleet's start-up imports in its thread, imported here first:
    two threads importing transformers or vLLM for the first time at once
    can see each other's modules half-initialized."""
    pytest.importorskip("vllm")
    import importlib

    import transformers

    for module in ("vllm.engine.arg_utils", "vllm.v1.engine.async_llm"):
        importlib.import_module(module)

    from rollout_service.factory import load_tokenizer, model_info

    load_tokenizer(model_info(_vllm_service_config().engine))
    transformers.AutoConfig.from_pretrained(vllm_model())


@pytest.fixture(scope="session")
async def fleets(request):
    """The session's `Fleets`; the first fleet starts in the background at
    once, while the modules without a fleet run."""
    _import_for_fleets()
    registry = Fleets()
    registry.prestart_next(request)
    await asyncio.sleep(0)  # the start-up tasks begin
    yield registry
    await registry.close()


@pytest.fixture(scope="session", autouse=True)
def _fleets_ahead(request):
    """Sets `fleets` up with the session when a selected test uses a fleet."""
    if any(f in FLEETS for item in request.session.items for f in getattr(item, "fixturenames", ())):
        request.getfixturevalue("fleets")


async def _on_bundled_weights(fleets: Fleets, service) -> None:
    """Every engine ready (one a module before killed has come back) and
    serving the bundled weights (pushed as the next version when a module
    before pushed others)."""
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
    service = await fleets.acquire("vllm_service", request)
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
    yield await fleets.acquire("spec_service", request)
    await fleets.done("spec_service", request)


@pytest.fixture(scope="session")
def head_dir(request) -> str:
    """An EAGLE head built for the bundled reasoner by `rollout-service
    build-eagle` (a short build: 64 responses, 200 steps at draft depths 1-3),
    started in the background when the session's tests are known."""
    build = request.config.stash.get(_EAGLE_BUILD, None) or _start_eagle_build(request.config)
    proc, out = build
    assert proc.wait(timeout=1200) == 0, (out.parent / f"{out.name}.log").read_text()[-3000:]
    summary = json.loads((out / "eagle.json").read_text())
    assert summary["held_out_acceptance"]["greedy"] > 0.3, summary  # the build learnt something
    # The report by response position: responses of at most 120 tokens all fall in the first range, and no
    # greedy draft is accepted more often than the policy's own argmax would be.
    by_position = summary["held_out_acceptance"]["greedy_by_position"]
    assert by_position["0-150"]["tokens"] > 100 and not any(v["tokens"] for k, v in by_position.items() if k != "0-150")
    assert 0.3 < by_position["0-150"]["head"] <= by_position["0-150"]["policy_ceiling"] <= 1.0 + 1e-6
    return str(out)


_EAGLE_BUILD = pytest.StashKey[tuple]()


def _start_eagle_build(config) -> tuple:
    out = Path(tempfile.mkdtemp(prefix="eagle-head-"))
    with open(out.parent / f"{out.name}.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollout_service.cli", "build-eagle", "--out", str(out), "--target", vllm_model(),
             "--samples", "64", "--held-out", "16", "--max-tokens", "120", "--steps", "200", "--depth", "3",
             "--threads", "1"],
            stdout=log, stderr=subprocess.STDOUT)
    config.stash[_EAGLE_BUILD] = (proc, out)
    return proc, out


def _eagle_built(config) -> bool:
    build = config.stash.get(_EAGLE_BUILD, None)
    return build is not None and build[0].poll() == 0


def pytest_collection_finish(session):
    """The EAGLE head (one core for about a minute) builds while the tests
    before the first that needs it run."""
    if any("head_dir" in getattr(item, "fixturenames", ()) for item in session.items):
        _start_eagle_build(session.config)


def pytest_sessionfinish(session):
    build = session.config.stash.get(_EAGLE_BUILD, None)
    if build is not None:
        proc, out = build
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        shutil.rmtree(out, ignore_errors=True)
        (out.parent / f"{out.name}.log").unlink(missing_ok=True)


@pytest.fixture(scope="module")
async def eagle_service(fleets, request, head_dir):
    """1 real vLLM engine that speculates with the EAGLE head of `head_dir`."""
    pytest.importorskip("vllm")
    yield await fleets.acquire("eagle_service", request)
    await fleets.done("eagle_service", request)


@pytest.fixture(scope="module")
async def plain_engine(fleets, request):
    """1 real vLLM engine without speculation (the reference of the
    speculative engines; prefix caching on), on the second core."""
    pytest.importorskip("vllm")
    yield await fleets.acquire("plain_engine", request)
    await fleets.done("plain_engine", request)


@pytest.fixture(scope="module")
async def sampled_drafts_engine(fleets, request):
    """1 engine whose drafts are sampled from the drafter (not argmax)."""
    pytest.importorskip("vllm")
    yield await fleets.acquire("sampled_drafts_engine", request)
    await fleets.done("sampled_drafts_engine", request)


@pytest.fixture(scope="module")
async def stock_engine(fleets, request):
    """1 speculating engine on vLLM's stock CPU rejection sampler
    (ROLLOUT_STOCK_SPEC_SAMPLER=1 in its processes, its refusal to run
    without the fix waived): the negative control of exactness."""
    pytest.importorskip("vllm")
    yield await fleets.acquire("stock_engine", request)
    await fleets.done("stock_engine", request)


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


def _ray_vllm_config(cluster) -> ServiceConfig:
    cfg = ray_config(cluster, kind="vllm", num_engines=2, model=vllm_model(), max_model_len=1024, max_seqs=32)
    # Paused and resumed across a push: every token's context is computed by
    # the weights its tag names, so a recomputation is exact.
    # (Under `continue`, tokens after a push attend to KV the old weights computed.)
    cfg.carry_over.mode = "pause-resume"
    return cfg


@pytest.fixture(scope="module")
async def ray_vllm_service(fleets, request, ray_cluster):
    """2 real vLLM engines as Ray actors, one on each node of `ray_cluster`
    (up to 32 sequences each); unfinished work is paused and re-prefilled
    across a push (carry-over `pause-resume`)."""
    pytest.importorskip("vllm")
    yield await fleets.acquire("ray_vllm_service", request)
    await fleets.done("ray_vllm_service", request)
