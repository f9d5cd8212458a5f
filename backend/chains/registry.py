"""Load and query the configured networks.

A chains file is JSON: ``{"networks": [{network, name, kind, rpc_url, usdc_address, ...}]}``.
A network may list its ``relay_addresses`` (the accounts that pay gas for settlements); the
document may name a ``relay_keys_file`` (resolved against the chains file's folder). Only the
relayer reads that file: the API never opens it.
``CHAINS_FILE`` names it; unset, the public testnets in ``testnets.json`` are used, so intents
can be created without reaching any RPC.

x402 v1 clients name networks by a short name (``base-sepolia``), v2 clients by CAIP-2 id
(``eip155:84532``). Each network has an ``x402_v1_name``: the chains file's, else the one the
public x402 libraries use for its chain id or genesis hash (:data:`DEFAULT_X402_V1_NAMES`).
:func:`resolve_x402_network` turns either form into the CAIP-2 id; it is the only place v1 names
are read, so a local chain with a testnet's chain id (the devnet) resolves like the testnet.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.chains.addresses import AddressError, normalize_evm_address, normalize_solana_address
from payintent.x402 import V1_NETWORK_NAMES

DEFAULT_CHAINS_FILE = Path(__file__).with_name("testnets.json")


@dataclass(frozen=True)
class _KindRules:
    """What the chains file's loader must know of a chain kind to read a network's entry (it sits below the rails,
    which serve the kinds: ``backend.rails.registry``). The one table of kinds below the rails."""

    namespace: str  # the CAIP-2 namespace of its network ids
    id_form: str  # how its network ids look, for the error text
    valid_reference: Callable[[str], bool]  # the CAIP-2 reference's syntax
    normalize: Callable[[str], str]  # an address's canonical form (AddressError otherwise)
    eip3085: bool  # wallets add its networks by chain id with a native currency (EIP-3085); else Wallet Standard


_KIND_RULES = {
    "evm": _KindRules(
        "eip155", "EVM network ids look like eip155:<chain id>", str.isdigit, normalize_evm_address, True
    ),
    "solana": _KindRules(
        "solana", "Solana network ids look like solana:<genesis>", lambda _: True, normalize_solana_address, False
    ),
}
KINDS = tuple(_KIND_RULES)
# A network id of no known namespace is read as this kind's, whose id check then names the expected form.
_FALLBACK_KIND = KINDS[-1]


class ChainConfigError(ValueError):
    """The chains file is missing, unreadable or inconsistent."""


@dataclass(frozen=True)
class Network:
    network: str  # CAIP-2 id, e.g. "eip155:84532"
    name: str
    kind: str  # "evm" | "solana"
    rpc_url: str | None
    usdc_address: str
    usdc_domain_name: str | None = None
    usdc_domain_version: str = "2"
    decimals: int = 6
    confirmations: int = 1
    explorer_tx_url: str | None = None
    fee_payer: str | None = None  # Solana: the relay account that pays fees
    relay_addresses: tuple[str, ...] = ()  # EVM: the accounts that submit settlements and pay gas
    # For buyers' wallets (never the relayer's rpc_url, which may embed a provider key):
    wallet_rpc_url: str | None = None  # EVM: offered in wallet_addEthereumChain
    native_currency: tuple[str, str, int] = ("Ether", "ETH", 18)  # EVM: (name, symbol, decimals) of the gas coin
    wallet_chain: str | None = None  # Solana: the Wallet Standard chain, e.g. "solana:devnet"
    x402_v1_name: str | None = None  # the x402 v1 network name, e.g. "base-sepolia" (None: v2 clients only)

    @property
    def chain_id(self) -> int | None:
        if not _KIND_RULES[self.kind].eip3085:
            return None
        return int(self.network.split(":", 1)[1])

    def public(self) -> dict[str, Any]:
        """What clients may see (no RPC URL: it may embed a provider key)."""
        return {
            "network": self.network,
            "name": self.name,
            "kind": self.kind,
            "chain_id": self.chain_id,
            "asset": self.usdc_address,
            "usdcDomainName": self.usdc_domain_name,
            "decimals": self.decimals,
        }

    def for_wallets(self) -> dict[str, Any]:
        """What a buyer's browser needs to reach this network in a wallet (the checkout page)."""
        name, symbol, decimals = self.native_currency
        return {
            "network": self.network,
            "name": self.name,
            "kind": self.kind,
            "chain_id": self.chain_id,
            "wallet_rpc_url": self.wallet_rpc_url,
            "native_currency": (
                {"name": name, "symbol": symbol, "decimals": decimals} if _KIND_RULES[self.kind].eip3085 else None
            ),
            "wallet_chain": self.wallet_chain,
            "explorer_tx_url": self.explorer_tx_url,
        }


def _parse_network(raw: dict[str, Any], source: str) -> Network:
    try:
        network_id = str(raw["network"])
        namespace, colon, reference = network_id.partition(":")
        by_namespace = {rules.namespace: kind for kind, rules in _KIND_RULES.items()}
        kind = str(raw.get("kind") or by_namespace.get(namespace, _FALLBACK_KIND))
        if kind not in KINDS:
            raise ChainConfigError(f"{source}: {network_id}: kind must be one of {KINDS}")
        rules = _KIND_RULES[kind]
        if not colon or namespace != rules.namespace or not rules.valid_reference(reference):
            raise ChainConfigError(f"{source}: {rules.id_form}, not {network_id}")
        address = rules.normalize(str(raw["usdc_address"]))
        rpc_url = raw.get("rpc_url")
        env_name = raw.get("rpc_url_env")
        if env_name and os.environ.get(env_name):
            rpc_url = os.environ[env_name]
        relay_addresses = _parse_relay_addresses(raw.get("relay_addresses", []), kind, network_id, source)
        decimals = int(raw.get("decimals", 6))
        if decimals != 6:
            raise ChainConfigError(f"{source}: {network_id}: USDC must have 6 decimals")
        return Network(
            network=network_id,
            wallet_rpc_url=raw.get("wallet_rpc_url"),
            native_currency=_parse_native_currency(raw.get("native_currency"), network_id, source),
            wallet_chain=raw.get("wallet_chain") or _WALLET_CHAINS.get(network_id),
            name=str(raw.get("name") or network_id),
            kind=kind,
            rpc_url=rpc_url,
            usdc_address=address,
            usdc_domain_name=raw.get("usdc_domain_name"),
            usdc_domain_version=str(raw.get("usdc_domain_version", "2")),
            decimals=decimals,
            confirmations=int(raw.get("confirmations", 1)),
            explorer_tx_url=raw.get("explorer_tx_url"),
            fee_payer=raw.get("fee_payer"),
            relay_addresses=relay_addresses,
            x402_v1_name=_parse_x402_v1_name(raw, network_id, source),
        )
    except KeyError as exc:
        raise ChainConfigError(f"{source}: a network lacks {exc.args[0]!r}") from None
    except AddressError as exc:
        raise ChainConfigError(f"{source}: {raw.get('network')}: usdc_address {exc}") from None


# Wallet Standard names of the public Solana clusters, by genesis hash (CAIP-2 reference).
_WALLET_CHAINS = {
    "solana:5eykt4UsFv8P8NJdTREpY1vzqKqZKvdp": "solana:mainnet",
    "solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1": "solana:devnet",
    "solana:4uhcVJyU9pJkvQyS88uRDiswHXSCkY3z": "solana:testnet",
}


# x402 v1 network names by CAIP-2 id: one table, shared with the client package (payintent.x402).
DEFAULT_X402_V1_NAMES = V1_NETWORK_NAMES
_DEFAULT_BY_V1_NAME = {name: network_id for network_id, name in DEFAULT_X402_V1_NAMES.items()}
_V1_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")


def default_x402_v1_name(network_id: str) -> str | None:
    """The x402 v1 name the public libraries use for a CAIP-2 id (by chain id or genesis), if any."""
    return DEFAULT_X402_V1_NAMES.get(network_id)


def _parse_x402_v1_name(raw: dict[str, Any], network_id: str, source: str) -> str | None:
    """``x402_v1_name`` from the chains file: a name, or null for none; absent: the default."""
    if "x402_v1_name" not in raw:
        return default_x402_v1_name(network_id)
    name = raw["x402_v1_name"]
    if name is None:
        return None
    if not isinstance(name, str) or not _V1_NAME_RE.match(name):
        raise ChainConfigError(
            f"{source}: {network_id}: x402_v1_name is a lower-case name like base-sepolia (no ':'), or null"
        )
    return name


def _parse_native_currency(raw: Any, network_id: str, source: str) -> tuple[str, str, int]:
    if raw is None:
        return ("Ether", "ETH", 18)
    try:
        return (str(raw["name"]), str(raw["symbol"]), int(raw["decimals"]))
    except (TypeError, KeyError, ValueError):
        raise ChainConfigError(f"{source}: {network_id}: native_currency is {{name, symbol, decimals}}") from None


def _parse_relay_addresses(raw: Any, kind: str, network_id: str, source: str) -> tuple[str, ...]:
    if not isinstance(raw, list):
        raise ChainConfigError(f"{source}: {network_id}: relay_addresses must be a list")
    normalize = _KIND_RULES[kind].normalize
    try:
        return tuple(normalize(str(address)) for address in raw)
    except AddressError as exc:
        raise ChainConfigError(f"{source}: {network_id}: relay_addresses {exc}") from None


class ChainRegistry:
    def __init__(self, networks: list[Network], relay_keys_file: str | None = None) -> None:
        self._by_id = {n.network: n for n in networks}
        # Where the relayer finds its private keys; only the relayer reads it.
        self.relay_keys_file = relay_keys_file
        if len(self._by_id) != len(networks):
            raise ChainConfigError("a network is listed twice")
        self._by_v1_name: dict[str, Network] = {}
        for n in networks:
            if n.x402_v1_name is None:
                continue
            if n.x402_v1_name in self._by_v1_name:
                raise ChainConfigError(f"x402_v1_name {n.x402_v1_name!r} is given to two networks")
            self._by_v1_name[n.x402_v1_name] = n

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None) -> ChainRegistry:
        source = Path(path) if path else DEFAULT_CHAINS_FILE
        try:
            document = json.loads(source.read_text())
        except OSError as exc:
            raise ChainConfigError(f"cannot read chains file {source}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ChainConfigError(f"chains file {source} is not valid JSON: {exc}") from None
        raw_networks = document.get("networks") if isinstance(document, dict) else None
        if not isinstance(raw_networks, list):
            raise ChainConfigError(f"chains file {source} has no 'networks' list")
        relay_keys_file = document.get("relay_keys_file")
        if relay_keys_file is not None:
            if not isinstance(relay_keys_file, str) or not relay_keys_file:
                raise ChainConfigError(f"chains file {source}: relay_keys_file must be a path")
            relay_keys_file = str((source.resolve().parent / relay_keys_file).resolve())
        return cls([_parse_network(raw, str(source)) for raw in raw_networks], relay_keys_file=relay_keys_file)

    def get(self, network_id: str) -> Network | None:
        return self._by_id.get(network_id)

    def __contains__(self, network_id: object) -> bool:
        return network_id in self._by_id

    def __iter__(self) -> Iterator[Network]:
        return iter(self._by_id.values())

    def ids(self) -> list[str]:
        return list(self._by_id)

    def by_x402_v1_name(self, name: str) -> Network | None:
        """The configured network with this x402 v1 name (``base-sepolia``), if any."""
        return self._by_v1_name.get(name)

    def resolve_network(self, name: str) -> str:
        """A network as an x402 client names it (CAIP-2 id or v1 name) -> its CAIP-2 id.

        A configured network's v1 name first, then the libraries' table; anything else
        (an unknown name, a CAIP-2 id) is returned as given.
        """
        network = self._by_v1_name.get(name)
        if network is not None:
            return network.network
        return resolve_x402_network(name)


def resolve_x402_network(name: str, registry: ChainRegistry | None = None) -> str:
    """An x402 network name (CAIP-2 id or v1 name such as ``base-sepolia``) -> the CAIP-2 id.

    With a registry, its networks' configured ``x402_v1_name`` come first. Unknown names and
    CAIP-2 ids are returned unchanged (whoever looks the id up reports what is not offered).
    """
    if registry is not None:
        return registry.resolve_network(name)
    if ":" in name:
        return name
    return _DEFAULT_BY_V1_NAME.get(name, name)
