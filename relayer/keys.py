"""Relay keys: loaded by the relayer process only, never logged, never stored in the database.

Sources, first found wins: ``RELAY_KEYS`` (JSON ``{network: [hex key, ...]}``), the file named by
``RELAY_KEYS_FILE``, or the ``relay_keys_file`` named in the chains file (``payintent devnet up``
writes one, mode 0600).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from eth_account import Account
from eth_account.signers.local import LocalAccount
from solders.keypair import Keypair

from backend.chains.registry import ChainRegistry


class RelayKeyError(RuntimeError):
    """The relay keys are missing or do not match the chains file (the message holds no key)."""


def _parse(document: object, source: str) -> dict[str, list[str]]:
    if not isinstance(document, dict) or not all(
        isinstance(v, list) and all(isinstance(k, str) for k in v) for v in document.values()
    ):
        raise RelayKeyError(f"{source}: expected a JSON object of network -> list of hex private keys")
    return document


def _read_keys(registry: ChainRegistry) -> dict[str, list[str]]:
    raw = os.environ.get("RELAY_KEYS", "").strip()
    if raw:
        try:
            keys = _parse(json.loads(raw), "RELAY_KEYS")
        except json.JSONDecodeError:
            raise RelayKeyError("RELAY_KEYS is not valid JSON") from None
    else:
        path = os.environ.get("RELAY_KEYS_FILE", "").strip() or registry.relay_keys_file
        if not path:
            raise RelayKeyError("no relay keys: set RELAY_KEYS, RELAY_KEYS_FILE, or relay_keys_file in the chains file")
        try:
            keys = _parse(json.loads(Path(path).read_text()), str(path))
        except OSError as exc:
            raise RelayKeyError(f"cannot read relay key file {path}: {exc.strerror}") from None
        except json.JSONDecodeError:
            raise RelayKeyError(f"relay key file {path} is not valid JSON") from None
    return keys


def load_solana_relays(registry: ChainRegistry) -> dict[str, Keypair]:
    """The fee-payer keypair of each Solana network (base58 64-byte secret keys); must match fee_payer."""
    relays: dict[str, Keypair] = {}
    for network_id, secrets in _read_keys(registry).items():
        network = registry.get(network_id)
        if network is None or network.kind != "solana" or not secrets:
            continue
        try:
            keypair = Keypair.from_base58_string(secrets[0])
        except BaseException as exc:  # solders may panic on malformed input
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            raise RelayKeyError(f"the relay key for {network_id} is not a base58 Solana keypair") from None
        if network.fee_payer and str(keypair.pubkey()) != network.fee_payer:
            raise RelayKeyError(f"the relay key for {network_id} does not match fee_payer in the chains file")
        relays[network_id] = keypair
    return relays


def load_relay_accounts(registry: ChainRegistry) -> dict[str, list[LocalAccount]]:
    keys = _read_keys(registry)
    accounts: dict[str, list[LocalAccount]] = {}
    for network_id, hex_keys in keys.items():
        network = registry.get(network_id)
        if network is None or network.kind != "evm":
            continue
        try:
            loaded = [Account.from_key(k) for k in hex_keys]
        except Exception:
            raise RelayKeyError(f"a relay key for {network_id} is not a valid private key") from None
        expected = set(network.relay_addresses)
        if expected and {a.address for a in loaded} != expected:
            raise RelayKeyError(f"the relay keys for {network_id} do not match relay_addresses in the chains file")
        if loaded:
            accounts[network_id] = loaded
    return accounts
