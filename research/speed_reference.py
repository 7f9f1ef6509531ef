"""How fast this host runs a target's decode step right now.

On a virtual machine the CPUs' speed can drift by 2x within an hour
without the guest seeing it (no time stolen in /proc/stat), and a
calibration made at one speed then predicts a run made at another by as
much. This reference is a short, fixed piece of a decode step's work that
both sides time the same way: every weight matrix of the target, read once
and multiplied by a batch of 1 and of 16 activations (a memory-bound and a
compute-bound pass, as a CPU engine's steps at those batches are), on one
thread, in `copies` processes at once (one per engine: they share the
memory bus as a fleet's engines do). It reports the median milliseconds of
a pass at each batch and their geometric mean (`ms`), the figure that is
compared.

A calibration (`research.calibrate`) times it before and after it
measures; a load-test run on real vLLM engines times it before each
policy's fleet starts and after it stops. `predict` then scales the
calibrated step costs by the ratio of the run's reference to the
calibration's (`scale`), policy by policy and pass by pass.

    python -m research.speed_reference --model DIR --copies 2
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BATCHES = (1, 16)
REPEATS = 7
# The cost model's fields that are seconds of engine compute: what a host
# running slower makes longer. The push is measured per run; the
# speculation terms are fractions of a step.
TIME_FIELDS = ("decode_base_s", "decode_per_seq_s", "decode_per_ctx_token_s", "decode_floor_s", "prefill_per_token_s")


def on_cpu() -> bool:
    """Whether the engines here compute on the CPU, where this reference
    measures what they run on (a GPU's speed it does not see)."""
    import torch

    return not torch.cuda.is_available()


def _weight_files(model: str) -> list[Path]:
    files = sorted(Path(model).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model}: no *.safetensors weights to time a reference step with")
    return files


def _matrices(model: str) -> list:
    """The target's weight matrices as float32 (the input embedding only
    where it is also the output head)."""
    from safetensors.torch import load_file

    tensors = {}
    for f in _weight_files(model):
        tensors.update(load_file(str(f)))
    tied = not any("lm_head" in k for k in tensors)
    return [t.float() for k, t in tensors.items() if t.dim() == 2 and (tied or "embed_tokens" not in k)]


def _child(model: str, repeats: int) -> None:
    """One copy: load, say ready, wait for the go (every copy starts
    together), time, print the medians as JSON."""
    import torch

    torch.set_num_threads(1)
    mats = _matrices(model)
    out = {}
    print("ready", flush=True)
    sys.stdin.readline()
    for b in BATCHES:
        gen = torch.Generator().manual_seed(b)
        xs = {m.shape[1]: torch.randn(b, m.shape[1], generator=gen) for m in mats}
        for m in mats:  # one untimed pass: page the weights in
            xs[m.shape[1]] @ m.T
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for m in mats:
                xs[m.shape[1]] @ m.T
            times.append(time.perf_counter() - t0)
        out[str(b)] = statistics.median(times) * 1e3
    print(json.dumps(out), flush=True)


def measure(model: str, copies: int = 1, repeats: int = REPEATS) -> dict:
    """Time the reference in `copies` processes at once; their mean per batch."""
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    _weight_files(model)
    cmd = [sys.executable, "-m", "research.speed_reference", "--child", "--model", str(model),
           "--repeats", str(repeats)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for _ in range(copies)]
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"speed reference on {model} failed: {p.communicate()[1].strip()[-400:]}")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        runs = []
        for p in procs:
            out, err = p.communicate(timeout=600)
            if p.returncode != 0:
                raise RuntimeError(f"speed reference on {model} failed: {err.strip()[-400:]}")
            runs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    batch_ms = {str(b): statistics.fmean(r[str(b)] for r in runs) for b in BATCHES}
    return {"ms": math.exp(statistics.fmean(math.log(v) for v in batch_ms.values())), "batch_ms": batch_ms,
            "copies": copies, "at": time.strftime("%Y-%m-%d %H:%M:%S")}


def measure_or_warn(model: str, copies: int = 1) -> dict | None:
    """`measure`, or None with a warning on stderr where it cannot run (a
    model without safetensors weights, say): the reference serves the
    predictions, it never stops the measurement it brackets."""
    try:
        return measure(model, copies)
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"warning: no host speed reference ({exc}); predictions of this will be at the calibration's speed",
              file=sys.stderr, flush=True)
        return None


def bracket(before: dict | None, after: dict | None) -> dict | None:
    """Readings taken before and after a measurement: their mean stands for
    the host's speed over it (a drift roughly linear in time). None if
    either is missing."""
    if before is None or after is None:
        return None
    return {"ms": (before["ms"] + after["ms"]) / 2, "before": before, "after": after}


def describe(ref: dict) -> str:
    b, a = ref["before"], ref["after"]
    return (f"speed reference {b['ms']:.1f} ms before, {a['ms']:.1f} ms after "
            f"(batch 1: {b['batch_ms']['1']:.1f} / {a['batch_ms']['1']:.1f} ms, "
            f"batch 16: {b['batch_ms']['16']:.1f} / {a['batch_ms']['16']:.1f} ms)")


def scale(run_ref: dict | None, calibration_ref: dict | None) -> float | None:
    """How much slower the host ran a measurement than a calibration (None:
    one of them has no reference)."""
    if not run_ref or not calibration_ref:
        return None
    return float(run_ref["ms"]) / float(calibration_ref["ms"])


def scaled(sim: dict, factor: float | None) -> dict:
    """A cost model whose engine compute takes `factor` times as long."""
    if factor is None:
        return dict(sim)
    return {k: (v * factor if k in TIME_FIELDS else v) for k, v in sim.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model directory (default: the bundled tiny reasoner)")
    ap.add_argument("--copies", type=int, default=1, help="processes timed at once (one per engine of a fleet)")
    ap.add_argument("--repeats", type=int, default=REPEATS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not args.model:
        from rollout_service.assets import tiny_model_path

        args.model = str(tiny_model_path())
    if not (Path(args.model) / "config.json").is_file():
        ap.error(f"--model {args.model}: not a model directory (no config.json)")
    if args.child:
        _child(args.model, args.repeats)
        return 0
    if args.copies < 1:
        ap.error(f"--copies {args.copies}: at least 1")
    print(json.dumps(measure(args.model, args.copies, args.repeats), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
