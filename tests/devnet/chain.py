"""Run a throwaway Anvil chain from node_modules and send signed transactions to it.

Anvil is the Linux binary shipped in the ``@foundry-rs/anvil-linux-amd64`` npm package (``npm ci``).
It runs with ``--prune-history``, which keeps no historical state and so never writes state snapshots
to disk (without it, Anvil spills old states as JSON files into ``~/.foundry/anvil/tmp`` and leaves
them there if killed), and with ``--cache-path`` pointing into a temporary directory as a second guard.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from eth_account.signers.local import LocalAccount
from web3 import Web3

from devnet.anvil import PRUNED_STATES_KEPT

ROOT = Path(__file__).resolve().parents[2]
ANVIL = ROOT / "node_modules" / "@foundry-rs" / "anvil-linux-amd64" / "bin" / "anvil"
ARTIFACT = ROOT / "devnet" / "artifacts" / "TestUSDC.json"
CHAIN_ID = 84532  # Base Sepolia's id, so a chains entry for it can point at a local node
FOUNDRY_HOME = Path.home() / ".foundry"
USDC = 10**6  # one token in base units (6 decimals)


def tree(path: Path) -> set[str]:
    """Every path under ``path`` (empty if it does not exist)."""
    return {str(p) for p in path.rglob("*")} if path.exists() else set()


@dataclass
class Anvil:
    url: str
    process: subprocess.Popen[bytes]
    cache_dir: Path
    foundry_before: set[str]  # ~/.foundry before Anvil started

    def stop(self) -> None:
        stop(self.process)


@dataclass
class Accounts:
    owner: LocalAccount  # deploys the token, may mint
    buyer: LocalAccount  # holds USDC, signs authorizations
    payee: LocalAccount  # the merchant
    relayer: LocalAccount  # submits the buyer's authorization and pays the gas
    outsider: LocalAccount  # anyone else


def anvil_command(port: int, cache_dir: Path) -> list[str]:
    return [
        str(ANVIL),
        *("--host", "127.0.0.1", "--port", str(port), "--chain-id", str(CHAIN_ID)),
        *("--prune-history", str(PRUNED_STATES_KEPT), "--cache-path", str(cache_dir), "--silent"),
    ]


def start_anvil(workdir: Path, timeout: float = 15.0) -> Anvil:
    cache_dir = workdir / "anvil-cache"
    cache_dir.mkdir(exist_ok=True)
    foundry_before = tree(FOUNDRY_HOME)
    log = workdir / "anvil.log"
    for _attempt in range(3):  # the probed port can be taken before Anvil binds it
        port = _free_port()
        with log.open("wb") as out:
            process = subprocess.Popen(
                anvil_command(port, cache_dir),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=workdir,
            )
        url = f"http://127.0.0.1:{port}"
        w3 = Web3(Web3.HTTPProvider(url, request_kwargs={"timeout": 2}, exception_retry_configuration=None))
        deadline = time.monotonic() + timeout
        while process.poll() is None and time.monotonic() < deadline:
            try:
                if w3.eth.chain_id == CHAIN_ID:
                    return Anvil(url, process, cache_dir, foundry_before)
            except Exception:
                pass
            time.sleep(0.05)
        stop(process)
    raise RuntimeError(f"anvil did not start; log tail:\n{log.read_text(errors='replace')[-2000:]}")


@contextlib.contextmanager
def running_anvil(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Anvil]:
    """A fixture's Anvil, in a temporary directory named after ``name``, stopped when the fixture ends; the
    fixture's tests are skipped if Anvil is not installed."""
    if not os.access(ANVIL, os.X_OK):
        pytest.skip(f"Anvil is not installed at {ANVIL.relative_to(ROOT)}: run `npm ci` at the repository root")
    node = start_anvil(tmp_path_factory.mktemp(name))
    try:
        yield node
    finally:
        node.stop()


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def send(w3: Web3, sender: LocalAccount, call: Any, *, gas: int | None = None) -> Any:
    """Sign ``call`` (a contract function or constructor call) as ``sender``, send it, return the receipt.

    With ``gas`` given, gas estimation (which refuses a reverting call) is skipped, so a failing
    transaction is really mined and its receipt has ``status == 0``.
    """
    params: dict[str, Any] = {
        "from": sender.address,
        "nonce": w3.eth.get_transaction_count(sender.address, "pending"),
        "chainId": CHAIN_ID,
    }
    if gas is not None:
        params["gas"] = gas
    signed = sender.sign_transaction(call.build_transaction(params))
    tx_hash = w3.eth.send_raw_transaction(signed.raw_transaction)
    return w3.eth.wait_for_transaction_receipt(tx_hash, timeout=10)
