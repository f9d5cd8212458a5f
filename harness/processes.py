"""Child processes: each in its own session (a signal to the caller's process group does not reach it, and
its whole group, e.g. gunicorn's workers, can be stopped at once), logs to files, stopped with a grace."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import psutil

from devnet.anvil import tie_to_parent
from harness.env import ROOT


class ProcessSet:
    """Every child a run started, so that all can be stopped (``stop_all``, newest first)."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen[Any]] = []

    def start(self, argv: Sequence[str], *, die_with_parent: int | None = None, **kwargs: Any) -> subprocess.Popen[Any]:
        """``Popen(argv, **kwargs)`` in a new session. ``die_with_parent``: the signal the child gets when this
        process ends however it ends (Linux's PR_SET_PDEATHSIG; None: none)."""
        if die_with_parent is not None:
            kwargs["preexec_fn"] = tie_to_parent(signal.Signals(die_with_parent))
        proc = subprocess.Popen(list(argv), start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def start_logged(
        self, argv: Sequence[str], log: Path, env: dict[str, str] | None = None, *, append: bool = False,
        **kwargs: Any,
    ) -> subprocess.Popen[Any]:  # fmt: skip
        """A long-running process from the checkout's root, its stdout and stderr to ``log``."""
        with log.open("a" if append else "w") as out:
            return self.start(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, **kwargs)

    def stop(self, proc: subprocess.Popen[Any], grace: float = 10.0) -> None:
        """SIGTERM the process's group, SIGKILL it after ``grace`` s, then SIGKILL whatever is left in the group."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)  # gunicorn's master stops its workers on TERM
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        with contextlib.suppress(ProcessLookupError):  # any worker left behind in the group
            os.killpg(proc.pid, signal.SIGKILL)
        self.forget(proc)

    def kill(self, proc: subprocess.Popen[Any]) -> None:
        """SIGKILL the process and everything in its session at once: a power cut."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        self.stop(proc, grace=0)

    def forget(self, proc: subprocess.Popen[Any]) -> None:
        if proc in self._procs:
            self._procs.remove(proc)

    def stop_all(self) -> None:
        for proc in list(reversed(self._procs)):
            self.stop(proc)

    @property
    def running(self) -> list[subprocess.Popen[Any]]:
        return [p for p in self._procs if p.poll() is None]


def alive(procs: Iterable[subprocess.Popen[Any]]) -> list[psutil.Process]:
    """The processes of ``procs`` still running, as psutil processes (for ``terminate``)."""
    found = []
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(psutil.NoSuchProcess):
                found.append(psutil.Process(proc.pid))
    return found


def terminate(procs: list[psutil.Process], timeout: float) -> None:
    """SIGTERM ``procs``, wait up to ``timeout``, then SIGKILL them and every child they had (gunicorn's workers)."""
    family: dict[int, psutil.Process] = {}
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            family |= {c.pid: c for c in proc.children(recursive=True)}
            proc.terminate()
    _, still = psutil.wait_procs(procs, timeout=timeout)
    for proc in [*still, *family.values()]:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs([*still, *family.values()], timeout=2)


def process_tree(pid: int) -> set[int]:
    """A process and all its descendants (empty when it is gone)."""
    try:
        root = psutil.Process(pid)
        return {pid, *(p.pid for p in root.children(recursive=True))}
    except psutil.Error:
        return set()
