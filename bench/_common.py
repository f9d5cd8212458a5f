"""What the benchmark scripts share: their child processes, CPU accounting, the service processes' setup,
helper servers, the report's common lines, and how a run starts and ends.

The scripts are run as ``.venv/bin/python bench/<name>.py``: they put ``bench/`` on ``sys.path`` and
``import _common as common``. This module imports no other bench script.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
HOST = "127.0.0.1"
PAYINTENT = str(Path(sys.executable).with_name("payintent"))
SERVICE_VARS = ("DATABASE_URL", "REDIS_URL", "CHAINS_FILE")  # what the benchmarks choose for the service


class BenchError(RuntimeError):
    """The run is broken (not slow): a process failed, a status was wrong, a check or wrk found errors."""


# --- processes -----------------------------------------------------------------------------------


class ProcessSet:
    """Every child started by the benchmark, each in its own session, so that all can be stopped."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen[Any]] = []

    def start(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        proc = subprocess.Popen(argv, start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[Any], grace: float = 10.0) -> None:
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
        if proc in self._procs:
            self._procs.remove(proc)

    def stop_all(self) -> None:
        for proc in list(reversed(self._procs)):
            self.stop(proc)


# --- CPU -----------------------------------------------------------------------------------------


def machine_busy() -> float:
    """CPU seconds the whole machine has been busy since boot (all cores)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> set[int]:
    """A process and all its descendants (empty when it is gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        return {pid, *(p.pid for p in root.children(recursive=True))}
    except psutil.Error:
        return set()


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


# --- the service's processes ---------------------------------------------------------------------


def service_env(workdir: Path, drop: tuple[str, ...] = (), **values: str) -> dict[str, str]:
    """The environment of a service process the benchmark starts: this one's without SERVICE_VARS and
    `drop`, with quiet logs, unbuffered output, a var dir under `workdir`, and `values`.

    Rate limits, relay budgets and the cap on a merchant's open settlements are off: one merchant pays
    thousands of times, beyond a day's budget, many at once."""
    env = {k: v for k, v in os.environ.items() if k not in SERVICE_VARS and k not in drop}
    env.update(LOG_LEVEL="WARNING", PAYINTENT_VAR_DIR=str(workdir / "var"), PYTHONUNBUFFERED="1",
               SECRET_KEY=secrets.token_hex(32), API_RATE_LIMIT_PER_KEY="0", API_RATE_LIMIT_PER_IP="0",
               RELAY_BUDGET_EVM="unlimited", RELAY_BUDGET_SOLANA="unlimited", MAX_OPEN_SETTLEMENTS="0",
               MAX_OPEN_SETTLEMENTS_PER_PAYER="0",
               **values)  # fmt: skip
    return env


def payintent(env: dict[str, str], *args: str) -> dict[str, Any]:
    """Run a `payintent` command to its end; returns the JSON of its last output line."""
    out = subprocess.run([PAYINTENT, *args], cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise BenchError(f"payintent {' '.join(args[:2])} failed ({out.returncode}): {out.stdout} {out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def create_merchant(env: dict[str, str], email: str) -> dict[str, Any]:
    """Migrate the database of `env` and create one merchant; returns `payintent merchant create`'s answer."""
    payintent(env, "db", "upgrade")
    return payintent(env, "merchant", "create", "--email", email, "--password", "bench-password")


def start_service(procs: ProcessSet, command: str, env: dict[str, str], log: Path) -> subprocess.Popen[Any]:
    """A long-running `payintent <command>` process, its output to `log`."""
    with log.open("w") as out:
        return procs.start([PAYINTENT, command], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_registered(
    redis: Any,
    queue: str,
    started: list[subprocess.Popen[Any]],
    what: str,
    check: Callable[[], None],
    *,
    timeout: float,
    poll: float,
) -> None:
    """Wait (up to `timeout` s, polling every `poll` s) until every process of `started` has registered
    with Redis as an RQ worker of `queue`; `check()` raises when one of them died."""
    from rq import Queue, Worker

    rq_queue = Queue(queue, connection=redis)
    deadline = time.monotonic() + timeout
    while True:
        check()
        registered = {w.pid for w in Worker.all(connection=redis, queue=rq_queue)}
        if {p.pid for p in started} <= registered:
            return
        if time.monotonic() > deadline:
            raise BenchError(f"the {what} did not register with Redis within {timeout:.0f} s")
        time.sleep(poll)


# --- helper servers (a bench script run again as a subprocess of itself) -------------------------

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def run_server(handle: Handler, port: int = 0, backlog: int = 100) -> int:
    """The main of a helper process: an asyncio server on HOST:port (0: any free port) that prints
    `ready <port>` once it listens, and serves until SIGTERM or Ctrl-C."""

    async def serve() -> None:
        server = await asyncio.start_server(handle, HOST, port, backlog=backlog)
        print(f"ready {server.sockets[0].getsockname()[1]}", flush=True)
        async with server:
            await server.serve_forever()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())
    return 0


def start_helper(
    procs: ProcessSet, script: str, args: list[str], log: Path, what: str
) -> tuple[subprocess.Popen[str], int]:
    """Start `script` again with `args` as a helper server (see run_server), its stderr to `log`; returns
    the process and its port once it is ready."""
    argv = [sys.executable, str(Path(script).resolve()), *args]
    with log.open("w") as out:
        proc = procs.start(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=out, text=True)
    assert proc.stdout is not None
    words = proc.stdout.readline().split()
    if len(words) != 2 or words[0] != "ready":
        raise BenchError(f"the {what} did not start: {log.read_text()[-2000:]}")
    return proc, int(words[1])


# --- the report ----------------------------------------------------------------------------------


def _git(*args: str) -> str:
    out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    return out.stdout.strip() if out.returncode == 0 else ""


def git_commit() -> str:
    """The checkout's commit, and whether tracked files differ from it."""
    commit = _git("rev-parse", "--short=12", "HEAD") or "unknown"
    if _git("status", "--porcelain", "--untracked-files=no"):
        commit += " (with uncommitted changes)"
    return commit


def package_version(module: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return "?"


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def machine() -> str:
    """This machine for the Settings: cores, CPU model, operating system."""
    return f"nproc {os.cpu_count()}, {_cpu_model()}, {platform.system()} {platform.release()}"


def write_section(text: str, heading: str, doc: Path = DOC) -> None:
    """Replace one benchmark's section of the doc (``heading`` up to the next ``## ``), keeping the rest."""
    current = doc.read_text() if doc.exists() else "# Benchmarks\n\n"
    lines = current.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == heading), None)
    new = text.rstrip("\n") + "\n"
    if start is None:
        head = current.rstrip("\n") + "\n\n" if current.strip() else ""
        doc.parent.mkdir(parents=True, exist_ok=True)
        doc.write_text(head + new)
        return
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    tail = "".join(lines[end:])
    doc.write_text("".join(lines[:start]) + new + ("\n" + tail if tail else ""))


# --- a run's start and end ----------------------------------------------------------------------


def argument_parser(doc: str, heading: str) -> argparse.ArgumentParser:
    """A script's parser: its docstring's first paragraph as the description, and --write."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"replace the section '{heading}' in docs/benchmarks.md")
    return parser


def _raise_interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def stop_on_signals() -> None:
    """Ctrl-C (even when started with SIGINT ignored, `cmd &`), SIGTERM and SIGHUP raise KeyboardInterrupt,
    so that everything the run started is stopped."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGHUP, _raise_interrupt)


class Session:
    """The child processes and the temporary directory of one run of `bench/<script>.py`.

    ``with session:`` around the run: on the way out, however the run ends, the processes are stopped
    (then each of `on_stop` is called) and the directory removed; its logs are kept (and said where)
    when the run broke, found problems, or `keep_logs` is set. Ctrl-C and BenchError end the block with
    `exit_code` 130 and 1 (the message on stderr); any other exception goes on.
    """

    def __init__(self, script: str, keep_logs: bool = False) -> None:
        self.script = script
        self.keep_logs = keep_logs
        self.procs = ProcessSet()
        self.workdir = Path(tempfile.mkdtemp(prefix=f"payintent-bench-{script}-"))
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
        elif isinstance(exc, BenchError):
            print(f"bench/{self.script}.py: {exc}", file=sys.stderr)
            self.exit_code = 1
        self.procs.stop_all()
        for stop in self.on_stop:
            stop()
        if self.problems or exc is not None or self.keep_logs:
            kept = Path(tempfile.mkdtemp(prefix=f"payintent-bench-{self.script}-logs-"))
            for log in self.workdir.glob("*.log"):
                shutil.copy(log, kept / log.name)
            print(f"logs kept in {kept}", file=sys.stderr)
        shutil.rmtree(self.workdir, ignore_errors=True)
        return self.exit_code is not None


def finish(
    aims_lines: list[str], problems: list[str], clock_started: float, heading: str, section: Callable[[], str] | None
) -> int:
    """The end of a run: the aims, the problems (stderr), the total time, and the doc's section rewritten
    with `section()` (--write; None: not). Returns the exit status: 1 when there were problems."""
    print()
    for line in aims_lines:
        print(line)
    for problem in problems:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    print(f"\ntotal {time.monotonic() - clock_started:.0f} s")
    if section is not None:
        write_section(section(), heading)
        print(f"wrote the section '{heading}' of {DOC.relative_to(ROOT)}")
    return 1 if problems else 0
