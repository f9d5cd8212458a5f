"""/healthz says the process is up; /readyz says whether the database, Redis and every chain's RPC answer."""

from __future__ import annotations

import json
import time

from backend.app import create_app
from backend.chains.registry import ChainRegistry
from tests.conftest import free_port, make_settings
from tests.observability.conftest import BASE_SEPOLIA, SOLANA, chains_file, evm_network

SEPOLIA = "eip155:11155111"


def ready_app(db_url, redis_url, path):
    return create_app(make_settings(db_url, redis_url=redis_url, chains_file=str(path)), ChainRegistry.load(str(path)))


def two_chains(tmp_path, stub_rpc, solana_url=None):
    """Base Sepolia on the stub, Solana on ``solana_url`` (the stub too unless given)."""
    solana = {"network": SOLANA, "rpc_url": solana_url or stub_rpc.url,
              "usdc_address": "4zMMC9srt5Ri5X14GAgXhaHii3GnPAEERYPJgZJDncDU"}  # fmt: skip
    return chains_file(tmp_path / "chains.json", [evm_network(stub_rpc.url), solana])


def test_healthz_answers_without_touching_anything(client):
    response = client.get("/healthz")
    assert response.status_code == 200 and response.get_json() == {"status": "ok"}


def test_ready_when_database_redis_and_every_chain_answer(db_url, redis_url, stub_rpc, tmp_path):
    app = ready_app(db_url, redis_url, two_chains(tmp_path, stub_rpc))
    response = app.test_client().get("/readyz")
    assert response.status_code == 200
    body = response.get_json()
    assert body["status"] == "ready"
    assert set(body["checks"]) == {"database", "redis", "chains"}
    assert set(body["checks"]["chains"]) == {BASE_SEPOLIA, SOLANA}
    for check in [body["checks"]["database"], body["checks"]["redis"], *body["checks"]["chains"].values()]:
        assert check["ok"] is True and check["ms"] >= 0 and "error" not in check
    assert sorted(stub_rpc.calls) == ["eth_chainId", "getHealth"]


def test_not_ready_when_redis_is_down(db_url, stub_rpc, tmp_path):
    app = ready_app(db_url, f"redis://127.0.0.1:{free_port()}/0", two_chains(tmp_path, stub_rpc))
    response = app.test_client().get("/readyz")
    assert response.status_code == 503
    checks = response.get_json()["checks"]
    assert response.get_json()["status"] == "not_ready"
    assert checks["redis"]["ok"] is False and checks["redis"]["error"] == "ConnectionError"
    assert checks["database"]["ok"] is True
    assert all(c["ok"] for c in checks["chains"].values())


def test_not_ready_when_redis_is_not_configured(db_url, stub_rpc, tmp_path):
    app = ready_app(db_url, None, two_chains(tmp_path, stub_rpc))
    response = app.test_client().get("/readyz")
    assert response.status_code == 503
    assert response.get_json()["checks"]["redis"] == {"ok": False, "ms": response.get_json()["checks"]["redis"]["ms"],
                                                      "error": "REDIS_URL is not set"}  # fmt: skip


def test_not_ready_when_a_chain_rpc_is_down_and_the_answer_names_no_url(db_url, redis_url, stub_rpc, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}/v2/dead-provider-key-987654321"
    path = chains_file(tmp_path / "chains.json", [evm_network(stub_rpc.url), evm_network(dead, SEPOLIA)])
    started = time.monotonic()
    response = ready_app(db_url, redis_url, path).test_client().get("/readyz")
    assert time.monotonic() - started < 5  # a dead RPC costs at most its 2 s timeout
    assert response.status_code == 503
    body = response.get_json()
    assert body["checks"]["chains"][BASE_SEPOLIA]["ok"] is True
    assert body["checks"]["chains"][SEPOLIA] == {"ok": False, "ms": body["checks"]["chains"][SEPOLIA]["ms"],
                                                 "error": "ConnectionError"}  # fmt: skip
    assert body["checks"]["database"]["ok"] and body["checks"]["redis"]["ok"]
    text = response.get_data(as_text=True)
    assert "provider-key" not in text and "127.0.0.1" not in text  # RPC URLs may embed keys: never shown


def test_a_down_solana_rpc_is_named_by_its_network(db_url, redis_url, stub_rpc, tmp_path):
    path = two_chains(tmp_path, stub_rpc, solana_url=f"http://127.0.0.1:{free_port()}")
    response = ready_app(db_url, redis_url, path).test_client().get("/readyz")
    assert response.status_code == 503
    chains = response.get_json()["checks"]["chains"]
    assert chains[BASE_SEPOLIA]["ok"] is True
    assert chains[SOLANA]["ok"] is False
    assert chains[SOLANA]["error"] == "getHealth: RPC unreachable or malformed answer (ConnectionError)"


def test_an_rpc_of_another_chain_is_not_ready_and_probes_are_cached(db_url, redis_url, stub_rpc, tmp_path):
    stub_rpc.chain_id = 1  # a misconfigured URL: mainnet where Base Sepolia was meant
    path = chains_file(tmp_path / "chains.json", [evm_network(stub_rpc.url)])
    client = ready_app(db_url, redis_url, path).test_client()
    answers = [client.get("/readyz") for _ in range(5)]
    assert {a.status_code for a in answers} == {503}
    assert answers[0].get_json()["checks"]["chains"][BASE_SEPOLIA]["error"] == "answers chain id 1, not 84532"
    assert stub_rpc.calls == ["eth_chainId"]  # five probes, one RPC call: cached for a few seconds


def test_ready_on_the_devnet(pay_client, devnet):
    response = pay_client.get("/readyz")
    assert response.status_code == 200, response.data
    chains = response.get_json()["checks"]["chains"]
    assert set(chains) == {*devnet.networks, devnet.info["solana"]["network"]}  # three Anvils and the Solana RPC
    assert all(c["ok"] for c in chains.values())
    rpc_urls = [n["rpc_url"] for n in devnet.info["networks"].values()] + [devnet.info["solana"]["rpc_url"]]
    assert not any(url in response.get_data(as_text=True) for url in rpc_urls)
    assert json.loads(response.data)["status"] == "ready"
