"""Fault injection for crash tests and reliability drills: ``PAYINTENT_FAULT=<point>`` makes the
relayer process die at that point (exit code 86), as a power cut would. Never set in production."""

from __future__ import annotations

import os

CRASH_EXIT_CODE = 86
POINTS = ("after-mark-submitted", "after-broadcast", "before-finish")


def crash_point(name: str) -> None:
    if os.environ.get("PAYINTENT_FAULT") == name:
        os._exit(CRASH_EXIT_CODE)
