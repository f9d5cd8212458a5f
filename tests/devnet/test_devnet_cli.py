"""``payintent devnet up|down|status`` as an operator runs it: real processes, real Anvil chains, the local
Solana RPC.

Each devnet gets its own var dir, free ports (``--port-base``) and its own HOME, so the tests can
prove that Anvil writes nothing outside ``var/devnet`` (in particular nothing under ``~/.foundry``).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests
from eth_account import Account
from solders.keypair import Keypair
from web3 import Web3

from backend.chains.registry import ChainRegistry
from devnet import free_port_base
from devnet.solana_network import DEVNET_GENESIS_HASH
from tests.devnet.chain import ANVIL, ARTIFACT, FOUNDRY_HOME, ROOT, USDC, tree

PAYINTENT = str(Path(sys.executable).with_name("payintent"))
NETWORKS = {"eip155:84532": 84532, "eip155:11155111": 11155111, "eip155:5042002": 5042002}
SOLANA = "solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1"

pytestmark = pytest.mark.skipif(
    not os.access(ANVIL, os.X_OK), reason=f"Anvil is not installed at {ANVIL.relative_to(ROOT)}: run `npm ci`"
)


@dataclass
class Devnet:
    var_dir: Path
    home: Path
    port_base: int

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("CHAINS_FILE", "PAYINTENT_DEVNET_PORT_BASE")}
        return env | {"PAYINTENT_VAR_DIR": str(self.var_dir), "HOME": str(self.home)}

    def run(self, *args: str, port_base: int | None = None) -> tuple[int, dict[str, Any]]:
        argv = [PAYINTENT, "devnet", *args]
        if args[0] == "up":
            argv += ["--port-base", str(port_base or self.port_base)]
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60)
        assert done.stdout.strip(), f"no JSON on stdout; stderr: {done.stderr}"
        return done.returncode, json.loads(done.stdout)

    def ok(self, *args: str) -> dict[str, Any]:
        code, out = self.run(*args)
        assert code == 0, out
        return out

    def pids(self) -> list[int]:
        """The Anvils' pids, then the Solana RPC's."""
        state = json.loads((self.var_dir / "devnet" / "state.json").read_text())
        return [chain["pid"] for chain in state["networks"].values()] + [state["solana"]["pid"]]


def _new_devnet(tmp_path: Path) -> Devnet:
    home = tmp_path / "home"
    home.mkdir()
    return Devnet(tmp_path / "var", home, free_port_base())


@pytest.fixture(scope="module")
def devnet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Devnet]:
    node = _new_devnet(tmp_path_factory.mktemp("devnet"))
    foundry_before = tree(FOUNDRY_HOME)
    try:
        yield node
    finally:
        node.run("down")
        assert tree(FOUNDRY_HOME) - foundry_before == set()
        assert not (node.home / ".foundry").exists()


@pytest.fixture(scope="module")
def printed(devnet: Devnet) -> dict[str, Any]:
    return devnet.ok("up")


def _w3(url: str) -> Web3:
    return Web3(Web3.HTTPProvider(url, request_kwargs={"timeout": 5}))


def _relay_keys(printed: dict[str, Any]) -> dict[str, list[str]]:
    return json.loads(Path(printed["relay_keys_file"]).read_text())


def _solana(url: str, method: str, params: list[Any] | None = None) -> Any:
    body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": params or []}
    return requests.post(url, json=body, timeout=5).json()["result"]


def test_up_prints_one_object_with_the_chains_file_rpc_urls_tokens_and_buyers(
    devnet: Devnet, printed: dict[str, Any]
) -> None:
    assert set(printed) == {"chains_file", "relay_keys_file", "networks", "buyers", "solana", "solana_buyers"}
    assert printed["chains_file"] == str(devnet.var_dir / "devnet" / "chains.json")
    assert printed["relay_keys_file"] == str(devnet.var_dir / "devnet" / "relay_keys.json")
    assert list(printed["networks"]) == list(NETWORKS)
    for i, (network, info) in enumerate(printed["networks"].items()):
        assert info["chain_id"] == NETWORKS[network]
        assert info["rpc_url"] == f"http://127.0.0.1:{devnet.port_base + i}"
        assert Web3.is_checksum_address(info["usdc_address"])
    assert len(printed["buyers"]) == 3
    for buyer in printed["buyers"]:
        assert Account.from_key(buyer["private_key"]).address == buyer["address"]
    solana = printed["solana"]
    assert set(solana) == {"network", "rpc_url", "usdc_mint", "fee_payer"}
    assert (solana["network"], solana["rpc_url"]) == (SOLANA, f"http://127.0.0.1:{devnet.port_base + 3}")
    assert len(printed["solana_buyers"]) == 3
    for buyer in printed["solana_buyers"]:
        assert str(Keypair.from_base58_string(buyer["secret_key"]).pubkey()) == buyer["address"]


def test_each_chain_answers_with_its_id_and_holds_a_funded_test_usdc(printed: dict[str, Any]) -> None:
    abi = json.loads(ARTIFACT.read_text())["abi"]
    relays = {Account.from_key(k).address for n, keys in _relay_keys(printed).items() if n != SOLANA for k in keys}
    assert len(relays) == 4
    for network, info in printed["networks"].items():
        w3 = _w3(info["rpc_url"])
        assert w3.eth.chain_id == NETWORKS[network]
        token = w3.eth.contract(address=info["usdc_address"], abi=abi)
        assert token.functions.name().call() == "USDC"
        assert token.functions.decimals().call() == 6
        for buyer in printed["buyers"]:
            assert token.functions.balanceOf(buyer["address"]).call() == 10_000 * USDC
        assert token.functions.totalSupply().call() == 3 * 10_000 * USDC
        for relay in relays:
            assert w3.eth.get_balance(relay) >= 100 * 10**18


def test_the_solana_rpc_serves_devnet_with_a_funded_usdc_mint(printed: dict[str, Any]) -> None:
    solana = printed["solana"]
    url = solana["rpc_url"]
    assert _solana(url, "getGenesisHash")[:32] == DEVNET_GENESIS_HASH[:32]
    mint = _solana(url, "getAccountInfo", [solana["usdc_mint"], {"encoding": "jsonParsed"}])["value"]
    assert mint["data"]["parsed"]["info"]["decimals"] == 6
    assert int(mint["data"]["parsed"]["info"]["supply"]) == 3 * 10_000 * USDC
    for buyer in printed["solana_buyers"]:
        owned = _solana(
            url,
            "getTokenAccountsByOwner",
            [buyer["address"], {"mint": solana["usdc_mint"]}, {"encoding": "jsonParsed"}],
        )
        (account,) = owned["value"]
        assert account["account"]["data"]["parsed"]["info"]["tokenAmount"]["amount"] == str(10_000 * USDC)
    assert _solana(url, "getBalance", [solana["fee_payer"]])["value"] >= 100 * 10**9


def test_the_chains_file_loads_and_names_the_relays_of_the_key_file(printed: dict[str, Any]) -> None:
    registry = ChainRegistry.load(printed["chains_file"])
    assert registry.ids() == [*NETWORKS, SOLANA]
    assert registry.relay_keys_file == printed["relay_keys_file"]
    keys = _relay_keys(printed)
    assert list(keys) == [*NETWORKS, SOLANA]
    solana = registry.get(SOLANA)
    assert (solana.kind, solana.rpc_url, solana.usdc_address, solana.decimals) == (
        "solana",
        printed["solana"]["rpc_url"],
        printed["solana"]["usdc_mint"],
        6,
    )
    (relay_key,) = keys[SOLANA]
    assert str(Keypair.from_base58_string(relay_key).pubkey()) == solana.fee_payer == printed["solana"]["fee_payer"]
    for network in registry:
        if network.kind != "evm":
            continue
        info = printed["networks"][network.network]
        assert (network.kind, network.chain_id, network.rpc_url) == ("evm", info["chain_id"], info["rpc_url"])
        assert network.usdc_address == info["usdc_address"]
        assert (network.usdc_domain_name, network.usdc_domain_version) == ("USDC", "2")
        assert network.relay_addresses == tuple(Account.from_key(k).address for k in keys[network.network])
        assert "relay" not in json.dumps(network.public())


def test_secrets_are_readable_by_the_owner_only(devnet: Devnet, printed: dict[str, Any]) -> None:
    for name in ("relay_keys.json", "state.json"):
        assert stat.S_IMODE((devnet.var_dir / "devnet" / name).stat().st_mode) == 0o600, name


def test_up_again_prints_the_same_and_starts_nothing(devnet: Devnet, printed: dict[str, Any]) -> None:
    pids = devnet.pids()
    assert devnet.ok("up") == printed
    assert devnet.pids() == pids


def test_status_reports_every_chain_running(devnet: Devnet, printed: dict[str, Any]) -> None:
    status = devnet.ok("status")
    assert (status["state"], status["running"], status["chains_file"]) == ("running", True, printed["chains_file"])
    for network, info in status["networks"].items():
        assert info["pid_alive"] and info["rpc_reachable"] and info["token_deployed"]
        assert info["block_number"] >= 4  # the deployment and three mints
        assert info["usdc_address"] == printed["networks"][network]["usdc_address"]
    solana = status["solana"]
    assert solana["pid_alive"] and solana["rpc_reachable"] and solana["mint_exists"] and solana["slot"] >= 1
    assert (solana["network"], solana["usdc_mint"]) == (SOLANA, printed["solana"]["usdc_mint"])


def test_a_taken_port_is_refused_clearly(devnet: Devnet, printed: dict[str, Any], tmp_path: Path) -> None:
    other = Devnet(tmp_path / "var", devnet.home, devnet.port_base + 1)  # overlaps the running devnet
    code, out = other.run("up")
    assert code != 0
    assert out["success"] is False and out["error"]["code"] == "PORT_IN_USE"
    assert str(devnet.port_base + 1) in out["error"]["message"]
    assert not (tmp_path / "var" / "devnet" / "state.json").exists()


def test_down_stops_exactly_what_up_started_and_up_recovers_a_broken_devnet(tmp_path: Path) -> None:
    node = _new_devnet(tmp_path)
    foundry_before = tree(FOUNDRY_HOME)
    assert node.ok("down") == {"state": "stopped", "stopped_pids": []}  # nothing to stop: fine
    try:
        first = node.ok("up")
        pids = node.pids()
        assert all("anvil" in psutil.Process(pid).cmdline()[0] for pid in pids[:3])
        assert "devnet.solana_rpc" in psutil.Process(pids[3]).cmdline()

        # One chain dies behind our back: status says so, and `up` replaces the whole devnet.
        os.kill(pids[1], signal.SIGKILL)
        psutil.wait_procs([psutil.Process(pids[1])], timeout=5)
        status = node.ok("status")
        assert status["state"] == "degraded" and status["running"] is False
        assert [n["pid_alive"] for n in status["networks"].values()] == [True, False, True]
        second = node.ok("up")
        assert second["buyers"] != first["buyers"]  # fresh keys, and the printed ones are the funded ones
        assert second["solana_buyers"] != first["solana_buyers"]
        w3 = _w3(second["networks"]["eip155:11155111"]["rpc_url"])
        token = w3.eth.contract(
            address=second["networks"]["eip155:11155111"]["usdc_address"], abi=json.loads(ARTIFACT.read_text())["abi"]
        )
        assert token.functions.balanceOf(second["buyers"][0]["address"]).call() == 10_000 * USDC
        assert not any(psutil.pid_exists(pid) and _is_running(pid) for pid in pids)
        pids = node.pids()

        # The Solana RPC dies: degraded too, and `up` replaces everything again.
        os.kill(pids[3], signal.SIGKILL)
        psutil.wait_procs([psutil.Process(pids[3])], timeout=5)
        status = node.ok("status")
        assert status["state"] == "degraded" and status["solana"]["pid_alive"] is False
        third = node.ok("up")
        assert third["solana"]["usdc_mint"] != second["solana"]["usdc_mint"]
        assert not any(_is_running(pid) for pid in pids)
        pids = node.pids()
    finally:
        down = node.ok("down")
    assert sorted(down["stopped_pids"]) == sorted(pids)
    assert not any(_is_running(pid) for pid in pids)
    assert not (node.var_dir / "devnet" / "state.json").exists()
    assert not (node.var_dir / "devnet" / "solana-setup.json").exists()  # it held the mint's keys
    assert node.ok("status") == {"state": "stopped", "running": False, "networks": {}}
    assert tree(node.var_dir / "devnet" / "cache") == {
        str(node.var_dir / "devnet" / "cache" / str(chain_id)) for chain_id in NETWORKS.values()
    }  # empty cache folders only
    assert tree(FOUNDRY_HOME) - foundry_before == set()
    assert not (node.home / ".foundry").exists()


def _is_running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
