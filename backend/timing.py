"""A timing seam: the service marks its steps with ``with timing.step("name"):``, and a recorder
installed with ``recording(...)`` (the benchmarks' in-process breakdown, a test) sees each one.

With no recorder installed a step is one global read and a shared ``nullcontext``: nothing is timed,
nothing is allocated, nothing changes. A recorder is a callable taking the step's name and returning
a context manager entered around the step (it times it, counts the RPC calls inside, ...); an
exception in the step passes through it. Steps may nest (a rail's chain reads inside /pay's).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

Recorder = Callable[[str], AbstractContextManager[object]]

_NOTHING: AbstractContextManager[object] = contextlib.nullcontext()
_recorder: Recorder | None = None


def step(name: str) -> AbstractContextManager[object]:
    """The context manager to run step ``name`` in: the installed recorder's, or one that does nothing."""
    recorder = _recorder
    return _NOTHING if recorder is None else recorder(name)


@contextlib.contextmanager
def recording(recorder: Recorder) -> Iterator[None]:
    """Install ``recorder`` for the duration of the block (process-wide; one at a time)."""
    global _recorder
    if _recorder is not None:
        raise RuntimeError("a timing recorder is already installed")
    _recorder = recorder
    try:
        yield
    finally:
        _recorder = None
