"""The drafter's training functions: plain functions over a model, a batch
and the teacher's targets, holding no state (the online trainer's process
keeps its model, optimizer and policy copy in `drafter_trainer`; the
offline tools, `build-eagle` and the drafter load tests, their own).

    input_ids, labels, mask = collate(examples, max_len, pad)   # next-token training on samples
    targets = teacher_targets(policy, examples, max_len, pad, top_k)
    loss = distill_loss(drafter, batch, batch_targets, max_len, pad)   # forward KL from the policy's top-k
    expected_acceptance(drafter, examples, targets, max_len, pad)   # sum_x min(p, q) per position

`examples` are (prompt ids, response ids) pairs; only response positions
are trained and measured.
"""
from __future__ import annotations

from typing import Any


def collate(examples: list[tuple[list[int], list[int]]], max_len: int, pad: int):
    """(prompt ids, response ids) pairs as a padded batch, cut at `max_len`
    tokens: input ids and labels (B, T) long, -100 outside responses, and
    the attention mask (B, T)."""
    import torch

    seqs, labels = [], []
    for prompt, response in examples:
        ids = (list(prompt) + list(response))[:max_len]
        lab = ([-100] * len(prompt) + list(response))[:max_len]
        seqs.append(ids)
        labels.append(lab)
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    label_ids = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, lab) in enumerate(zip(seqs, labels)):
        input_ids[i, : len(s)] = torch.tensor(s)
        label_ids[i, : len(lab)] = torch.tensor(lab)
        mask[i, : len(s)] = 1
    return input_ids, label_ids, mask


def agreement(model, examples, max_len: int, pad: int) -> float:
    """Fraction of response positions where the drafter's greedy token is the
    sampled one: with greedy drafts, a proxy for the per-token acceptance."""
    import torch

    model.eval()
    hits = total = 0
    with torch.no_grad():
        for i in range(0, len(examples), 16):
            input_ids, labels, mask = collate(examples[i : i + 16], max_len, pad)
            logits = model(input_ids=input_ids, attention_mask=mask).logits[:, :-1]
            target = labels[:, 1:]
            valid = target != -100
            hits += int(((logits.argmax(-1) == target) & valid).sum())
            total += int(valid.sum())
    model.train()
    return hits / total if total else 0.0


def teacher_targets(teacher, examples, max_len: int, pad: int, top_k: int) -> list[tuple[Any, Any]]:
    """Per example, the `teacher`'s (the policy's) top-k next-token
    probabilities and their token ids at every response position:
    ((n, k) float, (n, k) int)."""
    import torch

    out = []
    with torch.no_grad():
        for i in range(0, len(examples), 16):
            chunk = examples[i : i + 16]
            input_ids, labels, mask = collate(chunk, max_len, pad)
            logp = torch.log_softmax(teacher(input_ids=input_ids, attention_mask=mask).logits[:, :-1].float(), -1)
            valid = labels[:, 1:] != -100
            k = min(top_k, logp.shape[-1])
            for j in range(len(chunk)):
                top = logp[j][valid[j]].topk(k, dim=-1)
                out.append((top.values.exp().contiguous(), top.indices.to(torch.int32)))
    return out


def dense_targets(targets, labels):
    """A batch's per-example top-k targets (from `teacher_targets`) laid out
    over the policy's positions 0..T-2: valid (B, T-1) bool, probs and ids
    (B, T-1, k); zeros where no response token follows."""
    import torch

    valid = labels[:, 1:] != -100
    k = targets[0][0].shape[-1]
    probs = torch.zeros((*valid.shape, k))
    ids = torch.zeros((*valid.shape, k), dtype=torch.long)
    for j, (p, t) in enumerate(targets):
        rows = valid[j].nonzero().squeeze(-1)
        probs[j, rows] = p
        ids[j, rows] = t.long()
    return valid, probs, ids


def distill_loss(model, batch, targets, max_len: int, pad: int):
    """Forward KL (up to the teacher's entropy) of the drafter from the
    policy's top-k distributions at the batch's response positions."""
    import torch

    input_ids, labels, mask = collate(batch, max_len, pad)
    valid, probs, ids = dense_targets(targets, labels)
    logq = torch.log_softmax(model(input_ids=input_ids, attention_mask=mask).logits[:, :-1], -1)
    return -(probs * logq.gather(-1, ids)).sum(-1)[valid].mean()


def expected_acceptance(model, examples, targets, max_len: int, pad: int) -> float:
    """Mean over response positions of sum_x min(p, q): the probability that
    a draft token sampled from the drafter q is accepted by the policy p
    (over the teacher's top-k: a lower bound, exact when k covers the
    vocabulary)."""
    import torch

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(examples), 16):
            chunk, tchunk = examples[i : i + 16], targets[i : i + 16]
            input_ids, labels, mask = collate(chunk, max_len, pad)
            q = torch.softmax(model(input_ids=input_ids, attention_mask=mask).logits[:, :-1], -1)
            shifted = labels[:, 1:] != -100
            for j, (p, t) in enumerate(tchunk):
                qj = q[j][shifted[j]].gather(-1, t.long())
                total += float(torch.minimum(p, qj).sum())
                count += p.shape[0]
    model.train()
    return total / count if count else 0.0
