"""Online drafter training on the samples the service already produces.

The drafter is only useful while it predicts what the *current* policy
samples; as the policy trains its acceptance decays. So, as TLT does, the
service keeps training it: every finished sample of the last
`versions_kept` policy versions goes into a buffer, and whenever
`min_new_samples` new ones have arrived a round of `steps_per_round`
optimizer steps (next-token cross-entropy on response tokens, i.e.
distillation from the target's own samples) runs in a separate process,
starting from the bundled draft model and continuing from round to round.
Its weights come back as a safetensors file and are pushed to every engine
through the draft-weight path (`engine.speculation.update_draft_weights`), numbered
1, 2, ... Speculation is verified, so no push can change what is sampled:
a bad drafter only costs speed.

Samples of version v teach the drafter what v sampled, so a drafter trained
on them is always a version behind the policy it drafts for. With
`teacher = "policy"` the training process also holds a copy of the policy:
every weight push reaches it (a core weight tap), and a round starts at once
that fits the drafter to the *pushed* policy's next-token distributions on
the recent samples' prefixes (forward KL on its top-`distill_top_k`
probabilities), before the new version has sampled anything. At temperature
1 a sampled draft token is accepted with probability sum_x min(p, q), which
is 1 when the drafter's q equals the policy's p: the round reports that
expectation on the newest prefixes before and after (`acceptance_before`,
`acceptance_after`).

Nothing here runs on the event loop but bookkeeping: training is in a
spawned process (one optimizer, its own torch threads), file staging in a
thread. The losses and measures a round uses are `training`'s functions;
this module holds the training process's state (model, optimizer, policy
copy) and the service side.

    trainer = DrafterTrainer(engines, TrainerConfig(), draft_dir, lambda: core.policy_version)
    core.sample_taps.append(trainer.observe)
    trainer.start()            # rounds run as samples come in
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import os
import random
import shutil
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from rollout_service.aio import cancel_and_wait
from rollout_service.drafter import eagle
from rollout_service.drafter.status import TrainerStatus
from rollout_service.drafter.training import agreement, collate, distill_loss, expected_acceptance, teacher_targets
from rollout_service.engines.base import Engine
from rollout_service.engines.tables import from_table
from rollout_service.engines.types import FinishReason
from rollout_service.lifecycle.types import Sample
from rollout_service.engines.weights import StagedWeights, read_safetensors, split_and_verify

log = logging.getLogger(__name__)


TEACHERS = ("samples", "policy")


@dataclass(slots=True)
class TrainerConfig:
    """`[engine.spec.trainer]` (learning rate, sizes in samples and tokens)."""

    lr: float = 1e-3
    steps_per_round: int = 100
    batch_size: int = 16  # sequences per optimizer step
    max_len: int = 1024  # tokens per training sequence (prompt + response), longer ones are cut
    # New samples needed before a round starts. A one-layer drafter fitted to
    # a few dozen sequences memorises them and drafts worse on new ones;
    # from a few hundred on, a round raises acceptance on unseen prompts.
    min_new_samples: int = 256
    versions_kept: int = 2  # train on samples of the newest N policy versions
    buffer_samples: int = 4096
    threads: int = 1  # torch threads of the training process
    # Niceness added to the training process (0-19): where it shares cores
    # with the engines (a CPU host), generation comes first and the drafter
    # trains on what the engines leave; 0 trains at the engines' priority.
    nice: int = 10
    seed: int = 0
    # What the drafter learns from: "samples" (the sampled tokens of the
    # newest versions) or "policy" (the pushed policy's distributions on
    # those samples' prefixes; the training process holds a policy copy).
    teacher: str = "samples"
    distill_top_k: int = 256  # teacher probabilities kept per position ("policy")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> "TrainerConfig":
        cfg = from_table(cls, values, "engine.spec.trainer")
        if cfg.lr <= 0 or cfg.steps_per_round < 1 or cfg.batch_size < 1 or cfg.min_new_samples < 1 or cfg.versions_kept < 1:
            raise ValueError("engine.spec.trainer: lr, steps_per_round, batch_size, min_new_samples and versions_kept must be positive")
        if cfg.teacher not in TEACHERS:
            raise ValueError(f"engine.spec.trainer.teacher: must be one of {', '.join(TEACHERS)}, got {cfg.teacher!r}")
        if cfg.distill_top_k < 1:
            raise ValueError(f"engine.spec.trainer.distill_top_k: must be positive, got {cfg.distill_top_k}")
        if not 0 <= cfg.nice <= 19:
            raise ValueError(f"engine.spec.trainer.nice: must be in [0, 19], got {cfg.nice}")
        return cfg


# -- the training process ------------------------------------------------------------

_STATE: dict[str, Any] = {}


def _init_process(model_dir: str, lr: float, threads: int, seed: int, nice: int = 0,
                  teacher_dir: str | None = None) -> None:
    """Load the drafter and its optimizer once per training process, at
    `nice` below the service's priority; and the policy (`teacher_dir`,
    serving its own weights until a push replaces them) when it teaches."""
    if nice:
        os.nice(nice)
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval() if teacher_dir else None
    is_eagle = eagle.is_head_dir(model_dir)
    if is_eagle:
        # An EAGLE head drafts from the policy's hidden states: the policy copy is its input, not only its teacher.
        if teacher is None:
            raise ValueError("an EAGLE head trains from the policy: engine.spec.trainer.teacher must be \"policy\"")
        teacher.requires_grad_(False)
        model = eagle.load(model_dir)
        tied, pad = False, int(teacher.config.pad_token_id or 0)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        tied, pad = bool(getattr(model.config, "tie_word_embeddings", False)), int(model.config.pad_token_id or 0)
    model.train()
    _STATE.update(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0),
        tied=tied,
        pad=pad,
        rng=random.Random(seed),
        teacher=teacher,
        eagle=is_eagle,
        np_rng=np.random.default_rng(seed),
    )


def _load_teacher(path: str) -> None:
    """The training process's policy copy takes a pushed version's weights."""
    from safetensors.torch import load_file

    teacher = _STATE["teacher"]
    state = load_file(path)
    missing, unexpected = teacher.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and teacher.config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"pushed policy weights do not fit the drafter's policy copy: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")


def _fresh_targets(teacher, examples, targets, fresh, max_len: int, pad: int, top_k: int) -> list:
    """The teacher's targets on `fresh`: those of `examples`' last ones
    where `fresh` is their tail (as `training_set` picks it), computed
    again otherwise."""
    if not fresh:
        return []
    if len(fresh) <= len(examples) and examples[len(examples) - len(fresh):] == fresh:
        return targets[len(targets) - len(fresh):]
    return teacher_targets(teacher, fresh, max_len, pad, top_k)


def _train_round(examples: list[tuple[list[int], list[int]]], fresh: list[tuple[list[int], list[int]]],
                 steps: int, batch_size: int, max_len: int, out_path: str, teacher_path: str | None = None,
                 top_k: int = 0) -> dict[str, float]:
    """`steps` optimizer steps on `examples`; writes the drafter's weights
    (checkpoint format) to `out_path`. `fresh` (samples not trained on yet)
    measures the drafter's agreement before and after the round. With a
    policy copy in the process (`teacher`) the drafter fits its top-`top_k`
    distributions instead of the sampled tokens, after `teacher_path` (a
    pushed version, if any) is loaded into it."""
    import torch
    from safetensors.torch import save_file

    if _STATE.get("eagle"):
        return _train_eagle_round(examples, fresh, steps, batch_size, max_len, out_path, teacher_path, top_k)
    model, optimizer, rng, pad = _STATE["model"], _STATE["optimizer"], _STATE["rng"], _STATE["pad"]
    t0 = time.perf_counter()
    teacher = _STATE.get("teacher")
    distil = teacher is not None
    if distil:
        if teacher_path:
            _load_teacher(teacher_path)
        targets = teacher_targets(teacher, examples, max_len, pad, top_k)
        fresh_targets = _fresh_targets(teacher, examples, targets, fresh, max_len, pad, top_k)
        acceptance_before = expected_acceptance(model, fresh, fresh_targets, max_len, pad) if fresh else 0.0
    before = agreement(model, fresh, max_len, pad) if fresh else 0.0
    losses = []
    tokens = 0
    for _ in range(steps):
        picks = [rng.randrange(len(examples)) for _ in range(min(batch_size, len(examples)))]
        batch = [examples[i] for i in picks]
        if distil:
            loss = distill_loss(model, batch, [targets[i] for i in picks], max_len, pad)
        else:
            input_ids, labels, mask = collate(batch, max_len, pad)
            loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        tokens += sum(min(len(p) + len(r), max_len) - min(len(p), max_len) for p, r in batch)
    after = agreement(model, fresh, max_len, pad) if fresh else 0.0
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    if _STATE["tied"]:
        state.pop("lm_head.weight", None)  # tied to the embedding; vLLM skips it
    save_file(state, out_path)
    record = {
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "tokens": tokens,
        "agreement_before": before,
        "agreement_after": after,
        "seconds": time.perf_counter() - t0,
    }
    if distil and fresh:
        record["acceptance_before"] = acceptance_before
        record["acceptance_after"] = expected_acceptance(model, fresh, fresh_targets, max_len, pad)
    return record


def _train_eagle_round(examples, fresh, steps: int, batch_size: int, max_len: int, out_path: str,
                       teacher_path: str | None, top_k: int) -> dict[str, float]:
    """`_train_round` for an EAGLE head: distilled from the policy copy (which
    also supplies the hidden states it drafts from). Agreement is the
    expected acceptance of its greedy first draft, p(argmax q), and
    acceptance that of a sampled one, sum_x min(p, q), on `fresh`."""
    from safetensors.torch import save_file

    head, teacher, pad = _STATE["model"], _STATE["teacher"], _STATE["pad"]
    t0 = time.perf_counter()
    if teacher_path:
        _load_teacher(teacher_path)
    targets = teacher_targets(teacher, examples, max_len, pad, top_k)
    fresh_targets = _fresh_targets(teacher, examples, targets, fresh, max_len, pad, top_k)
    before = eagle.acceptance(head, teacher, fresh, fresh_targets, 1, max_len, pad) if fresh else None
    _, _, losses = eagle.train_head(teacher, examples, targets, 0.0, steps, head=head, batch=batch_size,
                                    optimizer=_STATE["optimizer"], rng=_STATE["np_rng"], max_len=max_len, pad=pad)
    after = eagle.acceptance(head, teacher, fresh, fresh_targets, 1, max_len, pad) if fresh else None
    save_file(head.state_for_vllm(), out_path)
    record = {"loss_first": losses[0], "loss_last": losses[-1],
              # the response tokens of the round's training set (the other round counts those of its batches)
              "tokens": sum(min(len(p) + len(r), max_len) - min(len(p), max_len) for p, r in examples),
              "agreement_before": before["greedy"] if before else 0.0,
              "agreement_after": after["greedy"] if after else 0.0,
              "seconds": time.perf_counter() - t0}
    if before and after:
        record["acceptance_before"], record["acceptance_after"] = before["sampled"], after["sampled"]
    return record


# -- the service side ------------------------------------------------------------------


def has_draft_model(engine: Engine) -> bool:
    """Whether the engine drafts with a model (so draft weights apply to it)."""
    return engine.speculation is not None and engine.speculation.has_draft_model


def serving_draft_version(engines: Iterable[Engine]) -> int:
    """The newest drafter serving on any of `engines` (each engine's
    `speculation.draft_version` is the truth; 0 when none speculates)."""
    return max((e.speculation.draft_version for e in engines if e.speculation is not None), default=0)


class DrafterTrainer:
    """Collects samples, runs training rounds in a background process, and
    pushes each round's drafter to the engines."""

    def __init__(self, engines: Iterable[Engine], cfg: TrainerConfig, draft_model_dir: str,
                 policy_version: Callable[[], int], policy_model_dir: str | None = None) -> None:
        if cfg.teacher == "policy" and not policy_model_dir:
            raise ValueError("engine.spec.trainer.teacher = \"policy\" needs the policy's model directory")
        if cfg.teacher != "policy" and eagle.is_head_dir(draft_model_dir):
            raise ValueError("engine.spec.trainer.teacher: an EAGLE head drafts from the policy's hidden states, "
                             "so it trains from the policy: set teacher = \"policy\"")
        self.engines = [e for e in engines if has_draft_model(e)]
        self.cfg = cfg
        self.draft_model_dir = draft_model_dir
        self.policy_model_dir = policy_model_dir if cfg.teacher == "policy" else None
        self.policy_version = policy_version
        self.teacher_version = 0  # the pushed policy version the next round distils from ("policy")
        self._teacher_path: str | None = None  # its weights, copied into the trainer's directory
        self._teacher_loaded = 0  # the version the training process's policy copy holds
        self.buffer: deque[tuple[int, list[int], list[int]]] = deque(maxlen=cfg.buffer_samples)
        self.new_samples = 0
        self.rounds_run = 0
        self.rounds: deque[dict[str, Any]] = deque(maxlen=100)  # the latest rounds' records
        self.push_seconds = 0.0
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._dir = tempfile.mkdtemp(prefix="rollout-drafter-")
        self._staged: StagedWeights | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()

    @property
    def draft_version(self) -> int:
        """The newest drafter serving on this trainer's engines; a round
        pushes the next one."""
        return serving_draft_version(self.engines)

    # -- input ---------------------------------------------------------------

    def observe(self, sample: Sample) -> None:
        """A finished sample (a core sample tap): cheap, on the event loop."""
        if sample.finish_reason == FinishReason.ABORTED or not sample.response_token_ids:
            return
        self.buffer.append((sample.versions.max_version, list(sample.prompt_token_ids), list(sample.response_token_ids)))
        self.new_samples += 1
        if self.new_samples >= self.cfg.min_new_samples:
            self._wake.set()

    def add_examples(self, version: int, examples: Iterable[tuple[list[int], list[int]]]) -> None:
        """(prompt ids, response ids) pairs produced under policy `version`."""
        for prompt, response in examples:
            self.buffer.append((version, list(prompt), list(response)))
            self.new_samples += 1
        if self.new_samples >= self.cfg.min_new_samples:
            self._wake.set()

    async def policy_updated(self, version: int, staged: StagedWeights | None) -> None:
        """A core weight tap: `version` now serves. With the policy as teacher,
        keep a copy of its weights (the push's staged file is released at the
        next push) and start a round that fits the drafter to it."""
        if self.policy_model_dir is None:
            return
        if staged is None:  # a collective push keeps no staged copy
            log.warning("drafter: policy v%d arrived without a staged copy; the drafter distils from v%d",
                        version, self.teacher_version)
            return
        source = await staged.as_file()
        path = os.path.join(self._dir, f"policy-{version}.safetensors")
        incoming = os.path.join(self._dir, f"incoming-{version}.safetensors")  # not dropped while it is copied
        await asyncio.to_thread(shutil.copyfile, source, incoming)
        os.replace(incoming, path)
        self._teacher_path, self.teacher_version = path, version
        if self.buffer:
            self._wake.set()

    def _drop_old_teachers(self) -> None:
        """Remove copied policy versions older than the newest (after a round)."""
        for name in os.listdir(self._dir):
            path = os.path.join(self._dir, name)
            if name.startswith("policy-") and path != self._teacher_path:
                os.unlink(path)

    # -- lifecycle ---------------------------------------------------------------

    def _ensure_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=1,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_process,
                initargs=(self.draft_model_dir, self.cfg.lr, self.cfg.threads, self.cfg.seed, self.cfg.nice,
                          self.policy_model_dir),
            )
        return self._pool

    def start(self) -> None:
        if self._task is None and self.engines:
            self._ensure_pool()
            self._task = asyncio.create_task(self._run(), name="drafter-trainer")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        shutil.rmtree(self._dir, ignore_errors=True)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self.train_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # a failed round leaves the previous drafter serving
                log.exception("drafter training round failed")

    # -- one round -------------------------------------------------------------------

    def training_set(self) -> tuple[list[tuple[list[int], list[int]]], list[tuple[list[int], list[int]]]]:
        """(examples of the newest `versions_kept` policy versions, the
        fresh ones among them)."""
        if not self.buffer:
            return [], []
        newest = max(v for v, _, _ in self.buffer)
        floor = newest - self.cfg.versions_kept + 1
        items = list(self.buffer)
        fresh_from = len(items) - min(self.new_samples, len(items))
        examples = [(p, r) for v, p, r in items if v >= floor]
        fresh = [(p, r) for v, p, r in items[fresh_from:] if v >= floor]
        return examples, fresh[-64:]

    async def train_once(self, push: bool = True) -> dict[str, Any] | None:
        """Run one round now on what the buffer holds; push the result to the
        engines (unless `push` is False). Returns the round's record."""
        async with self._lock:
            examples, fresh = self.training_set()
            if not examples:
                return None
            self.new_samples = 0
            version = self.draft_version + 1
            out_path = os.path.join(self._dir, f"draft-{version}-{self.rounds_run}.safetensors")
            teacher_version = self.teacher_version
            # The process's policy copy keeps the last version it loaded.
            teacher_path = self._teacher_path if teacher_version != self._teacher_loaded else None
            if self.policy_model_dir is not None and not fresh:
                fresh = examples[-64:]  # a round woken by a push: measure it on the newest prefixes anyway
            loop = asyncio.get_running_loop()
            try:
                stats = await loop.run_in_executor(
                    self._ensure_pool(), _train_round, examples, fresh, self.cfg.steps_per_round,
                    self.cfg.batch_size, self.cfg.max_len, out_path, teacher_path, self.cfg.distill_top_k)
                self._teacher_loaded = teacher_version
            finally:
                self._drop_old_teachers()
            version = max(version, self.draft_version + 1)  # a push from outside may have come meanwhile
            record = dict(stats, draft_version=version, policy_version=self.policy_version(),
                          examples=len(examples), at=time.time())
            if self.policy_model_dir is not None:
                record["teacher_version"] = teacher_version
            if push:
                record["push_seconds"] = await self.push_file(version, out_path)
            self.rounds_run += 1
            self.rounds.append(record)
            log.info("drafter v%d: loss %.3f -> %.3f, agreement %.3f -> %.3f on %d fresh samples%s",
                     version, stats["loss_first"], stats["loss_last"],
                     stats["agreement_before"], stats["agreement_after"], len(fresh),
                     f", expected acceptance {stats['acceptance_before']:.3f} -> {stats['acceptance_after']:.3f}"
                     f" under policy v{teacher_version}" if "acceptance_after" in stats else "")
            return record

    async def push_file(self, version: int, path: str) -> float:
        """Push a drafter checkpoint file to every draft-model engine."""
        specs, buffer = await asyncio.to_thread(read_safetensors, path)
        tensors = await asyncio.to_thread(split_and_verify, specs, buffer)
        return await self.push(version, StagedWeights(tensors, source_path=path))

    async def push(self, version: int, staged: StagedWeights) -> float:
        """Apply staged draft weights on every draft-model engine; returns seconds."""
        t0 = time.perf_counter()
        await asyncio.gather(*(e.speculation.update_draft_weights(version, staged) for e in self.engines))
        previous, self._staged = self._staged, staged
        if previous is not None and previous is not staged:
            previous.cleanup()
            old_path = previous.path
            if old_path and old_path.startswith(self._dir):
                # Engines keep the mapped tensors for restarts; the file can go.
                try:
                    os.unlink(old_path)
                except FileNotFoundError:
                    pass
        seconds = time.perf_counter() - t0
        self.push_seconds += seconds
        return seconds

    def status(self) -> TrainerStatus:
        last = self.rounds[-1] if self.rounds else {}
        return TrainerStatus(
            rounds=self.rounds_run,
            trained_on_policy_version=last.get("policy_version", 0),
            buffered_samples=len(self.buffer),
            new_samples=self.new_samples,
            last_loss=last.get("loss_last"),
            last_agreement_before=last.get("agreement_before"),
            last_agreement_after=last.get("agreement_after"),
            last_round_seconds=last.get("seconds"),
            teacher=self.cfg.teacher,
            distilled_from_policy_version=last.get("teacher_version"),
            last_acceptance_before=last.get("acceptance_before"),
            last_acceptance_after=last.get("acceptance_after"),
        )
