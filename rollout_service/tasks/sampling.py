"""Reference sampling with ``transformers`` for the bundled tiny models.

Used by the tests, the training script's final check and the measuring
script when vLLM is not wanted.  Needs ``torch`` and ``transformers``
(imported lazily).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .generator import Problem
from .tokenizer import BOS_ID, EOS_ID, PAD_ID, decode, prompt_token_ids
from .verifier import Verdict, check


@dataclass(frozen=True)
class Sample:
    problem: Problem
    token_ids: tuple[int, ...]  # generated ids, the end token included if emitted
    text: str                   # decoded response, special tokens removed
    finished: bool              # the end token was emitted before the limit
    verdict: Verdict

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def failure(self) -> str | None:
        """None when correct; ``runaway`` when the limit was hit without the
        end token; otherwise the verifier's reason."""
        if self.verdict.correct:
            return None
        if not self.finished:
            return "runaway"
        return self.verdict.reason


def load_model(path: str | Path, num_threads: int | None = None):
    """Load a bundled model with transformers in float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    if num_threads:
        torch.set_num_threads(num_threads)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()
    return model


def sample_responses(model: Any, problems: Sequence[Problem], *, temperature: float = 1.0,
                     max_new_tokens: int = 960, seed: int = 0,
                     batch_size: int = 64) -> list[Sample]:
    """Sample one response per problem (``temperature == 0`` means greedy).

    Problems are batched in order, left-padded; sampling is plain
    temperature sampling (no top-k / top-p).
    """
    import torch

    out: list[Sample] = []
    gen = torch.Generator().manual_seed(seed)
    for start in range(0, len(problems), batch_size):
        batch = list(problems[start:start + batch_size])
        prompts = [prompt_token_ids(p) for p in batch]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        # generate() draws from the global generator; seed it from ours so
        # each batch is reproducible regardless of what ran before.
        torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
        kwargs: dict[str, Any] = dict(max_new_tokens=max_new_tokens, pad_token_id=PAD_ID,
                                      eos_token_id=EOS_ID, bos_token_id=BOS_ID)
        if temperature > 0:
            kwargs.update(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        with torch.inference_mode():
            seqs = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        for i, p in enumerate(batch):
            gen_ids = seqs[i, width:].tolist()
            if EOS_ID in gen_ids:
                gen_ids = gen_ids[: gen_ids.index(EOS_ID) + 1]
                finished = True
            else:
                finished = False
            text = decode(gen_ids)
            verdict = check(p, text)
            if not finished and verdict.correct:
                # Cut off exactly at the limit: not a complete response.
                verdict = Verdict(0.0, "truncated", None)
            out.append(Sample(p, tuple(gen_ids), text, finished, verdict))
    return out


def pass_rate(samples: Sequence[Sample]) -> float:
    return sum(s.verdict.reward for s in samples) / max(1, len(samples))
