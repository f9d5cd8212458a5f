"""Fault injection for crash tests and reliability drills: ``PAYINTENT_FAULT=<point>`` makes the
relayer process die at that point (exit code 86), as a power cut would. Never set in production."""

from __future__ import annotations

import os

CRASH_EXIT_CODE = 86
POINTS = ("after-mark-submitted", "after-broadcast", "before-finish")  # in a settlement thread (relayer/tasks.py)
# In an EVM block watcher thread: a round has handed a block's receipts to two or more waiting settlement threads,
# none of which has recorded its outcome yet (backend.rails.evm.pipeline.AFTER_WAKE, set by relayer.worker).
WATCH_POINT = "after-watch-block"


def crash_point(name: str) -> None:
    if os.environ.get("PAYINTENT_FAULT") == name:
        os._exit(CRASH_EXIT_CODE)


def after_watch_block(woken: int) -> None:
    """The watcher's hook: ``WATCH_POINT`` once one round woke at least two settlements (several die unrecorded)."""
    if woken >= 2:
        crash_point(WATCH_POINT)
