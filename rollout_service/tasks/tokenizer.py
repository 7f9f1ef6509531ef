"""Character-level tokenizer shared by the task and the bundled models.

One token per character: ``<pad>`` (0), ``<bos>`` (1), ``<eos>`` (2),
``<unk>`` (3), then newline and the 95 printable ASCII characters, 100 ids in
all.  (Other characters never occur in the task; :func:`encode` maps them to
``<unk>`` and the Hugging Face tokenizer drops them.)  :func:`encode` / :func:`decode` work without any third-party package;
:func:`build_tokenizer` makes the equivalent ``tokenizers`` object and
:func:`save_tokenizer` writes the files that
``transformers.AutoTokenizer.from_pretrained`` and vLLM load (a
fast tokenizer that prepends ``<bos>`` and decodes without inserting
spaces).  On disk it is a byte-level BPE without merges, the form a ``qwen2``
model's tokenizer is rebuilt into by ``transformers.AutoTokenizer`` and vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Sequence

from .generator import Problem

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
CHARS: tuple[str, ...] = ("\n",) + tuple(chr(c) for c in range(32, 127))
VOCAB: dict[str, int] = {t: i for i, t in enumerate(SPECIAL_TOKENS + CHARS)}
VOCAB_SIZE = len(VOCAB)
_ID_TO_TOKEN = {i: t for t, i in VOCAB.items()}


def encode(text: str, add_bos: bool = False) -> list[int]:
    """Token ids of ``text`` (one per character; unknown characters map to
    ``<unk>``)."""
    ids = [VOCAB.get(ch, UNK_ID) for ch in text]
    return [BOS_ID] + ids if add_bos else ids


def decode(ids: Iterable[int], skip_special_tokens: bool = True) -> str:
    out = []
    for i in ids:
        tok = _ID_TO_TOKEN[int(i)]
        if skip_special_tokens and tok in SPECIAL_TOKENS:
            continue
        out.append(tok)
    return "".join(out)


def prompt_token_ids(problem: Problem | str, tokenizer: Any = None) -> list[int]:
    """Prompt token ids, ``<bos>`` first, as the models expect them.

    With ``tokenizer`` (a loaded Hugging Face tokenizer of a bundled model)
    the ids come from it; otherwise from the built-in vocabulary (the two
    agree).
    """
    text = problem.prompt if isinstance(problem, Problem) else problem
    if tokenizer is None:
        return encode(text, add_bos=True)
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    if not ids or ids[0] != BOS_ID:
        ids = [BOS_ID] + ids
    return ids


def response_token_ids(problem: Problem, eos: bool = True) -> list[int]:
    """Token ids of the reference response, with the end token."""
    ids = encode(problem.solution)
    return ids + [EOS_ID] if eos else ids


def byte_level_form(ch: str) -> str:
    """How a byte-level BPE vocabulary spells a printable-ASCII character or
    newline: itself, except space -> ``Ġ`` and newline -> ``Ċ`` (GPT-2's
    byte-to-unicode table)."""
    o = ord(ch)
    if 33 <= o <= 126:
        return ch
    if o < 33:
        return chr(256 + o)
    raise ValueError(f"no byte-level form for {ch!r}")


# Qwen2's pre-tokenisation pattern.  transformers (5.x) rebuilds any
# tokenizer of a ``qwen2`` model as a byte-level BPE with this pipeline from
# the vocabulary and merges, so the files spell the same pipeline.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def build_tokenizer():
    """The ``tokenizers.Tokenizer`` equivalent of :func:`encode`.

    A byte-level BPE without merges over the characters above, so every
    character is one token with the same id as in :data:`VOCAB`, whether the
    file is loaded as written (``PreTrainedTokenizerFast``, older
    transformers) or rebuilt from its vocabulary as a ``Qwen2Tokenizer``
    (transformers 5 and vLLM do this for ``qwen2`` models).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab = {t: i for t, i in VOCAB.items() if t in SPECIAL_TOKENS}
    vocab.update({byte_level_form(ch): VOCAB[ch] for ch in CHARS})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False,
                               byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)]
    )
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def save_tokenizer(directory: str | Path, model_max_length: int = 1024) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and
    ``special_tokens_map.json`` to ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(directory / "tokenizer.json"))
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "padding_side": "left",
        "added_tokens_decoder": {
            str(VOCAB[t]): {"content": t, "lstrip": False, "normalized": False,
                            "rstrip": False, "single_word": False, "special": True}
            for t in SPECIAL_TOKENS
        },
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def check_round_trip(tokenizer: Any, texts: Sequence[str]) -> list[str]:
    """Texts that a loaded Hugging Face tokenizer does not round-trip."""
    bad = []
    for t in texts:
        ids = tokenizer(t, add_special_tokens=False)["input_ids"]
        if ids != encode(t) or tokenizer.decode(ids, skip_special_tokens=True) != t:
            bad.append(t)
    return bad
