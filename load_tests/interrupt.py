"""A benchmark stopped with SIGTERM (`kill`, `timeout`) unwinds like Ctrl-C.

Without it Python dies on SIGTERM without running `finally` blocks, and the
vLLM engine processes the run started (several hundred MB each) outlive it. The load-test
commands call `stop_on_sigterm()` at their command-line entry only, so that
an importer (a test runner) keeps its own signal handling.
"""
from __future__ import annotations

import signal


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"stopped by signal {signum}")


def stop_on_sigterm() -> None:
    """SIGTERM raises KeyboardInterrupt: `asyncio.run` cancels the run and the
    fleets' `finally` blocks stop their engines."""
    signal.signal(signal.SIGTERM, _interrupt)
