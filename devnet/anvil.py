"""Start, identify and stop Anvil processes.

Anvil is the Linux binary from the ``@foundry-rs/anvil-linux-amd64`` npm package (``npm ci``), or
``ANVIL_BIN``, or ``anvil`` on PATH. It runs with ``--prune-history 64`` (at most 64 recent states,
in memory, so it never spills state snapshots into ``~/.foundry/anvil/tmp``; with no number it
keeps none, and an ``eth_call`` at "latest" racing a new block fails with BlockOutOfRangeError)
and ``--cache-path`` pointing under our var dir as a second guard, so a stopped devnet leaves
nothing behind outside ``var/devnet``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import requests

PRUNED_STATES_KEPT = 64
ROOT = Path(__file__).resolve().parents[1]
NPM_ANVIL = ROOT / "node_modules" / "@foundry-rs" / "anvil-linux-amd64" / "bin" / "anvil"
HOST = "127.0.0.1"

# Popen objects of the processes this one started (Anvils, the Solana RPC), so a ``down`` in the same
# process reaps them.
_SPAWNED: dict[int, subprocess.Popen[bytes]] = {}


class AnvilError(RuntimeError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def anvil_binary() -> str:
    explicit = os.environ.get("ANVIL_BIN", "").strip()
    candidates = [explicit] if explicit else [str(NPM_ANVIL), shutil.which("anvil") or ""]
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    where = explicit or f"{NPM_ANVIL.relative_to(ROOT)} or on PATH"
    raise AnvilError("ANVIL_NOT_FOUND", f"no Anvil binary at {where}: run `make install` (npm ci) first")


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Anvil binds: TIME_WAIT is no obstacle
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class Spawned:
    pid: int
    create_time: float


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def tie_to_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` making the child get ``sig`` when this process ends, however it ends (even by SIGKILL):
    Linux's PR_SET_PDEATHSIG, kept across exec. None elsewhere (there the parent's own clean-up is all)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def setup() -> None:  # in the child, between fork and exec
        prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), sig)

    return setup


def port_holder(port: int) -> tuple[int | None, list[str]] | None:
    """Who listens on ``port`` (any address): (pid, command line), or None if nobody. The pid and command
    line are known only for this user's processes ((None, []) for another user's)."""
    try:
        connections = psutil.net_connections("tcp")
    except (psutil.AccessDenied, OSError):
        return None
    listening = [c for c in connections if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port]
    for conn in listening:
        if conn.pid is not None:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                return conn.pid, psutil.Process(conn.pid).cmdline()
    return (None, []) if listening else None


def describe_holder(port: int) -> str:
    """``port`` and what holds it, for a refusal: "port 8545 (pid 123: anvil --host ...)"."""
    holder = port_holder(port)
    if holder is None or holder[0] is None:
        return f"port {port}" + (" (another user's process)" if holder else "")
    pid, cmdline = holder
    return f"port {port} (pid {pid}: {' '.join(cmdline)[:160]})"


def spawn(
    binary: str, *, port: int, chain_id: int, cache_dir: Path, log_file: Path, cwd: Path, die_with_parent: bool = False
) -> Spawned:
    """Start a detached Anvil (own session: a terminal's Ctrl-C does not reach it; ``down`` stops it).
    ``die_with_parent``: it also ends when this process does (``payintent dev``), see :func:`tie_to_parent`."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        binary,
        *("--host", HOST, "--port", str(port), "--chain-id", str(chain_id)),
        *("--prune-history", str(PRUNED_STATES_KEPT), "--cache-path", str(cache_dir), "--silent"),
    ]
    with log_file.open("wb") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=tie_to_parent() if die_with_parent else None,
        )
    return adopt(proc)


def adopt(proc: subprocess.Popen[bytes]) -> Spawned:
    """Remember a process this one started (so ``stop`` and ``is_alive`` reap it) and identify it."""
    _SPAWNED[proc.pid] = proc
    try:
        create_time = psutil.Process(proc.pid).create_time()
    except psutil.NoSuchProcess:
        create_time = 0.0
    return Spawned(proc.pid, create_time)


def rpc(url: str, method: str, params: list[Any] | None = None, timeout: float = 2.0) -> Any:
    response = requests.post(
        url, json={"jsonrpc": "2.0", "id": 1, "method": method, "params": params or []}, timeout=timeout
    )
    response.raise_for_status()
    body = response.json()
    if "error" in body:
        raise RuntimeError(f"{method}: {body['error']}")
    return body["result"]


def wait_ready(url: str, pid: int, chain_id: int, log_file: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not is_alive(pid):
            tail = log_file.read_text(errors="replace")[-1500:] if log_file.exists() else ""
            if "address already in use" in tail.lower():
                raise AnvilError("PORT_IN_USE", f"{url}: the port is already in use")
            raise AnvilError("ANVIL_FAILED", f"anvil for chain {chain_id} exited at start-up; see {log_file}: {tail}")
        try:
            if int(rpc(url, "eth_chainId", timeout=0.5), 16) == chain_id:
                return
        except (requests.RequestException, RuntimeError, ValueError):
            pass
        time.sleep(0.03)
    raise AnvilError("ANVIL_FAILED", f"anvil for chain {chain_id} did not answer on {url} within {timeout:.0f}s")


def is_alive(pid: int) -> bool:
    _reap(pid)
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def started_cmdline(pid: int, create_time: float | None) -> list[str] | None:
    """The command line of ``pid`` if it is still the process we started (not a recycled pid), else None."""
    if not is_alive(pid):
        return None
    try:
        proc = psutil.Process(pid)
        cmdline = proc.cmdline()
        if create_time and abs(proc.create_time() - create_time) > 1.0:
            return None
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    return cmdline


def is_our_anvil(pid: int, create_time: float | None, port: int) -> bool:
    """True if ``pid`` is still the Anvil we started (not a recycled pid running something else)."""
    cmdline = started_cmdline(pid, create_time)
    if not cmdline or "anvil" not in os.path.basename(cmdline[0]):
        return False
    return "--port" in cmdline and str(port) in cmdline


def stop(pids: list[int], timeout: float = 5.0) -> list[int]:
    """SIGTERM each pid, wait, then SIGKILL what is left. Returns the pids that were signalled."""
    signalled = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
            signalled.append(pid)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while any(is_alive(pid) for pid in signalled) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in signalled:
        if is_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while any(is_alive(pid) for pid in signalled) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in signalled:
        _SPAWNED.pop(pid, None)
    return signalled


def spawned_pids() -> list[int]:
    """The processes this one has started (and not yet stopped with :func:`stop`)."""
    return list(_SPAWNED)


def _reap(pid: int) -> None:
    """Collect the exit status of a process this one started, so it does not linger as a zombie."""
    proc = _SPAWNED.get(pid)
    if proc is not None:
        proc.poll()
