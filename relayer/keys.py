"""Relay keys: loaded by the relayer process only, never logged, never stored in the database.

Sources, first found wins: ``RELAY_KEYS`` (JSON ``{network: [hex key, ...]}``), the file named by
``RELAY_KEYS_FILE``, or the ``relay_keys_file`` named in the chains file (``payintent devnet up``
writes one, mode 0600).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from backend.chains.registry import ChainRegistry
from backend.rails.base import RelayKeyError as RelayKeyError  # the message holds no key
from backend.rails.base import RelayKeys
from backend.rails.registry import rail_for


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


def load_relay_keys(registry: ChainRegistry) -> dict[str, RelayKeys]:
    """Each configured network's relay keys, loaded by its rail (EVM: hex private keys matching relay_addresses;
    Solana: the base58 fee-payer keypair matching fee_payer); networks the chains file does not have are skipped."""
    loaded: dict[str, RelayKeys] = {}
    for network_id, secrets in _read_keys(registry).items():
        network = registry.get(network_id)
        if network is None:
            continue
        keys = rail_for(network).load_relay_keys(network, secrets)
        if keys is not None:
            loaded[network_id] = keys
    return loaded
