"""What the benchmark scripts share: their CPU accounting and the report's common lines, plus (re-exported
from the local stack harness, harness/) their child processes, the service processes' setup, helper
servers, and how a run starts and ends.

This module imports no other bench script. New code may import the harness directly
(``from harness.processes import ProcessSet``...): the names re-exported here are the same objects.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.bootstrap import create_merchant, payintent
from harness.env import PAYINTENT, ROOT, SERVICE_VARS, service_env
from harness.errors import HarnessError
from harness.ports import HOST
from harness.processes import ProcessSet, process_tree
from harness.report import BENCHMARKS_DOC as DOC
from harness.report import finish, git_commit, machine, package_version, write_section
from harness.servers import Handler, run_server, start_helper
from harness.session import Session, stop_on_signals

__all__ = [
    "DOC", "HOST", "PAYINTENT", "ROOT", "SERVICE_VARS", "BenchError", "CpuGroups", "Handler", "ProcessSet",
    "Session", "argument_parser", "cpu_seconds", "create_merchant", "finish", "git_commit", "machine",
    "machine_busy", "package_version", "payintent", "pct", "process_tree", "run_server", "service_env",
    "start_helper", "start_service", "stop_on_signals", "wait_for_quiet", "write_section",
]  # fmt: skip

BenchError = HarnessError  # the run is broken (not slow): a process failed, a status was wrong, a check found errors


# --- CPU -----------------------------------------------------------------------------------------


def machine_busy() -> float:
    """CPU seconds the whole machine has been busy since boot (all cores)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: set[int]) -> float:
    """User + system CPU seconds of the processes (those still alive)."""
    import psutil

    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
    return total


class CpuGroups:
    """CPU seconds of named process groups, of this process (named `own`), and of the whole machine;
    "other" is what the machine spent on processes that are in none of them (a shared machine)."""

    def __init__(self, groups: dict[str, Callable[[], set[int]]], own: str) -> None:
        self.groups = groups
        self.own = own
        self._before: dict[str, float] = {}

    def _snapshot(self) -> dict[str, float]:
        me = os.times()
        snap = {name: cpu_seconds(pids()) for name, pids in self.groups.items()}
        snap[self.own] = me.user + me.system
        snap["machine"] = machine_busy()
        return snap

    def start(self) -> None:
        self._before = self._snapshot()

    def stop(self) -> dict[str, float]:
        after = self._snapshot()
        used = {k: max(0.0, after[k] - self._before[k]) for k in after}
        used["other"] = max(0.0, used["machine"] - sum(v for k, v in used.items() if k != "machine"))
        return used


def wait_for_quiet(max_wait: float, threshold: float = 0.15) -> float:
    """Wait (up to max_wait s) until the machine is idle; returns the busy share of the last second."""
    deadline = time.monotonic() + max_wait
    cores = os.cpu_count() or 1
    while True:
        before = machine_busy()
        time.sleep(1.0)
        busy = (machine_busy() - before) / cores
        if busy <= threshold or time.monotonic() >= deadline:
            return busy
        print(f"  machine is {100 * busy:.0f}% busy with other work; waiting for it to calm down", flush=True)


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


# --- the service's processes (the harness's) -----------------------------------------------------------


def start_service(procs: ProcessSet, command: str, env: dict[str, str], log: Path) -> subprocess.Popen[Any]:
    """A long-running `payintent <command>` process, its output to `log`."""
    return procs.start_logged([PAYINTENT, command], log, env)


# --- a run's start and end ----------------------------------------------------------------------


def argument_parser(doc: str, heading: str) -> argparse.ArgumentParser:
    """A script's parser: its docstring's first paragraph as the description, and --write."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"replace the section '{heading}' in docs/benchmarks.md")
    return parser
