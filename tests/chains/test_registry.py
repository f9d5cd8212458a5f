from __future__ import annotations

import json

import pytest

from backend.chains.registry import ChainConfigError, ChainRegistry


def test_default_registry_lists_the_four_testnets():
    registry = ChainRegistry.load()
    assert registry.ids() == [
        "eip155:84532",
        "eip155:11155111",
        "eip155:5042002",
        "solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1",
    ]
    base = registry.get("eip155:84532")
    assert base.chain_id == 84532 and base.usdc_domain_name == "USDC" and base.kind == "evm"
    assert "rpc_url" not in base.public()


def test_rpc_url_can_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("BASE_SEPOLIA_RPC_URL", "https://rpc.example/key")
    assert ChainRegistry.load().get("eip155:84532").rpc_url == "https://rpc.example/key"


@pytest.mark.parametrize(
    "document",
    [
        {
            "networks": [
                {
                    "network": "eip155:x",
                    "usdc_address": "0x036CbD53842c5426634e7929541eC2318f3dCF7e",
                    "usdc_domain_name": "USDC",
                }
            ]
        },
        {"networks": [{"network": "eip155:1", "usdc_address": "0x12", "usdc_domain_name": "USDC"}]},
        {"networks": [{"network": "eip155:1"}]},
        {
            "networks": [
                {
                    "network": "eip155:1",
                    "usdc_address": "0x036CbD53842c5426634e7929541eC2318f3dCF7e",
                    "usdc_domain_name": "USDC",
                    "decimals": 18,
                }
            ]
        },
        {"nets": []},
    ],
)
def test_bad_chains_files_are_refused_clearly(tmp_path, document):
    path = tmp_path / "chains.json"
    path.write_text(json.dumps(document))
    with pytest.raises(ChainConfigError):
        ChainRegistry.load(path)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ChainConfigError, match="cannot read"):
        ChainRegistry.load(tmp_path / "nope.json")


def test_domain_name_may_be_left_to_the_chain(tmp_path):
    path = tmp_path / "chains.json"
    path.write_text(
        json.dumps(
            {"networks": [{"network": "eip155:1", "usdc_address": "0x036CbD53842c5426634e7929541eC2318f3dCF7e"}]}
        )
    )
    network = ChainRegistry.load(path).get("eip155:1")
    assert network.usdc_domain_name is None  # read from the token's name() when first needed
