"""Model files shipped with the package.

``tiny-reasoner/`` is a small Qwen2-architecture causal LM trained on
:mod:`rollout_service.tasks`; ``tiny-reasoner-draft/`` is a one-layer drafter
with the same tokenizer, for speculative decoding.  Both directories load
unchanged with ``transformers`` and vLLM.  ``scripts/train_tiny_models.py``
rebuilds them.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent

TINY_MODEL_DIRNAME = "tiny-reasoner"
TINY_DRAFT_DIRNAME = "tiny-reasoner-draft"


def tiny_model_path() -> Path:
    """Directory of the bundled tiny reasoning model."""
    return _HERE / TINY_MODEL_DIRNAME


def tiny_draft_path() -> Path:
    """Directory of the bundled drafter for the tiny reasoning model."""
    return _HERE / TINY_DRAFT_DIRNAME


__all__ = ["tiny_draft_path", "tiny_model_path"]
