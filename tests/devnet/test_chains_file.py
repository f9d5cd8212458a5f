"""The chains-file fields the devnet writes for the relayer: ``relay_addresses`` and ``relay_keys_file``."""

from __future__ import annotations

import json

import pytest

from backend.chains.registry import ChainConfigError, ChainRegistry

TOKEN = "0x036CbD53842c5426634e7929541eC2318f3dCF7e"
RELAY = "0x70997970C51812dc3A010C7d01b50e0d17dc79C8"


def _network(**extra):
    return {"network": "eip155:84532", "usdc_address": TOKEN, "usdc_domain_name": "USDC", **extra}


def _load(tmp_path, document):
    path = tmp_path / "conf" / "chains.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(document))
    return ChainRegistry.load(path)


def test_relay_fields_are_optional():
    registry = ChainRegistry.load()
    assert registry.relay_keys_file is None
    assert all(n.relay_addresses == () for n in registry)


def test_relay_addresses_are_checksummed_and_the_key_file_is_resolved_next_to_the_chains_file(tmp_path):
    registry = _load(
        tmp_path, {"networks": [_network(relay_addresses=[RELAY.lower()])], "relay_keys_file": "keys/relay.json"}
    )
    assert registry.get("eip155:84532").relay_addresses == (RELAY,)
    assert registry.relay_keys_file == str(tmp_path / "conf" / "keys" / "relay.json")
    assert not (tmp_path / "conf" / "keys").exists()  # named, never opened


def test_an_absolute_key_file_is_kept(tmp_path):
    registry = _load(tmp_path, {"networks": [_network()], "relay_keys_file": str(tmp_path / "k.json")})
    assert registry.relay_keys_file == str(tmp_path / "k.json")


@pytest.mark.parametrize(
    "document",
    [
        {"networks": [_network(relay_addresses=["0x12"])]},
        {"networks": [_network(relay_addresses=RELAY)]},
        {"networks": [_network()], "relay_keys_file": ""},
        {"networks": [_network()], "relay_keys_file": 7},
    ],
)
def test_bad_relay_fields_are_refused(tmp_path, document):
    with pytest.raises(ChainConfigError):
        _load(tmp_path, document)
