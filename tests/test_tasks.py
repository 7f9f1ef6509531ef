"""The synthetic reasoning task: generator, verifier and tokenizer."""

from __future__ import annotations

import random
import statistics

import pytest

from rollout_service.tasks import (
    BOS_ID,
    EOS_ID,
    FAMILIES,
    PRESETS,
    Difficulty,
    check,
    collatz_trajectory,
    decode,
    encode,
    generate_problems,
    make_problem,
    prompt_token_ids,
    reference_solution,
    response_token_ids,
    verify,
)
from rollout_service.tasks.tokenizer import VOCAB_SIZE


def _all_families(seeds=range(12), n=60, difficulty="train"):
    for seed in seeds:
        yield from generate_problems(n, seed=seed, difficulty=difficulty)


def test_examples_from_the_docs():
    p = make_problem("add", (4821, 397))
    assert p.prompt == "add 4821+397\n"
    assert p.solution == "482+39 8 c0\n48+3 18 c1\n4+0 218 c1\n0+0 5218 c0\nanswer 5218"
    assert p.answer == "5218"
    p = make_problem("add", (95, 17))
    assert p.solution == "9+1 2 c1\n0+0 12 c1\n0+0 112 c0\nanswer 112"
    p = make_problem("sort", (5, 3, 8, 3))
    assert p.solution == "3|5 8 3\n3 3|5 8\n3 3 5|8\n3 3 5 8|\nanswer 3 3 5 8"
    p = make_problem("collatz", (27,))
    assert p.answer == "111" and p.num_steps == 111
    assert p.solution.split("\n")[:3] == ["82", "41", "124"]
    assert p.solution.split("\n")[-1] == "1"
    assert collatz_trajectory(6) == [3, 10, 5, 16, 8, 4, 2, 1]


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_solutions_verify(family):
    count = 0
    for seed in range(25):
        for p in generate_problems(40, seed=seed, difficulty="train", families=[family]):
            assert p.family == family
            assert reference_solution(p) == p.solution
            assert verify(p, p.solution) == 1.0, p
            assert verify(p, p.solution + "\n") == 1.0
            assert verify(p, p.solution + "<eos>") == 1.0
            count += 1
    assert count == 1000


def test_reference_answers_are_right():
    for p in _all_families():
        if p.family == "add":
            a, b = p.args
            assert p.answer == str(a + b)
        elif p.family == "sort":
            assert p.answer == " ".join(map(str, sorted(p.args)))
        else:
            assert int(p.answer) == len(collatz_trajectory(p.args[0]))
        assert p.solution.split("\n")[-1].endswith(p.answer if p.family != "collatz" else "1")


def _bump_digit(line: str, rng: random.Random) -> str:
    idx = [i for i, c in enumerate(line) if c.isdigit()]
    i = rng.choice(idx)
    d = str((int(line[i]) + rng.randint(1, 9)) % 10)
    return line[:i] + d + line[i + 1:]


def test_verifier_rejects_wrong_steps():
    rng = random.Random(0)
    for p in _all_families():
        lines = p.solution.split("\n")
        k = rng.randrange(len(lines))
        bad = list(lines)
        bad[k] = _bump_digit(bad[k], rng)
        if bad[k] == lines[k]:
            continue
        response = "\n".join(bad)
        v = check(p, response)
        assert v.reward == 0.0, (p, response)
        assert v.line == k
        assert v.reason in ("wrong_step", "wrong_answer", "bad_format"), v


def test_verifier_rejects_a_wrong_step_with_a_consistent_continuation():
    # 27 -> 82 is right; 82 -> 40 is wrong, then the trace carries on
    # correctly from the wrong value and even reaches 1.
    p = make_problem("collatz", (27,))
    response = "\n".join(["82", "40"] + [str(x) for x in collatz_trajectory(40)])
    v = check(p, response)
    assert v.reward == 0.0 and v.reason == "wrong_step" and v.line == 1


def test_verifier_rejects_truncated_answers():
    for p in _all_families(seeds=range(4)):
        text = p.solution
        for cut in {1, len(text) // 2, len(text) - 1}:
            if 0 < cut < len(text):
                v = check(p, text[:cut])
                assert v.reward == 0.0 and v.reason == "truncated", (p, cut, v)
        lines = text.split("\n")
        if len(lines) > 1:
            assert check(p, "\n".join(lines[:-1])).reason == "truncated"
    assert check(generate_problems(1, seed=0)[0], "").reason == "empty"


@pytest.mark.parametrize("garbage", ["\nanswer 5", "\n1", " 7", "x", "\n\n\n4\n2\n1", "\nfoo"])
def test_verifier_rejects_extra_garbage(garbage):
    for p in _all_families(seeds=range(3)):
        v = check(p, p.solution + garbage)
        assert v.reward == 0.0, (p, garbage)
        assert v.reason in ("extra_text", "wrong_answer", "bad_format", "wrong_step")


def test_verifier_rejects_collatz_that_keeps_cycling():
    p = make_problem("collatz", (6,))
    assert verify(p, p.solution + "\n4\n2\n1") == 0.0
    assert check(p, p.solution + "\n4\n2\n1").reason == "extra_text"


def test_generation_is_deterministic_and_seeded():
    a = generate_problems(50, seed=7)
    b = generate_problems(50, seed=7)
    c = generate_problems(50, seed=8)
    assert a == b
    assert [p.prompt for p in a] != [p.prompt for p in c]
    assert len({p.id for p in a}) == 50
    assert {p.family for p in generate_problems(300, seed=1)} == set(FAMILIES)


def test_difficulty_controls_length():
    def mean_len(d):
        return statistics.mean(len(p.solution) for p in generate_problems(600, seed=3, difficulty=d))

    assert mean_len("easy") < mean_len("default") < mean_len("train") < mean_len("hard")
    assert mean_len(0.0) < mean_len(0.5) < mean_len(1.0)
    only_sort = Difficulty({"sort": 1.0}, skew=2.0)
    assert {p.family for p in generate_problems(50, seed=0, difficulty=only_sort)} == {"sort"}
    with pytest.raises(ValueError):
        generate_problems(1, difficulty="nope")
    with pytest.raises(ValueError):
        generate_problems(1, difficulty=1.5)
    with pytest.raises(ValueError):
        Difficulty({"chess": 1.0})


def test_default_reference_lengths_are_long_tailed():
    lengths = sorted(len(response_token_ids(p)) for p in generate_problems(2000, seed=0))
    median = statistics.median(lengths)
    top = lengths[int(0.9 * len(lengths)):]
    assert max(lengths) >= 5 * median
    assert sum(top) >= 0.25 * sum(lengths)
    # The longest correct solutions stay within a few hundred tokens.
    assert max(lengths) < 600
    assert "default" in PRESETS and "train" in PRESETS


def test_tokenizer_round_trips_everything_the_task_produces():
    for p in _all_families(seeds=range(6)):
        for text in (p.prompt, p.solution, p.prompt + p.solution):
            ids = encode(text)
            assert len(ids) == len(text)
            assert decode(ids) == text
            assert all(4 <= i < VOCAB_SIZE for i in ids)  # no <unk>, no specials
    ids = prompt_token_ids(make_problem("add", (1, 2)))
    assert ids[0] == BOS_ID and decode(ids) == "add 1+2\n"
    assert response_token_ids(make_problem("add", (1, 2)))[-1] == EOS_ID
    assert decode([BOS_ID] + encode("12") + [EOS_ID]) == "12"
    assert decode([BOS_ID] + encode("12") + [EOS_ID], skip_special_tokens=False) == "<bos>12<eos>"


def test_hf_tokenizer_files_match_builtin(tmp_path):
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from rollout_service.tasks.tokenizer import check_round_trip, save_tokenizer

    save_tokenizer(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok) == VOCAB_SIZE
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    texts = [p.prompt + p.solution for p in _all_families(seeds=range(3))]
    texts.append(" leading and  double spaces, punctuation !?#~ and\nnewlines\n")
    assert check_round_trip(tok, texts) == []
    p = make_problem("sort", (3, 1, 2))
    assert prompt_token_ids(p, tok) == prompt_token_ids(p)
