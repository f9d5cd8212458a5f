"""Start, identify and wait for the local Solana RPC process (``python -m devnet.solana_rpc``).

Stopping it is :func:`devnet.anvil.stop` (SIGTERM, then SIGKILL), as for the Anvils.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import requests

from devnet import anvil
from devnet.solana_network import is_local_genesis

MODULE = "devnet.solana_rpc"
ROOT = Path(__file__).resolve().parents[1]


def spawn(
    *, port: int, setup_file: Path, log_file: Path, cwd: Path, slot_ms: int | None = None, die_with_parent: bool = False
) -> anvil.Spawned:
    """Start a detached Solana RPC (own session, like the Anvils) that sets itself up from ``setup_file``;
    ``die_with_parent`` as for :func:`devnet.anvil.spawn`."""
    argv = [sys.executable, "-m", MODULE, "--host", anvil.HOST, "--port", str(port), "--setup", str(setup_file)]
    if slot_ms is not None:
        argv += ["--slot-ms", str(slot_ms)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    with log_file.open("wb") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=env,
            start_new_session=True,
            preexec_fn=anvil.tie_to_parent() if die_with_parent else None,
        )
    return anvil.adopt(proc)


def wait_ready(url: str, pid: int, mint: str, log_file: Path, timeout: float = 30.0) -> None:
    """Until the RPC answers with a local ledger's genesis hash (Solana devnet's CAIP-2 id) and the mint exists
    (setup runs before it listens)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not anvil.is_alive(pid):
            tail = log_file.read_text(errors="replace")[-1500:] if log_file.exists() else ""
            if "address already in use" in tail.lower():
                raise anvil.AnvilError("PORT_IN_USE", f"{url}: the port is already in use")
            raise anvil.AnvilError("SOLANA_RPC_FAILED", f"the Solana RPC exited at start-up; see {log_file}: {tail}")
        try:
            if is_local_genesis(anvil.rpc(url, "getGenesisHash", timeout=0.5)):
                if anvil.rpc(url, "getAccountInfo", [mint, {"encoding": "base64"}], timeout=2)["value"] is not None:
                    return
                raise anvil.AnvilError("SOLANA_RPC_FAILED", f"the Solana RPC on {url} has no USDC mint {mint}")
        except (requests.RequestException, RuntimeError, ValueError, TypeError, KeyError):
            pass
        time.sleep(0.05)
    raise anvil.AnvilError("SOLANA_RPC_FAILED", f"the Solana RPC did not answer on {url} within {timeout:.0f}s")


def is_ours(pid: int, create_time: float | None, port: int) -> bool:
    """True if ``pid`` is still the Solana RPC we started (not a recycled pid running something else)."""
    cmdline = anvil.started_cmdline(pid, create_time) or []
    return MODULE in cmdline and "--port" in cmdline and str(port) in cmdline
