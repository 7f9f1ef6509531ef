"""The bundled tiny reasoning model and its drafter (transformers only)."""

from __future__ import annotations

import json
import statistics

import pytest

from rollout_service.assets import tiny_draft_path, tiny_model_path
from rollout_service.tasks import generate_problems, make_problem
from rollout_service.tasks.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MODEL_DIRS = [tiny_model_path(), tiny_draft_path()]

# Stated behaviour of the bundled model at temperature 1.0 on the default
# difficulty (measured on 256 samples: see docs/models.md); the small
# batch here gets some tolerance.
PASS_RATE_RANGE = (0.15, 0.85)
MIN_MAX_OVER_MEDIAN = 5.0


@pytest.fixture(scope="module", autouse=True)
def _threads():
    # One thread: small batched decoding gains little from a second one, and
    # a single thread does not stall when the CPU is shared.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def target():
    from rollout_service.tasks.sampling import load_model

    return load_model(tiny_model_path())


@pytest.fixture(scope="module")
def draft():
    from rollout_service.tasks.sampling import load_model

    return load_model(tiny_draft_path())


@pytest.mark.parametrize("path", MODEL_DIRS, ids=lambda p: p.name)
def test_files_and_config(path):
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json"} <= names
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["model_type"] == "qwen2"
    assert cfg["torch_dtype"] == "float32"
    assert cfg["vocab_size"] == VOCAB_SIZE
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (BOS_ID, EOS_ID, PAD_ID)
    gen = json.loads((path / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (BOS_ID, EOS_ID, PAD_ID)
    assert cfg["max_position_embeddings"] >= 1024


def test_bundle_size():
    total = sum(f.stat().st_size for d in MODEL_DIRS for f in d.iterdir())
    assert total < 40 * 2**20


@pytest.mark.parametrize("path", MODEL_DIRS, ids=lambda p: p.name)
def test_tokenizer_loads_and_round_trips(path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from rollout_service.tasks.tokenizer import check_round_trip, prompt_token_ids

    tok = AutoTokenizer.from_pretrained(str(path))
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert len(tok) == VOCAB_SIZE
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<bos>", "<eos>", "<pad>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    problems = generate_problems(200, seed=11, difficulty="train")
    assert check_round_trip(tok, [p.prompt + p.solution for p in problems]) == []
    for p in problems[:20]:
        assert prompt_token_ids(p, tok) == prompt_token_ids(p)
        assert tok(p.prompt)["input_ids"][0] == BOS_ID


def test_sizes(target, draft):
    n_target = sum(p.numel() for p in target.parameters())
    n_draft = sum(p.numel() for p in draft.parameters())
    assert 1_000_000 <= n_target <= 10_000_000
    assert n_draft < n_target / 4
    assert draft.config.num_hidden_layers == 1
    assert target.config.vocab_size == draft.config.vocab_size == VOCAB_SIZE


def test_greedy_generation_solves_easy_problems(target):
    from rollout_service.tasks.sampling import sample_responses

    # The model is deliberately weak (it mostly fails at addition); these are
    # problems its greedy decoding gets right.
    problems = [make_problem("collatz", (6,)), make_problem("collatz", (16,)),
                make_problem("collatz", (10,)), make_problem("sort", (2, 9))]
    samples = sample_responses(target, problems, temperature=0.0, max_new_tokens=200)
    assert all(s.finished for s in samples)
    assert sum(s.verdict.correct for s in samples) >= 3, [s.text for s in samples]


def test_sampled_batch_pass_rate_and_long_tail(target):
    from rollout_service.tasks.sampling import pass_rate, sample_responses

    problems = generate_problems(64, seed=4242, difficulty="default")
    # A lower token limit than the measuring script's (1024 positions) keeps
    # this quick; a response that hits it is a runaway all the same.
    samples = sample_responses(target, problems, temperature=1.0, seed=0, batch_size=64,
                               max_new_tokens=512)
    rate = pass_rate(samples)
    lengths = [s.num_tokens for s in samples]
    lo, hi = PASS_RATE_RANGE
    assert lo <= rate <= hi, rate
    assert max(lengths) >= MIN_MAX_OVER_MEDIAN * statistics.median(lengths), lengths
    failures = {s.failure for s in samples if s.failure}
    assert {"wrong_step", "runaway"} <= failures, failures


def test_drafter_agrees_with_target(target, draft):
    from rollout_service.tasks.sampling import sample_responses
    from rollout_service.tasks.tokenizer import prompt_token_ids

    problems = generate_problems(16, seed=99, difficulty="default")
    samples = sample_responses(target, problems, temperature=1.0, seed=1, max_new_tokens=400)
    agree = total = 0
    for s in samples:
        prompt = prompt_token_ids(s.problem)
        ids = torch.tensor([prompt + list(s.token_ids)])
        with torch.inference_mode():
            t = target(input_ids=ids).logits[0].argmax(-1)
            d = draft(input_ids=ids).logits[0].argmax(-1)
        a, b = len(prompt) - 1, ids.shape[1] - 1
        agree += int((t[a:b] == d[a:b]).sum())
        total += b - a
    assert agree / total >= 0.6
