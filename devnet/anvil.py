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
import os
import shutil
import signal
import socket
import subprocess
import time
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


def spawn(binary: str, *, port: int, chain_id: int, cache_dir: Path, log_file: Path, cwd: Path) -> Spawned:
    """Start a detached Anvil (own session: a terminal's Ctrl-C does not reach it; ``down`` stops it)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        binary,
        *("--host", HOST, "--port", str(port), "--chain-id", str(chain_id)),
        *("--prune-history", str(PRUNED_STATES_KEPT), "--cache-path", str(cache_dir), "--silent"),
    ]
    with log_file.open("wb") as log:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True
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


def _reap(pid: int) -> None:
    """Collect the exit status of a process this one started, so it does not linger as a zombie."""
    proc = _SPAWNED.get(pid)
    if proc is not None:
        proc.poll()
