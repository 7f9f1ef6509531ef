"""A benchmark stopped with SIGTERM (`kill`, `timeout`) unwinds like Ctrl-C.

Without it Python dies on SIGTERM without running `finally` blocks, and the
vLLM engine processes the run started (several hundred MB each) outlive it. The load-test
commands call `stop_on_sigterm()` at their command-line entry only, so that
an importer (a test runner) keeps its own signal handling.

A stopped run never exits 0: a signal that lands while a finished run winds
down (engines stopping, threads joining, where Python ignores the exception)
still ends the process with 128 + the signal number, as a shell reports a
process killed by it.
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import sys

_stopped_by: int | None = None


def _interrupt(signum, frame) -> None:
    global _stopped_by
    _stopped_by = signum
    raise KeyboardInterrupt(f"stopped by signal {signum}")


def _exit_as_stopped() -> None:
    if _stopped_by is not None:
        # os._exit skips the exit handlers registered before this one (at
        # import): run the two that matter here, which stop daemonic child
        # processes and flush the logs.
        if "multiprocessing.util" in sys.modules:
            sys.modules["multiprocessing.util"]._exit_function()
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed pipe: nothing left to flush
                pass
        os._exit(128 + _stopped_by)


def stop_on_sigterm() -> None:
    """SIGTERM raises KeyboardInterrupt: `asyncio.run` cancels the run and the
    fleets' `finally` blocks stop their engines."""
    signal.signal(signal.SIGTERM, _interrupt)
    # Registered before any engine starts, so it runs after their own exit
    # handlers (atexit runs last-registered first).
    atexit.register(_exit_as_stopped)
