"""The harness's one exception."""

from __future__ import annotations


class HarnessError(RuntimeError):
    """The stack is broken (not slow): a process failed to start or died, a readiness wait timed out, a
    ``payintent`` command failed. bench/_common.BenchError is this class."""
