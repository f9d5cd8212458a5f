"""``devnet up|down|status``: three local EVM chains with a test USDC and a local Solana RPC with a
USDC-like SPL mint, funded demo buyers and relay accounts.

Ports: the Anvils take ``port_base`` .. ``port_base + 2``, the Solana RPC (:mod:`devnet.solana_rpc`,
over LiteSVM) ``port_base + 3``. Everything lives under ``<PAYINTENT_VAR_DIR or ./var>/devnet/``:

- ``state.json`` (0600): pids, ports, start time, the deployer, buyer and Solana mint-authority keys, and
  the ``payintent dev`` that owns the devnet (``up(owned=True)``), if one does;
- ``chains.json``: a chains file for ``CHAINS_FILE`` (RPC URLs, token addresses, relay addresses; the
  Solana network's ``usdc_address`` is the mint and its ``fee_payer`` the relay);
- ``relay_keys.json`` (0600): ``{network: [key, ...]}``, read only by the relayer: hex private keys for
  the EVM networks, one base58 64-byte keypair for the Solana network;
- ``anvil-<chain id>.log``, ``solana-rpc.log`` and ``cache/`` (Anvil's cache path; stays empty).

Keys are fresh random ones on every start (never Anvil's well-known dev keys).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import requests

from backend.config import var_dir
from devnet import anvil, solana_network, solana_process

if TYPE_CHECKING:  # web3 and solders take a while to import: only `up` needs them, not `down` or `status`
    from eth_account.signers.local import LocalAccount
    from solders.keypair import Keypair
    from web3 import Web3

ARTIFACT = Path(__file__).with_name("artifacts") / "TestUSDC.json"
DEFAULT_PORT_BASE = 8545
PORT_BASE_ENV = "PAYINTENT_DEVNET_PORT_BASE"
BUYERS = 3
RELAYS = 4
USDC = 10**6  # one token in atomic units (6 decimals)
BUYER_USDC = 10_000 * USDC
ETH = 10**18
RELAY_ETH = 1_000 * ETH
DEPLOYER_ETH = 100 * ETH
SOL = 10**9  # lamports
SOLANA_BUYERS = 3
SOLANA_BUYER_SOL = 1 * SOL  # buyers need none (the relay pays fees); a wallet usually holds some
SOLANA_RELAY_SOL = 1_000 * SOL
SOLANA_SETUP_FILE = "solana-setup.json"  # holds the mint's keys until the RPC has set itself up; then removed
STATE_VERSION = 1


@dataclass(frozen=True)
class LocalChain:
    network: str
    chain_id: int
    name: str


LOCAL_CHAINS = (
    LocalChain("eip155:84532", 84532, "Base Sepolia (local)"),
    LocalChain("eip155:11155111", 11155111, "Ethereum Sepolia (local)"),
    LocalChain("eip155:5042002", 5042002, "Arc Testnet (local)"),
)


SOLANA_NETWORK = solana_network.NETWORK  # "solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1", Solana devnet's CAIP-2 id
PORTS = len(LOCAL_CHAINS) + 1  # the Anvils, then the Solana RPC


class DevnetError(RuntimeError):
    """A devnet command cannot do what was asked; ``code`` is stable, ``message`` says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def devnet_dir() -> Path:
    path = var_dir() / "devnet"
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_port_base() -> int:
    raw = os.environ.get(PORT_BASE_ENV, "").strip()
    if not raw:
        return DEFAULT_PORT_BASE
    try:
        return int(raw)
    except ValueError:
        raise DevnetError("INVALID_PORT", f"{PORT_BASE_ENV} must be a port number, not {raw!r}") from None


def free_port_base(count: int = PORTS, attempts: int = 200) -> int:
    """A port such that it and the ``count - 1`` after it were free a moment ago (tests, parallel stacks)."""
    rng = random.SystemRandom()
    for _ in range(attempts):
        # Below Linux's ephemeral range (32768+), so an outgoing connection cannot take the port
        # between this check and Anvil's bind.
        base = rng.randrange(20_000, 32_000)
        if all(anvil.port_is_free(base + i) for i in range(count)):
            return base
    raise DevnetError("PORT_IN_USE", f"found no {count} consecutive free ports")


# --- the three commands ------------------------------------------------------------------------


def up(port_base: int | None = None, *, owned: bool = False) -> tuple[dict[str, Any], bool]:
    """Start the devnet unless it already runs. Returns (what ``devnet up`` prints, whether this call started it).

    ``owned`` (``payintent dev``): the devnet belongs to this process. Its processes end when this process
    does, however it ends (Linux), and ``down(owner_pid=...)`` stops it. A devnet whose owner has died is a
    leftover: it is stopped here and a fresh one started (the summary's ``replaced_leftover`` says so),
    never reused. A devnet ``devnet up`` started (no owner) is reused and left running.
    """
    port_base = default_port_base() if port_base is None else port_base
    if not 1 <= port_base <= 65535 - (PORTS - 1):
        raise DevnetError("INVALID_PORT", f"--port-base must be between 1 and {65535 - PORTS + 1}")
    workdir = devnet_dir()
    with _locked(workdir):
        state = _read_state(workdir)
        leftover = None
        if state is not None:
            owner = state.get("owner")
            if owner and not _owner_alive(owner):
                leftover = {"owner_pid": owner["pid"], "stopped_pids": _stop_state(state)}
            elif state.get("complete") and _all_alive(state):
                return _summary(state), False
            else:
                _stop_state(state)  # a half-started or half-dead devnet: clear it and start afresh
            (workdir / "state.json").unlink(missing_ok=True)
        summary = _start(workdir, port_base, owned=owned)
        return (summary | {"replaced_leftover": leftover} if leftover else summary), True


def down(*, owner_pid: int | None = None) -> dict[str, Any]:
    """Stop exactly the processes ``up`` recorded (Anvils, Solana RPC); forget the running state.
    ``owner_pid``: only if the devnet belongs to that process (``up(owned=True)`` there); else leave it."""
    workdir = devnet_dir()
    with _locked(workdir):
        state = _read_state(workdir)
        if state is None:
            return {"state": "stopped", "stopped_pids": []}
        if owner_pid is not None and (state.get("owner") or {}).get("pid") != owner_pid:
            return {"state": "not-ours", "stopped_pids": []}
        stopped = _stop_state(state)
        (workdir / "state.json").unlink(missing_ok=True)
        return {"state": "stopped", "stopped_pids": stopped}


def status() -> dict[str, Any]:
    workdir = devnet_dir()
    state = _read_state(workdir)
    if state is None:
        return {"state": "stopped", "running": False, "networks": {}}
    networks: dict[str, Any] = {}
    for network, chain in state["networks"].items():
        alive = _chain_alive(chain)
        block_number = code = None
        reachable = False
        if alive:
            try:
                if int(anvil.rpc(chain["rpc_url"], "eth_chainId", timeout=1), 16) == chain["chain_id"]:
                    block_number = int(anvil.rpc(chain["rpc_url"], "eth_blockNumber", timeout=1), 16)
                    if chain.get("usdc_address"):
                        code = anvil.rpc(chain["rpc_url"], "eth_getCode", [chain["usdc_address"], "latest"], timeout=1)
                    reachable = True
            except (requests.RequestException, RuntimeError, ValueError):
                pass
        networks[network] = {
            "chain_id": chain["chain_id"],
            "rpc_url": chain["rpc_url"],
            "pid": chain["pid"],
            "pid_alive": alive,
            "rpc_reachable": reachable,
            "block_number": block_number,
            "usdc_address": chain.get("usdc_address"),
            "token_deployed": bool(code and code != "0x"),
        }
    solana = _solana_status(state.get("solana"))
    healthy = (
        state.get("complete")
        and all(n["rpc_reachable"] and n["token_deployed"] for n in networks.values())
        and solana is not None
        and solana["rpc_reachable"]
        and solana["mint_exists"]
    )
    return {
        "state": "running" if healthy else "degraded",
        "running": bool(healthy),
        "started_at": state.get("started_at"),
        "chains_file": state.get("chains_file"),
        "networks": networks,
        "solana": solana,
    }


def _solana_status(entry: dict[str, Any] | None) -> dict[str, Any] | None:
    if entry is None:
        return None
    alive = _solana_alive(entry)
    slot = None
    mint_exists = reachable = False
    if alive:
        try:
            if solana_network.is_local_genesis(anvil.rpc(entry["rpc_url"], "getGenesisHash", timeout=1)):
                slot = anvil.rpc(entry["rpc_url"], "getSlot", timeout=1)
                mint = anvil.rpc(entry["rpc_url"], "getAccountInfo", [entry["usdc_mint"], {"encoding": "base64"}])
                mint_exists = mint["value"] is not None
                reachable = True
        except (requests.RequestException, RuntimeError, ValueError, TypeError, KeyError):
            pass
    return {
        "network": entry["network"],
        "rpc_url": entry["rpc_url"],
        "pid": entry["pid"],
        "pid_alive": alive,
        "rpc_reachable": reachable,
        "slot": slot,
        "usdc_mint": entry["usdc_mint"],
        "mint_exists": mint_exists,
        "fee_payer": entry["fee_payer"],
    }


# --- start-up ----------------------------------------------------------------------------------


def _start(workdir: Path, port_base: int, *, owned: bool = False) -> dict[str, Any]:
    from eth_account import Account
    from solders.keypair import Keypair

    binary = _binary()
    ports = {c.network: port_base + i for i, c in enumerate(LOCAL_CHAINS)}
    solana_port = port_base + len(LOCAL_CHAINS)
    taken = [p for p in [*ports.values(), solana_port] if not anvil.port_is_free(p)]
    if taken:
        raise DevnetError("PORT_IN_USE", _ports_taken_message(taken))
    deployer = Account.create()
    buyers = [Account.create() for _ in range(BUYERS)]
    relays = [Account.create() for _ in range(RELAYS)]
    solana_mint, solana_authority, solana_relay = Keypair(), Keypair(), Keypair()
    solana_buyers = [Keypair() for _ in range(SOLANA_BUYERS)]
    state: dict[str, Any] = {
        "version": STATE_VERSION,
        "complete": False,
        "started_at": datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "port_base": port_base,
        "chains_file": str(workdir / "chains.json"),
        "relay_keys_file": str(workdir / "relay_keys.json"),
        "deployer": _keypair(deployer),
        "buyers": [_keypair(b) for b in buyers],
        "solana_buyers": [_solana_keypair(b) for b in solana_buyers],
        "solana_mint_authority": _solana_keypair(solana_authority),
        "networks": {},
    }
    if owned:
        me = psutil.Process()
        state["owner"] = {"pid": me.pid, "create_time": me.create_time(), "command": " ".join(me.cmdline()[:3])}
    spawned_before = set(anvil.spawned_pids())
    try:
        for chain in LOCAL_CHAINS:
            port = ports[chain.network]
            spawned = anvil.spawn(
                binary,
                port=port,
                chain_id=chain.chain_id,
                cache_dir=workdir / "cache" / str(chain.chain_id),
                log_file=workdir / f"anvil-{chain.chain_id}.log",
                cwd=workdir,
                die_with_parent=owned,
            )
            state["networks"][chain.network] = {
                "name": chain.name,
                "chain_id": chain.chain_id,
                "port": port,
                "rpc_url": f"http://{anvil.HOST}:{port}",
                "pid": spawned.pid,
                "create_time": spawned.create_time,
                "log": str(workdir / f"anvil-{chain.chain_id}.log"),
                "usdc_address": None,
            }
            _write_json(workdir / "state.json", state, 0o600)  # recorded at once, so `down` can always stop it
        state["solana"] = _spawn_solana(
            workdir, solana_port, solana_mint, solana_authority, solana_relay, solana_buyers, owned
        )
        _write_json(workdir / "state.json", state, 0o600)
        for chain in LOCAL_CHAINS:
            entry = state["networks"][chain.network]
            anvil.wait_ready(entry["rpc_url"], entry["pid"], chain.chain_id, Path(entry["log"]))
        for chain in LOCAL_CHAINS:
            entry = state["networks"][chain.network]
            entry["usdc_address"] = _deploy_and_fund(entry["rpc_url"], chain.chain_id, deployer, buyers, relays)
        solana = state["solana"]
        solana_process.wait_ready(solana["rpc_url"], solana["pid"], solana["usdc_mint"], Path(solana["log"]))
        (workdir / SOLANA_SETUP_FILE).unlink(missing_ok=True)  # it held the mint's keys; the RPC has read it
        relay_keys: dict[str, list[str]] = {c.network: [_hex_key(r) for r in relays] for c in LOCAL_CHAINS}
        relay_keys[solana_network.NETWORK] = [str(solana_relay)]
        _write_json(workdir / "relay_keys.json", relay_keys, 0o600)
        _write_json(workdir / "chains.json", _chains_document(state, relays), 0o644)
        state["complete"] = True
        _write_json(workdir / "state.json", state, 0o600)
    except anvil.AnvilError as exc:
        _abort(workdir, state, spawned_before)
        raise DevnetError(exc.code, exc.message) from None
    except BaseException:  # also a stop signal in the middle (payintent dev's handler raises one)
        _abort(workdir, state, spawned_before)
        raise
    return _summary(state)


def _abort(workdir: Path, state: dict[str, Any], spawned_before: set[int]) -> None:
    """Stop what this start-up recorded, and any process it spawned but had not recorded yet."""
    stopped = set(_stop_state(state))
    anvil.stop([pid for pid in anvil.spawned_pids() if pid not in spawned_before and pid not in stopped])
    (workdir / "state.json").unlink(missing_ok=True)
    (workdir / SOLANA_SETUP_FILE).unlink(missing_ok=True)


def _ports_taken_message(taken: list[int]) -> str:
    """Which ports are taken and by what; a devnet's own process is named as such, with how to stop it."""
    holders = [anvil.describe_holder(port) for port in taken]
    text = f"{', '.join(holders)} {'is' if len(taken) == 1 else 'are'} already in use on {anvil.HOST}"
    if any("anvil" in h or "devnet.solana_rpc" in h for h in holders):
        text += (
            ": a payintent devnet left running (by `payintent devnet up`, or by a `payintent dev` that was killed); "
            "`payintent devnet down` with its PAYINTENT_VAR_DIR stops it"
        )
    return text + "; stop what holds them or pass --port-base (PAYINTENT_DEVNET_PORT_BASE)"


def _spawn_solana(
    workdir: Path, port: int, mint: Keypair, authority: Keypair, relay: Keypair, buyers: list[Keypair], owned: bool
) -> dict[str, Any]:
    """Start the Solana RPC; it creates the mint and funds the relay (SOL) and buyers (SOL, USDC) itself."""
    from devnet.solana_setup import setup_document

    accounts = [(str(relay.pubkey()), SOLANA_RELAY_SOL, 0)]
    accounts += [(str(b.pubkey()), SOLANA_BUYER_SOL, BUYER_USDC) for b in buyers]
    setup_file = workdir / SOLANA_SETUP_FILE
    _write_json(setup_file, setup_document(mint, authority, accounts), 0o600)
    log = workdir / "solana-rpc.log"
    spawned = solana_process.spawn(port=port, setup_file=setup_file, log_file=log, cwd=workdir, die_with_parent=owned)
    return {
        "name": solana_network.NAME,
        "network": solana_network.NETWORK,
        "port": port,
        "rpc_url": f"http://{anvil.HOST}:{port}",
        "pid": spawned.pid,
        "create_time": spawned.create_time,
        "log": str(log),
        "usdc_mint": str(mint.pubkey()),
        "fee_payer": str(relay.pubkey()),
    }


def _binary() -> str:
    try:
        return anvil.anvil_binary()
    except anvil.AnvilError as exc:
        raise DevnetError(exc.code, exc.message) from None


def _deploy_and_fund(
    rpc_url: str, chain_id: int, deployer: LocalAccount, buyers: list[LocalAccount], relays: list[LocalAccount]
) -> str:
    """Give the deployer and relays ETH, deploy TestUSDC (owner: the deployer), mint to every buyer."""
    from web3 import Web3
    from web3.types import RPCEndpoint

    w3 = Web3(Web3.HTTPProvider(rpc_url, request_kwargs={"timeout": 10}, exception_retry_configuration=None))
    w3.provider.make_request(RPCEndpoint("anvil_setBalance"), [deployer.address, hex(DEPLOYER_ETH)])
    for relay in relays:
        w3.provider.make_request(RPCEndpoint("anvil_setBalance"), [relay.address, hex(RELAY_ETH)])
    artifact = json.loads(ARTIFACT.read_text())
    factory = w3.eth.contract(abi=artifact["abi"], bytecode=artifact["bytecode"])
    receipt = _send(w3, deployer, factory.constructor(deployer.address), chain_id, nonce=0)
    token = w3.eth.contract(address=receipt["contractAddress"], abi=artifact["abi"])
    hashes = [
        _submit(w3, deployer, token.functions.mint(buyer.address, BUYER_USDC), chain_id, nonce=1 + i)
        for i, buyer in enumerate(buyers)
    ]
    for tx_hash in hashes:
        if w3.eth.wait_for_transaction_receipt(tx_hash, timeout=10)["status"] != 1:
            raise DevnetError("DEPLOY_FAILED", f"minting test USDC on chain {chain_id} failed")
    return Web3.to_checksum_address(receipt["contractAddress"])


def _submit(w3: Web3, sender: LocalAccount, call: Any, chain_id: int, *, nonce: int) -> Any:
    tx = call.build_transaction({"from": sender.address, "nonce": nonce, "chainId": chain_id})
    return w3.eth.send_raw_transaction(sender.sign_transaction(tx).raw_transaction)


def _send(w3: Web3, sender: LocalAccount, call: Any, chain_id: int, *, nonce: int) -> Any:
    receipt = w3.eth.wait_for_transaction_receipt(_submit(w3, sender, call, chain_id, nonce=nonce), timeout=10)
    if receipt["status"] != 1:
        raise DevnetError("DEPLOY_FAILED", f"deploying test USDC on chain {chain_id} failed")
    return receipt


def _chains_document(state: dict[str, Any], relays: list[LocalAccount]) -> dict[str, Any]:
    solana = state["solana"]
    return {
        "_comment": "Written by `payintent devnet up`: local Anvil chains, a local Solana RPC. Point CHAINS_FILE here.",
        "networks": [
            {
                "network": network,
                "name": entry["name"],
                "kind": "evm",
                "rpc_url": entry["rpc_url"],
                "wallet_rpc_url": entry["rpc_url"],
                "usdc_address": entry["usdc_address"],
                "usdc_domain_name": "USDC",
                "usdc_domain_version": "2",
                "confirmations": 1,
                "relay_addresses": [r.address for r in relays],
            }
            for network, entry in state["networks"].items()
        ]
        + [
            {
                "network": solana["network"],
                "name": solana["name"],
                "kind": "solana",
                "rpc_url": solana["rpc_url"],
                "usdc_address": solana["usdc_mint"],
                "fee_payer": solana["fee_payer"],
                "wallet_chain": "solana:localnet",
                "confirmations": 1,
            }
        ],
        "relay_keys_file": state["relay_keys_file"],
    }


def _summary(state: dict[str, Any]) -> dict[str, Any]:
    """What ``devnet up`` prints."""
    return {
        "chains_file": state["chains_file"],
        "relay_keys_file": state["relay_keys_file"],
        "networks": {
            network: {"rpc_url": entry["rpc_url"], "chain_id": entry["chain_id"], "usdc_address": entry["usdc_address"]}
            for network, entry in state["networks"].items()
        },
        "buyers": state["buyers"],
        "solana": {k: state["solana"][k] for k in ("network", "rpc_url", "usdc_mint", "fee_payer")},
        "solana_buyers": state["solana_buyers"],
    }


# --- state ---------------------------------------------------------------------------------------


def _chain_alive(chain: dict[str, Any]) -> bool:
    return anvil.is_our_anvil(chain["pid"], chain.get("create_time"), chain["port"])


def _solana_alive(entry: dict[str, Any]) -> bool:
    return solana_process.is_ours(entry["pid"], entry.get("create_time"), entry["port"])


def _owner_alive(owner: dict[str, Any]) -> bool:
    """Whether the ``payintent dev`` that owns a devnet still runs (not a recycled pid)."""
    try:
        proc = psutil.Process(owner["pid"])
        return proc.status() != psutil.STATUS_ZOMBIE and abs(proc.create_time() - owner.get("create_time", 0)) < 1.0
    except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError, TypeError):
        return False


def _all_alive(state: dict[str, Any]) -> bool:
    solana = state.get("solana")
    return all(_chain_alive(c) for c in state["networks"].values()) and solana is not None and _solana_alive(solana)


def _stop_state(state: dict[str, Any]) -> list[int]:
    ours = [c["pid"] for c in state.get("networks", {}).values() if _chain_alive(c)]
    solana = state.get("solana")
    if solana is not None and _solana_alive(solana):
        ours.append(solana["pid"])
    return anvil.stop(ours)


def _read_state(workdir: Path) -> dict[str, Any] | None:
    path = workdir / "state.json"
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as exc:
        raise DevnetError("INVALID_STATE", f"cannot read {path}: {exc}; stop any anvil by hand and delete it") from None
    if not (
        isinstance(state, dict) and state.get("version") == STATE_VERSION and isinstance(state.get("networks"), dict)
    ):
        raise DevnetError("INVALID_STATE", f"{path} is not a devnet state file; stop any anvil by hand and delete it")
    return state


def _write_json(path: Path, document: Any, mode: int) -> None:
    """Write atomically, with exactly ``mode`` from the first byte (keys never sit in a readable file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as out:
        os.fchmod(out.fileno(), mode)
        out.write(json.dumps(document, indent=2) + "\n")
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(workdir: Path) -> Iterator[None]:
    """One ``up`` or ``down`` at a time per var dir."""
    with (workdir / ".lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _keypair(account: LocalAccount) -> dict[str, str]:
    return {"address": account.address, "private_key": _hex_key(account)}


def _hex_key(account: LocalAccount) -> str:
    return "0x" + bytes(account.key).hex()


def _solana_keypair(keypair: Keypair) -> dict[str, str]:
    """A Solana account: its address and its secret key as a base58 64-byte keypair (the wallets' form)."""
    return {"address": str(keypair.pubkey()), "secret_key": str(keypair)}
