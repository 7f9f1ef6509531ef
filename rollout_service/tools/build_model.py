"""Build a *padded* copy of the bundled target: function-identical, costlier.

The bundled tiny reasoner (4 layers, 128 hidden, 512 intermediate, ~1M
parameters) is all per-step overhead on a CPU, so speculation and the long
tail behave unlike on a GPU.  A padded copy computes exactly the same
function at the cost of a larger model:

- every MLP is widened with extra gate/up rows (random, fixed seed) whose
  down-projection columns are zero, so ``down(silu(gate x) * up x)`` is
  unchanged;
- layers are appended after the bundled ones, each with a zero attention
  output projection (``o_proj``, which has no bias in Qwen2) and a zero MLP
  down projection, so both residual additions add exactly 0 and the residual
  stream reaching the final norm is the bundled model's.  Their q/k/v weights
  and biases and gate/up rows are random (fixed seed), their norms are ones:
  they cost what a real layer costs.

Vocabulary and hidden size are unchanged, so the bundled drafter serves the
padded target as it is. The same padding applied to the bundled drafter
(`--source draft`, preset `drafter`) gives a drafter that drafts exactly as
the bundled one at first, with room for the online trainer to learn more.
Pure torch + safetensors + json; deterministic (the same arguments give a
byte-identical ``model.safetensors``).

    rollout-service build-model --preset tail --out /tmp/tail
    rollout-service build-model --layers 6 --intermediate 1024 --out /tmp/small
    rollout-service build-model --preset drafter --out /tmp/drafter
"""
from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rollout_service.assets import tiny_draft_path, tiny_model_path


@dataclass(frozen=True)
class Preset:
    layers: int
    intermediate: int
    purpose: str
    source: str = "target"  # which bundled model is padded: "target" or "draft"


PRESETS: dict[str, Preset] = {
    # 101M parameters (404 MB float32). ARCHITECTURE.md measured it on one core
    # with vLLM CPU: 37.6 ms/step at batch 1 (~8x the bundled model, >10x a
    # draft step; streaming 404 MB per step, i.e. memory-bound) and 433 ms at
    # batch 64 (~5.5x the tokens/s of batch 1).
    "tail": Preset(8, 32_768, "long-tail/speculation target: batch-1 step memory-bound and >=10x a draft step, "
                              "large batches still pay"),
    # 505M parameters, 2.02 GB float32. Two vLLM CPU engines (a copy each plus
    # ~1 GiB KV cache and ~1 GB process overhead), the trainer's copy and two
    # staging copies (the service's received payload and a /dev/shm file) come
    # to ~5 x 2.0 GB + ~4 GB = ~14 GB, inside 20 GiB of a 24 GiB machine;
    # a 1B copy (4 GB) would need ~24 GB.
    "size": Preset(32, 40_960, "weight-transfer measurements: ~0.5B params (2 GB float32), the largest that "
                               "2 vLLM CPU engines + a trainer copy + staging fit in ~20 GiB"),
    # 0.44M parameters: the bundled one-layer drafter plus one layer that adds
    # nothing until the online trainer teaches it. It drafts exactly as the
    # bundled one at first and follows a drifting policy further
    # (docs/results.md#speculative-decoding).
    "drafter": Preset(2, 384, "the online drafter: the bundled drafter plus a layer for the trainer to fill",
                      source="draft"),
}

SOURCES: dict[str, Callable[[], Path]] = {"target": tiny_model_path, "draft": tiny_draft_path}
SEED = 0
WEIGHTS_FILE = "model.safetensors"
# Files copied unchanged from the source directory (the tokenizer and the generation config).
_COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
           "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")


def source_dir(source: str | Path | None = None, preset: str | None = None) -> Path:
    """The directory to pad: "target" (the bundled reasoner), "draft" (the
    bundled drafter) or a model directory; by default the preset's source."""
    if source is None:
        source = PRESETS[preset].source if preset in PRESETS else "target"
    if isinstance(source, str) and source in SOURCES:
        return SOURCES[source]()
    path = Path(source)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"--source {source}: not 'target', 'draft' or a model directory with a config.json")
    return path


def resolve(preset: str | None = None, layers: int | None = None, intermediate: int | None = None,
            source: str | Path | None = None) -> tuple[int, int]:
    """(layers, intermediate) for a preset and/or overrides; the source's own sizes fill the rest."""
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from: {', '.join(PRESETS)}")
    if preset is None and layers is None and intermediate is None:
        raise ValueError(f"give --preset ({', '.join(PRESETS)}) or --layers/--intermediate")
    config = json.loads((source_dir(source, preset) / "config.json").read_text())
    base = PRESETS[preset] if preset else Preset(config["num_hidden_layers"], config["intermediate_size"], "")
    n = base.layers if layers is None else layers
    m = base.intermediate if intermediate is None else intermediate
    if n < config["num_hidden_layers"]:
        raise ValueError(f"--layers {n} is below the source model's {config['num_hidden_layers']}")
    if m < config["intermediate_size"]:
        raise ValueError(f"--intermediate {m} is below the source model's {config['intermediate_size']}")
    return n, m


def padded_state_dict(source: dict, config: dict, layers: int, intermediate: int, seed: int = SEED) -> dict:
    """The padded tensors (float32, in a fixed order) from the source's tensors and config."""
    import torch

    if config.get("model_type") not in ("qwen2", None):
        raise ValueError(f"only Qwen2-style models can be padded, not {config.get('model_type')!r}")
    n0, m0 = config["num_hidden_layers"], config["intermediate_size"]
    hidden = config["hidden_size"]
    std = float(config.get("initializer_range", 0.02))
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    out: dict[str, torch.Tensor] = {}
    for name in sorted(source):
        if not name.startswith("model.layers."):
            out[name] = source[name].to(torch.float32).contiguous()
    for i in range(layers):
        p = f"model.layers.{i}."
        if i < n0:
            src = {k[len(p):]: v.to(torch.float32) for k, v in source.items() if k.startswith(p)}
            layer = dict(src)
            extra = intermediate - m0
            if extra:
                layer["mlp.gate_proj.weight"] = torch.cat([src["mlp.gate_proj.weight"], randn(extra, hidden)])
                layer["mlp.up_proj.weight"] = torch.cat([src["mlp.up_proj.weight"], randn(extra, hidden)])
                layer["mlp.down_proj.weight"] = torch.cat(
                    [src["mlp.down_proj.weight"], torch.zeros(hidden, extra)], dim=1)
        else:
            # Shapes (and which tensors exist, e.g. the q/k/v biases) follow layer 0.
            shapes = {k[len("model.layers.0."):]: tuple(v.shape) for k, v in source.items()
                      if k.startswith("model.layers.0.")}
            layer = {}
            for k, shape in sorted(shapes.items()):
                if k.endswith("layernorm.weight"):
                    layer[k] = torch.ones(shape)
                elif k == "self_attn.o_proj.weight":
                    layer[k] = torch.zeros(shape)  # the attention adds nothing to the residual
                elif k == "self_attn.o_proj.bias":
                    layer[k] = torch.zeros(shape)
                elif k == "mlp.down_proj.weight":
                    layer[k] = torch.zeros(hidden, intermediate)  # nor does the MLP
                elif k in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
                    layer[k] = randn(intermediate, hidden)
                else:
                    layer[k] = randn(*shape)
        for k in sorted(layer):
            out[p + k] = layer[k].contiguous()
    return out


def padded_config(config: dict, layers: int, intermediate: int) -> dict:
    out = dict(config)
    out["num_hidden_layers"] = layers
    out["intermediate_size"] = intermediate
    types = config.get("layer_types")
    if types is not None:
        out["layer_types"] = list(types) + [types[-1]] * (layers - len(types))
    out["dtype"] = "float32"
    if "torch_dtype" in out:
        out["torch_dtype"] = "float32"
    return out


def build(out: str | Path, preset: str | None = None, layers: int | None = None, intermediate: int | None = None,
          seed: int = SEED, source: str | Path | None = None,
          log: Callable[[str], None] | None = print) -> dict:
    """Write a padded copy of `source` ("target", "draft" or a directory; default: the preset's, else the
    bundled tiny reasoner) into `out`; returns a summary."""
    import torch
    from safetensors.torch import load_file, save_file

    say = log or (lambda _msg: None)
    src_dir = source_dir(source, preset)
    n, m = resolve(preset, layers, intermediate, src_dir)
    t0 = time.perf_counter()
    config = json.loads((src_dir / "config.json").read_text())
    say(f"padding {src_dir.name}: {config['num_hidden_layers']} -> {n} layers, "
        f"intermediate {config['intermediate_size']} -> {m}" + (f" (preset {preset})" if preset else ""))
    tensors = padded_state_dict(load_file(str(src_dir / WEIGHTS_FILE)), config, n, m, seed)
    params = sum(t.numel() for t in tensors.values())
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    say(f"  {len(tensors)} tensors, {params:,} parameters built in {time.perf_counter() - t0:.1f} s; writing ...")

    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.chmod(0o644)  # the writer creates it owner-only; engines may run as another user
    tmp.replace(out_dir / WEIGHTS_FILE)
    del tensors
    (out_dir / "config.json").write_text(json.dumps(padded_config(config, n, m), indent=2) + "\n")
    copied = []
    for name in _COPIED:
        if (src_dir / name).is_file():
            shutil.copyfile(src_dir / name, out_dir / name)
            copied.append(name)
    summary = {"source": src_dir.name, "preset": preset, "layers": n, "intermediate_size": m,
               "hidden_size": config["hidden_size"], "vocab_size": config["vocab_size"], "seed": seed,
               "parameters": params, "bytes": nbytes, "torch": torch.__version__}
    (out_dir / "padding.json").write_text(json.dumps(summary, indent=2) + "\n")
    say(f"  wrote {out_dir} ({WEIGHTS_FILE}, config.json, {', '.join(copied)}) in {time.perf_counter() - t0:.1f} s")
    say(f"parameters {params:,}  bytes {nbytes:,} ({nbytes / 2**30:.2f} GiB float32)")
    return summary


__all__ = ["PRESETS", "SOURCES", "Preset", "build", "padded_config", "padded_state_dict", "resolve", "source_dir"]
