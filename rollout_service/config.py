"""One typed configuration object: defaults < TOML file < command-line flags.

    [service]            grpc_port, http_port, host, placement, limits
    [engine]             kind, num_engines, model, max_seqs, ...
    [engine.sim]         SimParams fields (simulated engines)
    [engine.vllm_args]   extra keyword arguments for vLLM's engine
    [engine.spec]        speculative decoding (rollout_service.engines.spec_config.SpecConfig)
    [engine.ray]         the fleet on a Ray cluster (with engine.placement_backend = "ray")
    [engine.process]     engines in host processes of this machine (placement_backend = "process")
    [environments.NAME]  what multi-turn trajectories' tool calls go to (rollout_service.environments)

Any field can be set from the command line with `--set engine.num_engines=4`.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import socket
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_service.engines.spec_config import SpecConfig
from rollout_service.environments import check_environments
from rollout_service.partial.carry_over import CarryOverConfig
from rollout_service.scheduling.rebalancer import RebalanceConfig

PLACEMENT_BACKENDS = ("auto", "local", "process", "ray")  # engine.placement_backend: where the engines run
COLLECTIVE_RECEIVE = ("staged", "direct")  # engine.collective_receive: how a gloo engine receives a collective push


@dataclass(slots=True)
class RayConfig:
    """Engines as Ray actors (rollout_service.engines.ray_fleet)."""

    address: str = "auto"  # "auto": the cluster this node belongs to; "local": start Ray here; or "host:port"
    strategy: str = "SPREAD"  # placement-group strategy: SPREAD, PACK, STRICT_SPREAD, STRICT_PACK
    cpus_per_engine: float = 1.0  # CPU of each engine's bundle
    gpus_per_engine: float = 0.0  # whole GPUs of each engine's bundle: its tensor-parallel size
    engines_per_actor: int = 1  # engines hosted by one actor process (>1 only for CPU or simulated fleets)
    object_store_gb: float = 0.0  # object store of a Ray started here ("local"); 0 = Ray's default
    heartbeat_s: float = 0.25  # an idle actor reports its engines' load this often


@dataclass(slots=True)
class ProcessConfig:
    """Engines in host processes of this machine (rollout_service.engines.proc_fleet)."""

    # Engines (and their output processing) per host process; 0: one vLLM
    # engine a host (its front end a process of its own), 8 simulated ones.
    engines_per_host: int = 0
    heartbeat_s: float = 0.25  # an idle host reports its engines' load this often
    batch_ms: float = 0.0  # a host's news waits at most this long for more to join its batch
    nice: int = 0  # hosts' niceness above the server's (0-19): with fewer cores than hosts, the server goes first


@dataclass(slots=True)
class EngineConfig:
    kind: str = "vllm"  # "vllm" (real engines, CPU or GPU) or "sim" (cost-model engines)
    num_engines: int = 2
    model: str = ""  # a model directory; "" means the bundled tiny reasoner
    max_seqs: int = 0  # running batch cap per engine (sequences); 0: 64 on a CPU or simulated, 256 on GPUs
    max_model_len: int = 0  # tokens; 0 means the model's own limit
    kv_cache_gib: float = 1.0  # KV cache per vLLM engine on the CPU platform (GiB); GPUs size it by utilization
    # GPUs (rollout_service/device_plan.py): each local engine gets its own
    # tensor_parallel_size of `devices` ("auto": the visible GPUs in order).
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9  # share of each of its GPUs' memory an engine takes
    devices: Any = "auto"  # "auto", or GPU ids as a list ([0, 1, 2, 3]) or a string ("0,1,2,3")
    sim: dict[str, Any] = field(default_factory=dict)
    vllm_args: dict[str, Any] = field(default_factory=dict)
    # Speculative decoding (method off | draft_model | eagle | ngram | siblings;
    # "tune"/"train" switch on the depth tuner and the online drafter trainer).
    spec: SpecConfig = field(default_factory=SpecConfig)
    # "local": engines run in this process; "process": in host processes of
    # this machine, their output processing off the server's event loop
    # ([engine.process]); "ray": each engine runs in a Ray actor placed
    # across the cluster's nodes ([engine.ray]); "auto": "process" for vLLM
    # engines on GPUs (each front end costs a share of a core at GPU rates),
    # "local" otherwise (device_plan.resolve_backend).
    placement_backend: str = "auto"
    # How a vLLM CPU (gloo) engine receives a collective push: "staged" on a
    # worker thread while it generates, pausing only to load the weights (a
    # second copy of them per engine during the push); "direct" into the
    # model as the bytes arrive (no second copy; generation waits for the
    # transfer). GPU (nccl) engines always receive directly.
    collective_receive: str = "staged"  # one of COLLECTIVE_RECEIVE
    ray: RayConfig = field(default_factory=RayConfig)
    process: ProcessConfig = field(default_factory=ProcessConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.spec, SpecConfig):  # a table given whole, e.g. EngineConfig(spec={...})
            self.spec = SpecConfig.from_dict(self.spec)
        if isinstance(self.ray, dict):
            self.ray = RayConfig(**self.ray)
        if isinstance(self.process, dict):
            self.process = ProcessConfig(**self.process)


@dataclass(slots=True)
class AuthConfig:
    # Bearer tokens; none configured means no authentication. Also read from
    # the environment (comma-separated): ROLLOUT_SUBMIT_TOKENS, ROLLOUT_WEIGHTS_TOKENS.
    submit_tokens: list[str] = field(default_factory=list)
    weights_tokens: list[str] = field(default_factory=list)
    # Serve on an address other than loopback without tokens (refused otherwise; `--insecure-no-auth`).
    insecure_no_auth: bool = False


@dataclass(slots=True)
class TlsConfig:
    cert_file: str = ""  # PEM; both set means gRPC and HTTP serve TLS
    key_file: str = ""


@dataclass(slots=True)
class ServiceConfig:
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int = 8000
    placement: str = "least-assigned"
    session_affinity: bool = True  # a trajectory's next turn goes to the engine holding its prefix
    max_message_mb: int = 64  # largest gRPC message accepted (MiB)
    max_weights_gb: float = 16.0  # largest weight push (GiB)
    max_queued_samples: int = 1_000_000
    max_groups_per_submit: int = 4096
    consumer_ttl_s: float = 3600.0
    max_unacked_samples: int = 65_536  # samples streamed to one consumer and not acknowledged
    unacked_wait_s: float = 60.0  # a stream held at max_unacked_samples waits this long for an ack
    observation_timeout_s: float = 3600.0  # a trajectory waiting this long for an observation ends
    keepalive_s: float = 30.0  # gRPC: ping an idle connection this often...
    keepalive_timeout_s: float = 20.0  # ...and close it when a ping is not answered within this
    push_idle_timeout_s: float = 30.0  # a weight push silent this long (or a pushed file unread) is abandoned
    # Directories file pushes (push_weights_file) may read; none: file pushes refused.
    weights_file_dirs: list[str] = field(default_factory=list)
    http_request_timeout_s: float = 1800.0  # an OpenAI/vLLM HTTP request running longer is aborted
    state_dir: str = ""  # the journal and the last pushed weights, kept across restarts ("" = nothing kept)
    journal_commit_ms: float = 2.0  # group commit: the journal writes (O_DSYNC) at most this often (milliseconds)
    staging_dir: str = ""  # where pushed weights are staged ("" = /dev/shm, else the temporary directory)
    log_level: str = "INFO"
    engine: EngineConfig = field(default_factory=EngineConfig)
    carry_over: CarryOverConfig = field(default_factory=CarryOverConfig)
    rebalance: RebalanceConfig = field(default_factory=RebalanceConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    # name -> {entry_point = "module:function"} or {url = "http://..."}, optional timeout_s
    environments: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """The configuration as JSON, secrets redacted (for start-up logs)."""
        d = self.to_dict()
        for key in ("submit_tokens", "weights_tokens"):
            d["auth"][key] = [f"<{len(d['auth'][key])} redacted>"] if d["auth"][key] else []
        return json.dumps(d, indent=2, sort_keys=True)


def is_loopback(host: str) -> bool:
    """Does `host` name only loopback addresses (127.0.0.0/8, ::1)?"""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None) if host else []
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def check_exposure(cfg: ServiceConfig) -> None:
    """Closed by default: ValueError when the service would serve an address
    other than loopback without any token, unless `auth.insecure_no_auth`."""
    if cfg.auth.submit_tokens or cfg.auth.weights_tokens or cfg.auth.insecure_no_auth or is_loopback(cfg.host):
        return
    raise ValueError(
        f"refusing to serve on host {cfg.host!r} without authentication: set auth.submit_tokens and/or "
        "auth.weights_tokens (or ROLLOUT_SUBMIT_TOKENS / ROLLOUT_WEIGHTS_TOKENS), or pass --insecure-no-auth "
        "(auth.insecure_no_auth = true) to serve without tokens anyway")


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def set_field(cfg: ServiceConfig, dotted: str, value: Any) -> None:
    """Set `engine.num_engines`-style keys; unknown keys are an error."""
    parts = dotted.split(".")
    target: Any = cfg
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(target, dict):
            if last:
                target[part] = value
                return
            target = target.setdefault(part, {})
            continue
        names = {f.name for f in dataclasses.fields(target)}
        if part not in names:
            raise ValueError(f"unknown configuration key {dotted!r} ({part!r} is not one of {sorted(names)})")
        if last:
            current = getattr(target, part)
            if isinstance(current, bool):
                value = value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
            elif isinstance(current, list) and isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            elif isinstance(current, (int, float)) and not isinstance(value, (int, float)):
                raise ValueError(f"{dotted} must be a number, got {value!r}")
            elif isinstance(current, float):
                value = float(value)
            setattr(target, part, value)
            return
        target = getattr(target, part)


def _merge(cfg: ServiceConfig, prefix: str, table: dict[str, Any]) -> None:
    for key, value in table.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and key not in ("sim", "vllm_args"):
            _merge(cfg, f"{dotted}.", value)
        else:
            set_field(cfg, dotted, value)


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> ServiceConfig:
    cfg = ServiceConfig()
    if path:
        data = tomllib.loads(Path(path).read_text())
        _merge(cfg, "", data.pop("service", {}))
        _merge(cfg, "", data)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set expects key=value, got {item!r}")
        key, text = item.split("=", 1)
        set_field(cfg, key.strip(), _parse_value(text.strip()))
    for env, key in (("ROLLOUT_SUBMIT_TOKENS", "auth.submit_tokens"), ("ROLLOUT_WEIGHTS_TOKENS", "auth.weights_tokens")):
        if os.environ.get(env):
            set_field(cfg, key, os.environ[env])
    if not 0 <= cfg.journal_commit_ms <= 1000:
        raise ValueError(f"journal_commit_ms must be in [0, 1000] milliseconds, got {cfg.journal_commit_ms}")
    cfg.carry_over.validate()
    cfg.engine.spec.validate()
    check_environments(cfg.environments)
    return cfg
