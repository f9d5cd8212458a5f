"""A real devnet (three Anvil chains with our USDC), a real relayer process, real Redis."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from eth_account import Account
from web3 import Web3

from backend.chains.evm import USDC_ABI
from backend.chains.registry import ChainRegistry
from harness.ready import wait_registered
from tests.conftest import create_merchant, make_settings, truncate_all

PAYINTENT = str(Path(sys.executable).with_name("payintent"))


@dataclass
class Devnet:
    info: dict[str, Any]
    chains: ChainRegistry

    @property
    def networks(self) -> list[str]:
        return list(self.info["networks"])

    def w3(self, network: str) -> Web3:
        return Web3(Web3.HTTPProvider(self.info["networks"][network]["rpc_url"], request_kwargs={"timeout": 10}))

    def balance(self, network: str, address: str) -> int:
        token = self.w3(network).eth.contract(address=self.info["networks"][network]["usdc_address"], abi=USDC_ABI)
        return int(token.functions.balanceOf(address).call())

    def buyer(self, index: int = 0) -> Any:
        return Account.from_key(self.info["buyers"][index]["private_key"])


@pytest.fixture(scope="session")
def devnet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Devnet]:
    import devnet as devnet_module

    var = tmp_path_factory.mktemp("devnet-var")
    previous = os.environ.get("PAYINTENT_VAR_DIR")
    os.environ["PAYINTENT_VAR_DIR"] = str(var)
    try:
        info, _ = devnet_module.up(devnet_module.free_port_base())
        yield Devnet(info=info, chains=ChainRegistry.load(info["chains_file"]))
    finally:
        devnet_module.down()
        if previous is None:
            os.environ.pop("PAYINTENT_VAR_DIR", None)
        else:
            os.environ["PAYINTENT_VAR_DIR"] = previous


def start_relayer(
    db_url: str, redis_url: str, chains_file: str, *, log_file: Path | None = None, **extra_env: str
) -> subprocess.Popen[bytes]:
    """A relayer registered with RQ. ``log_file``: its output goes there (a test that reads it)."""
    env = {**os.environ, "DATABASE_URL": db_url, "REDIS_URL": redis_url, "CHAINS_FILE": chains_file,
           "LOG_LEVEL": os.environ.get("PAYINTENT_TEST_RELAYER_LOG_LEVEL", "WARNING"), **extra_env}  # fmt: skip
    # PAYINTENT_TEST_RELAYER_LOG: a file the relayers' output is appended to, one per xdist worker (its name gets
    # the worker's suffix), each relayer's lines after one naming the test that started it and its pid.
    path = os.environ.get("PAYINTENT_TEST_RELAYER_LOG") if log_file is None else None
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    target = log_file or (f"{path}.{worker}" if path and worker else path or os.devnull)
    log = open(target, "ab")  # noqa: SIM115
    proc = subprocess.Popen([PAYINTENT, "relayer"], env=env, stdout=log, stderr=log)
    if path:
        log.write(f"--- relayer {proc.pid} of {os.environ.get('PYTEST_CURRENT_TEST')} {extra_env}\n".encode())
        log.flush()
    wait_registered(proc, redis_url)  # takes jobs from now on (a loaded machine may take seconds to get here)
    return proc


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def relayer(db_url: str, redis_server_url: str, devnet: Devnet) -> Iterator[subprocess.Popen[bytes]]:
    """One relayer process per database engine, for the whole session."""
    proc = start_relayer(db_url, redis_server_url, devnet.info["chains_file"])
    yield proc
    stop_process(proc)


def make_pay_app(db_url: str, redis_url: str, devnet: Devnet, **settings: Any) -> Any:
    from backend.app import create_app

    truncate_all(db_url)
    return create_app(
        make_settings(db_url, redis_url=redis_url, chains_file=devnet.info["chains_file"], **settings),
        chains=devnet.chains,
    )


@pytest.fixture
def pay_app(db_url: str, redis_server_url: str, devnet: Devnet, relayer: Any) -> Iterator[Any]:
    from backend.extensions import db

    application = make_pay_app(db_url, redis_server_url, devnet)
    with application.app_context():
        yield application
        db.session.remove()
        db.engine.dispose()


@pytest.fixture
def pay_client(pay_app: Any) -> Any:
    return pay_app.test_client()


@pytest.fixture
def shop(pay_app: Any, devnet: Devnet) -> Any:
    """A merchant paid to a fresh address on every devnet chain (so balance changes are its own)."""
    payout = Account.create().address
    handle = create_merchant(pay_app, f"shop-{payout[-8:].lower()}@example.com", {n: payout for n in devnet.networks})
    handle.payout = payout  # type: ignore[attr-defined]
    return handle
