"""One run of a tool (a benchmark, the drills): its child processes and temporary directory, stopped and
removed however the run ends (an error, Ctrl-C, SIGTERM, SIGHUP)."""

from __future__ import annotations

import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import FrameType, TracebackType

from harness.errors import HarnessError
from harness.processes import ProcessSet


def _raise_interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def stop_on_signals() -> None:
    """Ctrl-C (even when started with SIGINT ignored, `cmd &`), SIGTERM and SIGHUP raise KeyboardInterrupt,
    so that everything the run started is stopped."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGHUP, _raise_interrupt)


class Session:
    """The child processes and the temporary directory of one run.

    ``with session:`` around the run: on the way out, however the run ends, the processes are stopped
    (then each of `on_stop` is called) and the directory removed; its logs are kept (and said where)
    when the run broke, found problems, or `keep_logs` is set. Ctrl-C and HarnessError end the block with
    `exit_code` 130 and 1 (the message on stderr, after `label`, default ``bench/<name>.py``); any other
    exception goes on. The directory is ``payintent-<kind>-<name>-*`` in the system's temporary directory.
    """

    def __init__(self, name: str, keep_logs: bool = False, *, kind: str = "bench", label: str | None = None) -> None:
        self.script = name
        self.kind = kind
        self.label = label or f"bench/{name}.py"
        self.keep_logs = keep_logs
        self.procs = ProcessSet()
        self.workdir = Path(tempfile.mkdtemp(prefix=f"payintent-{kind}-{name}-"))
        self.problems: list[str] = []
        self.on_stop: list[Callable[[], None]] = []
        self.exit_code: int | None = None

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, _tb: TracebackType | None
    ) -> bool:
        if isinstance(exc, KeyboardInterrupt):
            print("\ninterrupted; stopping everything", file=sys.stderr)
            self.exit_code = 130
        elif isinstance(exc, HarnessError):
            print(f"{self.label}: {exc}", file=sys.stderr)
            self.exit_code = 1
        self.procs.stop_all()
        for stop in self.on_stop:
            stop()
        if self.problems or exc is not None or self.keep_logs:
            kept = Path(tempfile.mkdtemp(prefix=f"payintent-{self.kind}-{self.script}-logs-"))
            for log in self.workdir.glob("*.log"):
                shutil.copy(log, kept / log.name)
            print(f"logs kept in {kept}", file=sys.stderr)
        shutil.rmtree(self.workdir, ignore_errors=True)
        return self.exit_code is not None
