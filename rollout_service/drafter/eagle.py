"""An EAGLE-style drafter: a head that reads the policy's own last hidden
state instead of relearning it from the tokens.

A standalone drafter (the bundled one-layer model) has to recompute, from
the tokens alone, what the policy already computed; once the policy drifts
it relearns that every version and stays short of a perfect drafter
(docs/results.md#speculative-decoding). An EAGLE head drafts the next
token from the pair (the policy's last hidden state at position i, the
token sampled at i+1): one fully connected layer folds the token's
embedding and the feature into one vector, one decoder layer (no input
norm) attends over the earlier pairs, and the policy's own LM head (shared,
not trained) turns the result into logits. Its output also stands in for
the policy's next hidden state, so the head drafts several tokens by
feeding itself.

The layout is vLLM's ``EagleLlamaForCausalLM`` (``fc``, ``layers.0.*``
without ``input_layernorm``; embeddings and LM head shared with the
target), so :func:`save` writes a directory vLLM loads as
``speculative_config = {"method": "eagle", "model": DIR}``.

Alignment (the policy's logits at position i predict token i+1): the
head's output at pair index j, from (token j+1, feature j), predicts token
j+2, i.e. it matches the policy's distribution at position j+1 and should
reproduce the policy's feature j+1.

    head = eagle.for_policy(policy)
    _, feats = eagle.policy_features(policy, input_ids, mask)     # (B, T, h)
    outs = head.unroll(policy, input_ids, feats, mask, depth=3)   # per depth: (B, T, V) logits aligned with the policy's
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from rollout_service.drafter.training import collate, dense_targets

ARCHITECTURE = "EagleLlamaForCausalLM"
#: Draft depths a head is trained at (it feeds itself DEPTH-1 times): deeper
#: drafts than this get no training signal of their own.
DEPTH = 3


def _import_torch():
    import torch
    from torch import nn

    return torch, nn


def head_config(policy_config: Any, intermediate: int | None = None) -> dict:
    """The head's Llama config from the policy's (the same width, heads and
    rope, one layer; `intermediate` defaults to the policy's MLP width)."""
    rope = getattr(policy_config, "rope_parameters", None) or {"rope_type": "default",
                                                               "rope_theta": getattr(policy_config, "rope_theta",
                                                                                     10000.0)}
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": policy_config.hidden_size,
        "intermediate_size": int(intermediate or policy_config.intermediate_size),
        "num_hidden_layers": 1,
        "num_attention_heads": policy_config.num_attention_heads,
        "num_key_value_heads": policy_config.num_key_value_heads,
        "head_dim": policy_config.hidden_size // policy_config.num_attention_heads,
        "hidden_act": "silu",
        "max_position_embeddings": policy_config.max_position_embeddings,
        "rms_norm_eps": policy_config.rms_norm_eps,
        "rope_parameters": dict(rope),
        "vocab_size": policy_config.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": getattr(policy_config, "bos_token_id", None),
        "eos_token_id": getattr(policy_config, "eos_token_id", None),
        "pad_token_id": getattr(policy_config, "pad_token_id", None),
        "torch_dtype": "float32",
    }


def tokens_per_verify(acceptance: float | list[float], k: int) -> float:
    """Tokens per verify step at depth k (bonus token included) from a
    per-token acceptance, the same at every depth or one per depth (the last
    repeated): 1 + a1 + a1 a2 + ..."""
    per_depth = list(acceptance) if isinstance(acceptance, (list, tuple)) else [acceptance]
    total, run = 1.0, 1.0
    for d in range(k):
        run *= per_depth[min(d, len(per_depth) - 1)]
        total += run
    return total


def policy_features(policy, input_ids, mask):
    """The policy's logits and last hidden state (after its final norm, what
    vLLM hands an EAGLE drafter): ((B, T, V), (B, T, h))."""
    out = policy(input_ids=input_ids, attention_mask=mask, output_hidden_states=True)
    return out.logits, out.hidden_states[-1]


def _head_class():
    """The head's class, built on first use so that importing this module does not import torch."""
    torch, nn = _import_torch()
    from transformers import LlamaConfig, LlamaModel

    class EagleHead(nn.Module):
        def __init__(self, config: dict):
            super().__init__()
            self.config_dict = dict(config)
            cfg = LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "torch_dtype")})
            hidden = cfg.hidden_size
            self.fc = nn.Linear(2 * hidden, hidden, bias=False)
            body = LlamaModel(cfg)
            body.layers[0].input_layernorm = nn.Identity()
            body.norm = nn.Identity()
            body.embed_tokens = None  # the policy's embeddings are used
            self.body = body

        @classmethod
        def for_policy(cls, policy, intermediate: int | None = None, seed: int = 0) -> "EagleHead":
            torch.manual_seed(seed)
            head = cls(head_config(policy.config, intermediate))
            with torch.no_grad():
                # Start near "the next feature is this one": fc passes the feature half through.
                hidden = head.fc.weight.shape[0]
                head.fc.weight.mul_(0.1)
                head.fc.weight[:, hidden:] += torch.eye(hidden)
            return head

        def forward(self, embeds, feats, mask):
            """One pass: (B, T, h) embeddings of tokens j+1 and features j -> (B, T, h) outputs."""
            x = self.fc(torch.cat((embeds, feats), dim=-1))
            return self.body(inputs_embeds=x, attention_mask=mask).last_hidden_state

        def unroll(self, policy, input_ids, feats, mask, depth: int = 1):
            """Per draft depth d = 1..depth, (logits, outputs) aligned with the
            policy's positions: logits[:, i] drafts token i+1 as the d-th token
            of a chain that started from the policy's feature at i-d (the
            head fed its own outputs for d-1 steps). Position 0..d-1 hold
            zeros. Within a pass every earlier pair is also a d-deep chain,
            so deeper passes see noisier context than vLLM's drafting (whose
            earlier pairs carry the policy's features): a pessimistic
            estimate at depth > 1."""
            embed = policy.get_input_embeddings()
            lm_head = policy.get_output_embeddings()
            emb = embed(input_ids[:, 1:])
            pair_mask = mask[:, 1:]
            cur = feats[:, :-1]
            outs = []
            for d in range(depth):
                h = self(emb, cur, pair_mask)                     # index j: from (token j+1, feat j) -> ~feat j+1
                logits = lm_head(h)
                aligned = torch.zeros((*input_ids.shape, logits.shape[-1]), dtype=logits.dtype)
                aligned[:, 1:] = logits                            # policy position i = j + 1
                hid = torch.zeros_like(feats)
                hid[:, 1:] = h
                outs.append((aligned, hid))
                # next depth: pair j reads the head's own output for position j (computed at pair j-1)
                cur = torch.cat((feats[:, :1], h[:, :-1]), dim=1)
            return outs

        def load_vllm_state(self, state: dict) -> None:
            """Load weights named as `state_for_vllm` writes them (all of them)."""
            mine = self.state_for_vllm()
            missing, unexpected = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
            if missing or unexpected:
                raise ValueError(f"EAGLE head weights do not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
            with torch.no_grad():
                self.fc.weight.copy_(state["fc.weight"])
                body = self.body.state_dict()
                for name, value in state.items():
                    if name != "fc.weight":
                        body[name].copy_(value)

        def state_for_vllm(self) -> dict:
            """The head's weights under vLLM's EAGLE checkpoint names."""
            out = {"fc.weight": self.fc.weight.detach().contiguous()}
            for name, value in self.body.state_dict().items():
                if name.startswith("layers.") and ".input_layernorm." not in name and "rotary" not in name:
                    out[name] = value.detach().contiguous()
            return out

    return EagleHead


_CLASS: Any = None


def _head_type():
    global _CLASS
    if _CLASS is None:
        _CLASS = _head_class()
    return _CLASS


def for_policy(policy, intermediate: int | None = None, seed: int = 0):
    """A fresh head sized for `policy` (see `head_config`)."""
    return _head_type().for_policy(policy, intermediate, seed)


def is_head_dir(path: str | Path) -> bool:
    """Whether `path` holds an EAGLE head (its config names vLLM's EAGLE architecture)."""
    config = Path(path) / "config.json"
    try:
        return ARCHITECTURE in json.loads(config.read_text()).get("architectures", [])
    except (OSError, ValueError):
        return False


def load(path: str | Path):
    """The head written by `save` (or `rollout-service build-eagle`)."""
    from safetensors.torch import load_file

    path = Path(path)
    head = _head_type()(json.loads((path / "config.json").read_text()))
    head.load_vllm_state(load_file(str(path / "model.safetensors")))
    return head


def save(head, out: str | Path, tokenizer_from: str | Path | None = None) -> Path:
    """Write the head as a vLLM EAGLE drafter directory."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(head.config_dict, indent=2) + "\n")
    save_file(head.state_for_vllm(), str(out / "model.safetensors"))
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            src = Path(tokenizer_from) / name
            if src.exists():
                (out / name).write_bytes(src.read_bytes())
    return out


def distill_loss(head, policy, input_ids, mask, valid, probs, ids, feats, depth: int = DEPTH, reg: float = 0.1):
    """Forward KL (up to the teacher's entropy) of each depth's drafts from the
    policy's top-k distributions, plus `reg` x smooth-L1 of the head's outputs
    against the policy's features (EAGLE's regression term, which keeps
    deeper drafts on track). `valid`, `probs`, `ids` cover the policy's
    positions 0..T-2 (its logits[:, :-1]): (B, T-1), (B, T-1, k), (B, T-1, k)."""
    torch, _ = _import_torch()
    total = 0.0
    for d, (logits, hid) in enumerate(head.unroll(policy, input_ids, feats, mask, depth)):
        v = valid.clone()
        v[:, : d + 1] = False
        logq = torch.log_softmax(logits[:, :-1], -1)
        total = total - (probs * logq.gather(-1, ids)).sum(-1)[v].mean()
        if reg:
            total = total + reg * torch.nn.functional.smooth_l1_loss(hid[:, :-1][v], feats[:, :-1][v])
    return total


MAX_LEN = 1024


def sample_responses(model, prompts: list[list[int]], max_tokens: int, seed: int,
                     progress=None) -> list[tuple[list[int], list[int]]]:
    """(prompt, response) pairs sampled from `model` at temperature 1 (its own
    prefixes, as the engines would produce them), in left-padded batches."""
    import torch

    from rollout_service.tasks import EOS_ID

    torch.manual_seed(seed)
    out = []
    with torch.no_grad():
        for i in range(0, len(prompts), 32):
            chunk = prompts[i:i + 32]
            width = max(len(p) for p in chunk)
            ids = torch.zeros((len(chunk), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, p in enumerate(chunk):
                ids[j, width - len(p):] = torch.tensor(p)
                mask[j, width - len(p):] = 1
            gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=max_tokens, max_length=None, eos_token_id=EOS_ID,
                                 pad_token_id=0)
            for j, p in enumerate(chunk):
                response = gen[j, width:].tolist()
                if EOS_ID in response:
                    response = response[:response.index(EOS_ID) + 1]
                out.append((p, response))
            if progress is not None:
                progress(len(out), len(prompts))
    return out


def train_head(policy, examples, targets, lr: float, steps: int, depth: int = DEPTH, seed: int = 0, head=None,
               batch: int = 16, progress=None, optimizer=None, rng=None, max_len: int = MAX_LEN,
               pad: int = 0) -> tuple:
    """Distill a head (a fresh one unless `head` is given; with `optimizer` and
    `rng` kept from an earlier call, training goes on where it stopped) from
    the policy on `examples` (prompt, response) with the policy's top-k
    `targets` (from `training.teacher_targets`); returns (head,
    seconds, losses)."""
    import torch

    head = (head if head is not None else for_policy(policy, seed=seed)).train()
    optimizer = optimizer or torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    rng = rng or np.random.default_rng(seed)
    t0 = time.perf_counter()
    losses = []
    for step in range(steps):
        picks = rng.integers(0, len(examples), min(batch, len(examples)))
        input_ids, labels, mask = collate([examples[i] for i in picks], max_len, pad)
        valid, probs, ids = dense_targets([targets[i] for i in picks], labels)
        with torch.no_grad():
            _, feats = policy_features(policy, input_ids, mask)
        value = distill_loss(head, policy, input_ids, mask, valid, probs, ids, feats, depth=depth)
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        losses.append(float(value.detach()))
        if progress is not None:
            progress(step + 1, steps, losses[-1])
    return head, time.perf_counter() - t0, losses


#: Response-position ranges (first token, end) the held-out acceptance is
#: also reported over: a head learns only the positions it was trained on,
#: and the tail of a rollout step is made of late ones.
POSITION_BUCKETS = (0, 150, 300, 450, 600, 1 << 20)


def acceptance(head, policy, examples, targets, depth: int, max_len: int = MAX_LEN, pad: int = 0) -> dict:
    """Held-out acceptance per draft depth of the head's greedy drafts (the
    policy's probability of the head's argmax) and sampled drafts
    (sum_x min(p, q)); depth d: the head has fed itself d-1 times. Also the
    greedy acceptance at depth 1 per response-position range
    (`POSITION_BUCKETS`), with the policy's own probability of its argmax
    there (what a perfect greedy drafter would get) and the token count."""
    import torch

    head.eval()
    greedy, sampled, count = np.zeros(depth), np.zeros(depth), np.zeros(depth)
    edges = torch.tensor(POSITION_BUCKETS[1:-1])
    by_pos = np.zeros((3, len(POSITION_BUCKETS) - 1))  # head's greedy, policy's ceiling, tokens
    with torch.no_grad():
        for i in range(0, len(examples), 16):
            input_ids, labels, mask = collate(examples[i:i + 16], max_len, pad)
            valid, probs, ids = dense_targets(targets[i:i + 16], labels)
            logits, feats = policy_features(policy, input_ids, mask)
            p = torch.zeros(logits[:, :-1].shape).scatter_(-1, ids, probs)
            for d, (draft_logits, _) in enumerate(head.unroll(policy, input_ids, feats, mask, depth)):
                v = valid.clone()
                v[:, : d + 1] = False
                q = torch.softmax(draft_logits[:, :-1], -1)
                accepted = p.gather(-1, q.argmax(-1, keepdim=True)).squeeze(-1)
                greedy[d] += float(accepted[v].sum())
                sampled[d] += float(torch.minimum(p, q).sum(-1)[v].sum())
                count[d] += float(v.sum())
                if d == 0:
                    position = valid.long().cumsum(1) - 1  # the predicted token's index in its response
                    bucket = torch.bucketize(position[v], edges, right=True)
                    for row, values in enumerate((accepted[v], p.max(-1).values[v], torch.ones_like(accepted[v]))):
                        by_pos[row] += np.bincount(bucket.numpy(), weights=values.numpy(), minlength=by_pos.shape[1])
    head.train()
    count = np.maximum(count, 1)
    tokens = np.maximum(by_pos[2], 1)
    ranges = [f"{a}-{b}" if b < (1 << 20) else f"{a}-" for a, b in zip(POSITION_BUCKETS, POSITION_BUCKETS[1:])]
    return {"greedy": float(greedy[0] / count[0]), "sampled": float(sampled[0] / count[0]),
            "greedy_by_depth": (greedy / count).tolist(), "sampled_by_depth": (sampled / count).tolist(),
            "greedy_by_position": {r: {"head": float(h / n), "policy_ceiling": float(c / n), "tokens": int(t)}
                                   for r, h, c, n, t in zip(ranges, by_pos[0], by_pos[1], tokens, by_pos[2])}}
