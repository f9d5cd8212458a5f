"""Fixtures: a real Anvil chain started from node_modules, funded accounts, a freshly deployed TestUSDC."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from eth_account import Account
from web3 import Web3
from web3.contract import Contract

from tests.devnet.chain import ARTIFACT, USDC, Accounts, Anvil, running_anvil, send


@pytest.fixture(scope="session")
def anvil(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Anvil]:
    with running_anvil(tmp_path_factory, "anvil") as node:
        yield node


@pytest.fixture(scope="session")
def w3(anvil: Anvil) -> Web3:
    return Web3(Web3.HTTPProvider(anvil.url, request_kwargs={"timeout": 10}))


@pytest.fixture(scope="session")
def artifact() -> dict[str, Any]:
    return json.loads(ARTIFACT.read_text())


@pytest.fixture(scope="session")
def accounts(w3: Web3) -> Accounts:
    """Fresh random keys (no well-known dev keys), each given 100 ETH for gas."""
    accts = Accounts(*(Account.create() for _ in range(5)))
    for acct in vars(accts).values():
        w3.provider.make_request("anvil_setBalance", [acct.address, hex(100 * 10**18)])
    return accts


@pytest.fixture
def token(w3: Web3, artifact: dict[str, Any], accounts: Accounts) -> Contract:
    """A TestUSDC deployed for this test alone (owner: ``accounts.owner``); the buyer holds 1,000 USDC."""
    factory = w3.eth.contract(abi=artifact["abi"], bytecode=artifact["bytecode"])
    receipt = send(w3, accounts.owner, factory.constructor(accounts.owner.address))
    assert receipt["status"] == 1
    contract = w3.eth.contract(address=receipt["contractAddress"], abi=artifact["abi"])
    assert send(w3, accounts.owner, contract.functions.mint(accounts.buyer.address, 1_000 * USDC))["status"] == 1
    return contract
