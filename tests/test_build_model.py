"""`rollout-service build-model`: a padded copy of the bundled target computes the same logits."""
from __future__ import annotations

import json

import pytest
import torch

from rollout_service.assets import tiny_draft_path, tiny_model_path
from rollout_service.cli import main
from rollout_service.tools.build_model import PRESETS

EXTRA_LAYERS = 2


@pytest.fixture(scope="module")
def base_config() -> dict:
    return json.loads((tiny_model_path() / "config.json").read_text())


@pytest.fixture(scope="module")
def padded(tmp_path_factory, base_config):
    out = tmp_path_factory.mktemp("padded")
    layers, intermediate = base_config["num_hidden_layers"] + EXTRA_LAYERS, base_config["intermediate_size"] * 2
    assert main(["build-model", "--layers", str(layers), "--intermediate", str(intermediate), "--out", str(out)]) == 0
    return out


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def test_padded_copy_has_the_new_sizes_and_loads_with_its_tokenizer(padded, base_config):
    from transformers import AutoTokenizer

    cfg = json.loads((padded / "config.json").read_text())
    layers = base_config["num_hidden_layers"] + EXTRA_LAYERS
    assert cfg["num_hidden_layers"] == layers and len(cfg["layer_types"]) == layers
    assert cfg["intermediate_size"] == base_config["intermediate_size"] * 2
    assert (cfg["hidden_size"], cfg["vocab_size"]) == (base_config["hidden_size"], base_config["vocab_size"])
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (padded / name).read_bytes() == (tiny_model_path() / name).read_bytes()
    text = "12+7="
    assert AutoTokenizer.from_pretrained(str(padded))(text).input_ids == \
        AutoTokenizer.from_pretrained(str(tiny_model_path()))(text).input_ids
    model = _load(padded)
    assert len(model.model.layers) == layers
    assert model.model.layers[0].mlp.gate_proj.weight.shape[0] == cfg["intermediate_size"]
    summary = json.loads((padded / "padding.json").read_text())
    assert summary["parameters"] == sum(p.numel() for p in model.parameters())  # tied embeddings count once


def _assert_same_logits(base, pad, vocab: int) -> None:
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for length in (1, 5, 17, 64, 200):
            ids = torch.randint(3, vocab, (1, length), generator=gen)
            a, b = base(ids).logits, pad(ids).logits
            assert a.shape == b.shape == (1, length, vocab)
            assert (a - b).abs().max().item() <= 1e-5, length
        # A left-padded batch too (the attention mask reaches the padding layers).
        ids = torch.randint(3, vocab, (3, 40), generator=gen)
        mask = torch.ones_like(ids)
        mask[0, :25] = 0
        mask[1, :7] = 0
        a = base(ids, attention_mask=mask).logits[mask.bool()]
        b = pad(ids, attention_mask=mask).logits[mask.bool()]
        assert (a - b).abs().max().item() <= 1e-5


def test_padded_copy_gives_the_bundled_logits(padded, base_config):
    _assert_same_logits(_load(tiny_model_path()), _load(padded), base_config["vocab_size"])


def test_a_deeper_drafter_starts_as_the_bundled_drafter(tmp_path, base_config):
    out = tmp_path / "drafter"
    assert main(["build-model", "--source", "draft", "--layers", "3", "--intermediate", "512", "--out", str(out)]) == 0
    drafter = _load(out)
    assert len(drafter.model.layers) == 3 and drafter.model.layers[0].mlp.gate_proj.weight.shape[0] == 512
    _assert_same_logits(_load(tiny_draft_path()), drafter, base_config["vocab_size"])
    # The new layers are there to learn: their q/k/v and gate/up weights are not zero.
    assert drafter.model.layers[2].self_attn.q_proj.weight.abs().sum() > 0
    assert drafter.model.layers[2].mlp.gate_proj.weight.abs().sum() > 0


def test_an_unknown_source_is_a_clear_error(tmp_path, capsys):
    assert main(["build-model", "--source", str(tmp_path / "nowhere"), "--layers", "6", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "--source" in err and "nowhere" in err
    assert not (tmp_path / "x").exists()


def test_build_is_deterministic(padded, tmp_path, base_config):
    again = tmp_path / "again"
    layers, intermediate = base_config["num_hidden_layers"] + EXTRA_LAYERS, base_config["intermediate_size"] * 2
    assert main(["build-model", "--layers", str(layers), "--intermediate", str(intermediate), "--out", str(again)]) == 0
    assert (again / "model.safetensors").read_bytes() == (padded / "model.safetensors").read_bytes()
    assert (again / "config.json").read_bytes() == (padded / "config.json").read_bytes()


def test_unknown_preset_is_a_clear_error(tmp_path, capsys):
    assert main(["build-model", "--preset", "enormous", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "enormous" in err and all(name in err for name in PRESETS)
    assert not (tmp_path / "x").exists()


def test_shrinking_is_refused(tmp_path, base_config):
    assert main(["build-model", "--layers", str(base_config["num_hidden_layers"] - 1), "--out", str(tmp_path)]) == 2
    assert main(["build-model", "--out", str(tmp_path)]) == 2  # neither a preset nor a size


def test_presets_are_the_documented_sizes(base_config):
    h = base_config["hidden_size"]
    per_attention = 4 * h * h + 3 * h + 2 * h  # q/k/v/o, q/k/v biases, two norms

    def params(p):
        return p.layers * (per_attention + 3 * h * p.intermediate) + base_config["vocab_size"] * h + h

    assert PRESETS["tail"].source == PRESETS["size"].source == "target"
    assert 95e6 < params(PRESETS["tail"]) < 105e6
    assert 0.45e9 < params(PRESETS["size"]) < 0.55e9
    assert PRESETS["drafter"].source == "draft" and 0.4e6 < params(PRESETS["drafter"]) < 0.5e6
    assert all(p.purpose for p in PRESETS.values())


def test_the_drafter_preset_pads_the_bundled_drafter(tmp_path, base_config):
    assert main(["build-model", "--preset", "drafter", "--out", str(tmp_path)]) == 0
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["intermediate_size"]) == (PRESETS["drafter"].layers,
                                                                   PRESETS["drafter"].intermediate)
    _assert_same_logits(_load(tiny_draft_path()), _load(tmp_path), base_config["vocab_size"])


def test_build_eagle_refuses_a_target_without_a_model(tmp_path, capsys):
    assert main(["build-eagle", "--out", str(tmp_path / "head"), "--target", str(tmp_path / "none")]) == 2
    assert "--target: no model in" in capsys.readouterr().err
    assert main(["build-eagle", "--out", str(tmp_path / "head"), "--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err


def test_an_eagle_head_is_written_in_vllms_layout_and_reads_back(tmp_path):
    from safetensors.torch import load_file

    from rollout_service.drafter import eagle

    policy = _load(tiny_model_path())
    head = eagle.for_policy(policy, seed=3)
    out = eagle.save(head, tmp_path / "head", tokenizer_from=tiny_model_path())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["EagleLlamaForCausalLM"] and cfg["hidden_size"] == policy.config.hidden_size
    names = set(load_file(str(out / "model.safetensors")))
    assert "fc.weight" in names and "layers.0.self_attn.q_proj.weight" in names
    # vLLM shares the target's embeddings and LM head, and the first layer has no input norm
    assert not any("embed_tokens" in n or "lm_head" in n or "input_layernorm" in n for n in names)
    assert eagle.is_head_dir(out) and not eagle.is_head_dir(tiny_draft_path())
    again = eagle.load(out)
    assert all(torch.equal(a, b) for a, b in zip(head.state_for_vllm().values(), again.state_for_vllm().values()))


def test_an_eagle_head_reads_the_same_features_from_a_padded_target(padded):
    """The padded copy's last hidden state (what vLLM hands an EAGLE head),
    embeddings and LM head equal the bundled model's, so one head drafts for
    both."""
    from rollout_service.drafter import eagle

    bundled, big = _load(tiny_model_path()), _load(padded)
    ids = torch.randint(3, bundled.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    head = eagle.for_policy(bundled, seed=1)
    with torch.no_grad():
        (a, _), = head.unroll(bundled, ids, eagle.policy_features(bundled, ids, mask)[1], mask, 1)
        (b, _), = head.unroll(big, ids, eagle.policy_features(big, ids, mask)[1], mask, 1)
    assert torch.allclose(a, b, atol=1e-4)
