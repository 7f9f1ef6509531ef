"""The device plan on machines described rather than present (the platform
mocked as CUDA with 1, 2, 4 and 8 GPUs): each engine's GPUs, environment
and vLLM arguments, refusals naming the keys, Ray bundles and tensor
parallelism, the memory budget, and the speculation depths kept to the
captured CUDA graphs. Nothing here starts an engine or needs a GPU."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from rollout_service.cli import main
from rollout_service.config import EngineConfig
from rollout_service.device_plan import Platform, PlanError, plan_fleet
from rollout_service.drafter.spec_tuner import DepthTuner, TunerConfig
from rollout_service.engines.spec_config import SpecConfig, dense_lookup, graph_depths, normalize_schedule
from rollout_service.engines.spec_monitor import StepObservation
from rollout_service.factory import engine_factories, fleet_plan, model_info

from helpers import sim_config, running


def _plan(gpus: int, memory_gib: float = 0.0, **engine):
    cfg = EngineConfig(**engine)
    info = model_info(cfg)
    return plan_fleet(cfg, Platform.mocked("cuda", gpus, memory_gib), info.path, info.max_model_len)


def _cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_engines_get_disjoint_gpu_slices_or_the_plan_is_refused_naming_the_keys(gpus, tp):
    for engines in range(1, gpus + 2):
        if engines * tp > gpus:
            with pytest.raises(PlanError) as err:
                _plan(gpus, num_engines=engines, tensor_parallel_size=tp)
            msg = str(err.value)
            assert "engine.num_engines" in msg and "engine.tensor_parallel_size" in msg
            assert f"{gpus} available" in msg
            continue
        plan = _plan(gpus, num_engines=engines, tensor_parallel_size=tp)
        slices = [e.devices for e in plan.engines]
        assert all(len(s) == tp for s in slices)
        used = [d for s in slices for d in s]
        assert len(used) == len(set(used)) == engines * tp  # no GPU shared
        for e in plan.engines:
            assert e.env["CUDA_VISIBLE_DEVICES"] == ",".join(e.devices)
            assert e.vllm_args["enforce_eager"] is False  # CUDA graphs on
            assert e.vllm_args.get("tensor_parallel_size", 1) == tp


def test_plan_command_shows_four_tp2_engines_on_eight_gpus_with_cuda_graphs(capsys):
    rc, out, _ = _cli(capsys, "--platform", "cuda", "--gpus", "8", "--json",
                      "--set", "engine.num_engines=4", "--set", "engine.tensor_parallel_size=2")
    assert rc == 0
    plan = json.loads(out)
    assert plan["platform"] == "cuda"
    assert [e["devices"] for e in plan["engines"]] == [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]
    for e in plan["engines"]:
        args = e["vllm_args"]
        assert e["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(e["devices"])
        assert args["enforce_eager"] is False and args["tensor_parallel_size"] == 2
        assert args["distributed_executor_backend"] == "mp" and args["max_num_seqs"] == 256
        assert args["weight_transfer_config"] == {"backend": "nccl"} and args["dtype"] == "auto"
        assert {"id", "devices", "env", "vllm_args", "memory"} <= set(e)


def test_plan_command_refuses_five_tp2_engines_on_eight_gpus_naming_both_keys(capsys):
    rc, out, err = _cli(capsys, "--platform", "cuda", "--gpus", "8", "--json",
                        "--set", "engine.num_engines=5", "--set", "engine.tensor_parallel_size=2")
    assert rc != 0
    assert "engine.num_engines = 5" in err and "engine.tensor_parallel_size = 2" in err and "needs 10 GPUs" in err
    assert json.loads(out)["refused"] in err


def test_ray_gpus_per_engine_is_the_tensor_parallel_size(capsys):
    rc, out, _ = _cli(capsys, "--ray", "--json", "--set", "engine.ray.gpus_per_engine=2",
                      "--set", "engine.num_engines=3")
    assert rc == 0
    plan = json.loads(out)
    assert plan["platform"] == "cuda" and plan["placement_backend"] == "ray"
    for e in plan["engines"]:
        assert e["ray_bundle"] == {"CPU": 1.0, "GPU": 2.0}
        assert e["devices"] == [] and "CUDA_VISIBLE_DEVICES" not in e["env"]  # Ray gives the actor its GPUs
        # vLLM's multiprocessing executor over the actor's own GPUs, never its Ray executor.
        assert e["vllm_args"]["tensor_parallel_size"] == 2
        assert e["vllm_args"]["distributed_executor_backend"] == "mp"
        assert e["vllm_args"]["enforce_eager"] is False


@pytest.mark.parametrize("sets, keys", [
    (["engine.ray.gpus_per_engine=0.5"], ["engine.ray.gpus_per_engine"]),
    (["engine.ray.gpus_per_engine=1", "engine.ray.engines_per_actor=2"],
     ["engine.ray.engines_per_actor", "engine.ray.gpus_per_engine"]),
    (["engine.ray.gpus_per_engine=2", "engine.tensor_parallel_size=4"],
     ["engine.tensor_parallel_size", "engine.ray.gpus_per_engine"]),
])
def test_ray_plans_that_share_gpus_are_refused_naming_the_keys(capsys, sets, keys):
    rc, _, err = _cli(capsys, "--ray", *[a for s in sets for a in ("--set", s)])
    assert rc == 2 and all(k in err for k in keys), err


def test_ray_engines_on_a_gpu_platform_need_gpus(capsys):
    rc, _, err = _cli(capsys, "--ray", "--platform", "cuda")
    assert rc == 2 and "engine.ray.gpus_per_engine is 0" in err


def test_explicit_devices_are_used_in_order_and_a_shared_or_invisible_one_is_refused():
    plan = _plan(8, num_engines=2, tensor_parallel_size=2, devices="6,7,2,3")
    assert [e.devices for e in plan.engines] == [["6", "7"], ["2", "3"]]
    assert _plan(4, num_engines=1, devices=[3]).engines[0].env["CUDA_VISIBLE_DEVICES"] == "3"
    with pytest.raises(PlanError, match="engine.devices lists GPU 1 twice"):
        _plan(4, num_engines=2, devices=[0, 1, 1])
    with pytest.raises(PlanError, match="engine.devices: GPU 9 is not visible"):
        _plan(4, num_engines=1, devices=[9])


def test_unused_gpus_and_kv_cache_gib_on_gpus_are_warned_about():
    plan = _plan(4, num_engines=1, kv_cache_gib=8.0)
    assert any("GPUs 1,2,3 unused" in w for w in plan.warnings)
    assert any("engine.kv_cache_gib applies on the CPU platform only" in w for w in plan.warnings)
    assert not _plan(1, num_engines=1).warnings


def test_the_cpu_platform_keeps_its_defaults_and_refuses_tensor_parallelism():
    cfg = EngineConfig(num_engines=2)
    info = model_info(cfg)
    plan = plan_fleet(cfg, Platform.mocked("cpu"), info.path, info.max_model_len)
    for e in plan.engines:
        assert e.devices == [] and e.vllm_args["enforce_eager"] is True and e.vllm_args["dtype"] == "float32"
        assert e.vllm_args["max_num_seqs"] == 64 and e.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
        assert "gpu_memory_utilization" not in e.vllm_args and e.vllm_args["weight_transfer_config"]["backend"] == "gloo"
    with pytest.raises(PlanError, match="engine.tensor_parallel_size > 1 needs GPUs"):
        plan_fleet(EngineConfig(tensor_parallel_size=2), Platform.mocked("cpu"), info.path, info.max_model_len)


@pytest.mark.parametrize("cores, engines, binds", [
    (2, 1, ["0"]), (2, 2, ["0", "1"]), (16, 1, [",".join(map(str, range(15)))]),
    (16, 3, ["0,1,2,3,4", "5,6,7,8,9", "10,11,12,13,14"])])
def test_cpu_engines_leave_a_core_to_the_server_when_there_are_more_cores_than_engines(
        capsys, monkeypatch, cores, engines, binds):
    # OpenMP threads spinning on every core stall whenever the server or an
    # engine's scheduler takes one: a lone engine on 2 cores decoded at half speed.
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    rc, out, _ = _cli(capsys, "--platform", "cpu", "--json", "--set", f"engine.num_engines={engines}")
    assert rc == 0
    assert [e["env"]["VLLM_CPU_OMP_THREADS_BIND"] for e in json.loads(out)["engines"]] == binds


def test_an_engine_built_from_the_plan_passes_vllm_exactly_the_planned_arguments():
    cfg = EngineConfig(num_engines=2, tensor_parallel_size=2, spec=SpecConfig(method="ngram"))
    info = model_info(cfg)
    plan = fleet_plan(cfg, info, Platform.mocked("cuda", 4))
    engines = [make() for _, make in engine_factories(cfg, info, plan)]  # built, not started
    for engine, planned in zip(engines, plan.engines):
        assert engine._engine_args() == planned.vllm_args
        assert engine._spawn_environment() == planned.env
        # On GPUs model-free drafting is vLLM's ngram_gpu, which keeps async scheduling.
        assert engine._engine_args()["speculative_config"]["method"] == "ngram_gpu"
        # The weight-transfer routes' group on GPUs is NCCL, as vLLM's engines are started with.
        assert engine._engine_args()["weight_transfer_config"] == {"backend": "nccl"}
        assert engine.transfer_backend() == "nccl"


def _write_model(tmp: Path, layers=2, hidden=64, heads=4, kv_heads=2, vocab=1000, dtype="bfloat16") -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": layers,
        "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab,
        "max_position_embeddings": 4096, "torch_dtype": dtype, "eos_token_id": 2}))
    header = {"embed.weight": {"dtype": "BF16", "shape": [vocab, hidden], "data_offsets": [0, vocab * hidden * 2]},
              "__metadata__": {"format": "pt"}}
    raw = json.dumps(header).encode()
    (tmp / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(vocab * hidden * 2))
    return tmp


def test_memory_budget_reads_weight_bytes_and_sizes_the_kv_cache(tmp_path):
    model = _write_model(tmp_path / "m")
    cfg = EngineConfig(num_engines=1, model=str(model), tensor_parallel_size=2, gpu_memory_utilization=0.5)
    info = model_info(cfg)
    mem = plan_fleet(cfg, Platform.mocked("cuda", 2, 1.0), info.path, info.max_model_len).engines[0].memory
    assert mem["parameters"] == 64_000
    assert mem["weight_bytes"] == 64_000 * 2 // 2  # bf16, split over 2 ranks
    # K and V, 2 layers, 1 of 2 KV heads per rank, head_dim 16, bf16.
    assert mem["kv_bytes_per_token"] == 2 * 2 * 1 * 16 * 2
    assert mem["kv_tokens"] == (2**30 // 2 - 64_000) // 128


def test_a_model_that_leaves_no_room_for_one_sequence_is_refused(tmp_path, capsys):
    model = _write_model(tmp_path / "m", vocab=100_000, hidden=1024)  # ~0.2 GB of weights
    rc, _, err = _cli(capsys, "--platform", "cuda", "--gpus", "1", "--gpu-memory-gib", "0.2",
                      "--set", "engine.num_engines=1", "--model", str(model))
    assert rc == 2
    assert "engine.gpu_memory_utilization" in err and "engine.max_model_len" in err and "4096" in err


def test_max_seqs_defaults_per_platform():
    info = model_info(EngineConfig())
    cuda = plan_fleet(EngineConfig(num_engines=1), Platform.mocked("cuda", 1), info.path, info.max_model_len)
    cpu = plan_fleet(EngineConfig(num_engines=1), Platform.mocked("cpu"), info.path, info.max_model_len)
    assert cuda.engines[0].vllm_args["max_num_seqs"] == 256 and cpu.engines[0].vllm_args["max_num_seqs"] == 64
    fixed = plan_fleet(EngineConfig(num_engines=1, max_seqs=32), Platform.mocked("cuda", 1), info.path, 1024)
    assert fixed.engines[0].vllm_args["max_num_seqs"] == 32


def test_graph_depths_follow_the_start_up_schedule():
    # Default schedule at 256 sequences, K <= 4: depth 4 up to batch 4, 2 up to 16, 0 for the rest.
    assert graph_depths([[1, 4, 4], [5, 16, 2], [17, 65536, 0]], 256, 4) == {4: 4, 2: 16, 0: 256}
    # Depth 4 at every batch: vLLM captures at most 512 tokens, 102 sequences of 5.
    assert graph_depths([[1, 256, 4]], 256, 4) == {4: 102}


def test_the_depth_tuner_chooses_only_captured_depths():
    schedule = normalize_schedule([[1, 4, 4], [5, 16, 2], [17, 65536, 0]], 256, 4)
    captured = graph_depths(schedule, 256, 4)
    tuner = DepthTuner(TunerConfig(epsilon=1.0, min_observations=1), 4, 256, schedule, captured)
    eager = DepthTuner(TunerConfig(epsilon=1.0, min_observations=1), 4, 256, schedule)
    assert set(eager.arms[3]) == {0, 1, 2, 3, 4}  # bucket 3-4 without graphs: every depth
    chosen: dict[int, set[int]] = {}
    for _ in range(200):
        tuner.observe([StepObservation(batch=b, k=k, seconds=0.01, tokens=b) for b in (1, 3, 6, 12, 20, 100)
                       for k in range(5)])
        for lo, hi, k in tuner.choose():
            chosen.setdefault(hi, set()).add(k)
            assert captured.get(k, 0) >= hi, f"K={k} for batches up to {hi} has no captured graph"
    assert chosen[1] == {0, 2, 4} and chosen[8] == {0, 2} and chosen[32] == {0}


def test_the_speculation_schedule_falling_off_the_captured_graphs_is_warned_about():
    spec = SpecConfig(method="ngram", schedule=[[1, 256, 4]])
    plan = _plan(1, num_engines=1, spec=spec)
    assert any("batches of 103-256 sequences decode at depth 4 beyond vLLM's captured CUDA graphs" in w
               for w in plan.warnings), plan.warnings
    assert dense_lookup(normalize_schedule(spec.schedule, 256, 4), 256)[200] == 4


async def test_serve_logs_the_plan_at_start(caplog):
    caplog.set_level("INFO", logger="rollout_service")
    async with running(sim_config(num_engines=3)):
        pass
    assert any("device plan: platform sim, 3 engines" in r.getMessage() for r in caplog.records)


def test_vllm_engines_on_gpus_run_their_front_ends_in_a_host_process_each_by_default(capsys):
    """vLLM's output processing costs ~50 us a token in the process running
    it: on GPUs the default (`placement_backend = "auto"`) gives each engine's
    front end a host process of its own, each engine still on its own GPU.
    Built, not started (no GPU here)."""
    from rollout_service.engines.proc_fleet import ProcessEngine
    from rollout_service.engines.vllm import VllmEngine
    from rollout_service.factory import make_engines

    cfg = EngineConfig(num_engines=4)
    assert cfg.placement_backend == "auto"
    info = model_info(cfg)
    plan = fleet_plan(cfg, info, Platform.mocked("cuda", 4))
    assert plan.placement_backend == "process"
    engines = make_engines(cfg, info, plan)
    assert all(isinstance(e, ProcessEngine) for e in engines)
    hosts = [e.host for e in engines]
    assert len({id(h) for h in hosts}) == 4  # one engine a host
    for i, (engine, host) in enumerate(zip(engines, hosts)):
        [(eid, make)] = host.factories.items()
        assert eid == engine.engine_id
        built = make()  # what the host builds: the planned engine on its own GPU
        assert built._spawn_environment()["CUDA_VISIBLE_DEVICES"] == str(i)
    assert "4 engines (process, front ends in host processes)" in plan.describe()

    # The number of engines a host can be set; an explicit backend is kept.
    cfg.process.engines_per_host = 2
    assert len({id(e.host) for e in make_engines(cfg, info, plan)}) == 2
    cfg.process.engines_per_host = -1
    with pytest.raises(ValueError, match=r"engine.process.engines_per_host must be >= 0 .*got -1"):
        make_engines(cfg, info, plan)
    local = EngineConfig(num_engines=4, placement_backend="local")
    plan = fleet_plan(local, info, Platform.mocked("cuda", 4))
    assert plan.placement_backend == "local"
    assert all(isinstance(e, VllmEngine) for e in make_engines(local, info, plan))

    # The plan command says where the front ends run.
    rc, out, _ = _cli(capsys, "--platform", "cuda", "--gpus", "2")
    assert rc == 0 and "2 engines (process, front ends in host processes)" in out, out


def test_on_a_cpu_and_simulated_the_default_keeps_engines_in_the_server_s_process():
    """On a CPU the engines' threads take the cores (a host process per
    engine was no faster here, 0.68-1.03x the tokens/s); simulated engines
    cost the server less than a host link."""
    from rollout_service.engines.vllm import VllmEngine
    from rollout_service.factory import make_engines

    cfg = EngineConfig(num_engines=2)
    info = model_info(cfg)
    plan = fleet_plan(cfg, info, Platform.mocked("cpu", 0))
    assert plan.placement_backend == "local"
    assert all(isinstance(e, VllmEngine) for e in make_engines(cfg, info, plan))
    sim = EngineConfig(kind="sim", num_engines=2)
    assert fleet_plan(sim, model_info(sim)).placement_backend == "local"
