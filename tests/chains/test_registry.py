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


def test_the_domain_name_is_the_files_else_read_once_from_the_chain(monkeypatch, tmp_path):
    """``chains.evm.domain_name`` (the EVM rail's): the chains file's name without any RPC, else the token's
    ``name()`` read once per network client; a chain that cannot be asked raises (intents answer 503)."""
    from backend.chains import evm

    calls: list[str] = []
    monkeypatch.setattr(evm.EvmChain, "token_name", lambda chain: calls.append(chain.network.network) or "USD Coin")
    monkeypatch.setattr(evm, "_chains", {})
    token = "0x036CbD53842c5426634e7929541eC2318f3dCF7e"
    path = tmp_path / "chains.json"
    path.write_text(json.dumps({"networks": [
        {"network": "eip155:1", "usdc_address": token, "usdc_domain_name": "USDC"},
        {"network": "eip155:2", "usdc_address": token, "rpc_url": "http://127.0.0.1:9"},
        {"network": "eip155:3", "usdc_address": token},
    ]}))  # fmt: skip
    registry = ChainRegistry.load(path)
    assert evm.domain_name(registry.get("eip155:1")) == "USDC" and calls == [] and evm._chains == {}
    assert [evm.domain_name(registry.get("eip155:2")) for _ in range(3)] == ["USD Coin"] * 3
    assert calls == ["eip155:2"]
    with pytest.raises(ValueError, match="no RPC URL"):
        evm.domain_name(registry.get("eip155:3"))


def test_x402_v1_names_default_to_the_libraries_names_by_chain_id_and_genesis():
    from backend.chains.registry import default_x402_v1_name, resolve_x402_network

    registry = ChainRegistry.load()
    names = {n.network: n.x402_v1_name for n in registry}
    assert names == {
        "eip155:84532": "base-sepolia",
        "eip155:11155111": "sepolia",
        "eip155:5042002": None,  # the x402 libraries have no v1 name for Arc Testnet
        "solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1": "solana-devnet",
    }
    assert default_x402_v1_name("eip155:8453") == "base" and default_x402_v1_name("eip155:999999") is None
    for name, network in [("base-sepolia", "eip155:84532"), ("sepolia", "eip155:11155111"), ("base", "eip155:8453"),
                          ("solana-devnet", "solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1"),
                          ("eip155:84532", "eip155:84532"), ("arc-testnet", "arc-testnet")]:  # fmt: skip
        assert resolve_x402_network(name) == network == registry.resolve_network(name)
        assert resolve_x402_network(name, registry) == network
    assert registry.by_x402_v1_name("base-sepolia").network == "eip155:84532"
    assert registry.by_x402_v1_name("base") is None  # a library name, but not configured here


def test_the_devnet_chains_resolve_like_the_testnets_they_stand_for(tmp_path):
    """Local chains keep the testnets' chain ids and Solana devnet's genesis, so their v1 names too."""
    path = tmp_path / "chains.json"
    path.write_text(json.dumps({"networks": [
        {"network": "eip155:84532", "name": "Base Sepolia (local)", "rpc_url": "http://127.0.0.1:1",
         "usdc_address": "0x5FbDB2315678afecb367f032d93F642f64180aa3"},
        {"network": "solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1", "kind": "solana", "rpc_url": "http://127.0.0.1:2",
         "usdc_address": "4zMMC9srt5Ri5X14GAgXhaHii3GnPAEERYPJgZJDncDU"},
    ]}))  # fmt: skip
    registry = ChainRegistry.load(path)
    assert registry.resolve_network("base-sepolia") == "eip155:84532"
    assert registry.resolve_network("solana-devnet") == "solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1"


def test_a_chains_file_can_name_or_unname_a_network(tmp_path):
    path = tmp_path / "chains.json"
    usdc = "0x036CbD53842c5426634e7929541eC2318f3dCF7e"
    path.write_text(json.dumps({"networks": [
        {"network": "eip155:5042002", "usdc_address": usdc, "x402_v1_name": "arc-testnet"},
        {"network": "eip155:84532", "usdc_address": usdc, "x402_v1_name": None},
    ]}))  # fmt: skip
    registry = ChainRegistry.load(path)
    assert registry.get("eip155:5042002").x402_v1_name == "arc-testnet"
    assert registry.resolve_network("arc-testnet") == "eip155:5042002"
    assert registry.get("eip155:84532").x402_v1_name is None  # published under no v1 name...
    assert registry.resolve_network("base-sepolia") == "eip155:84532"  # ...but the libraries' name still resolves


@pytest.mark.parametrize("name", ["Base Sepolia", "eip155:1", 5, "", "-x"])
def test_bad_x402_v1_names_are_refused(tmp_path, name):
    path = tmp_path / "chains.json"
    usdc = "0x036CbD53842c5426634e7929541eC2318f3dCF7e"
    path.write_text(json.dumps({"networks": [{"network": "eip155:1", "usdc_address": usdc, "x402_v1_name": name}]}))
    with pytest.raises(ChainConfigError, match="x402_v1_name"):
        ChainRegistry.load(path)


def test_a_v1_name_given_to_two_networks_is_refused(tmp_path):
    path = tmp_path / "chains.json"
    usdc = "0x036CbD53842c5426634e7929541eC2318f3dCF7e"
    path.write_text(json.dumps({"networks": [
        {"network": "eip155:5042002", "usdc_address": usdc, "x402_v1_name": "base-sepolia"},
        {"network": "eip155:84532", "usdc_address": usdc},
    ]}))  # fmt: skip
    with pytest.raises(ChainConfigError, match="two networks"):
        ChainRegistry.load(path)
