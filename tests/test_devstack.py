"""`payintent dev` (make run): the stack comes up on embedded defaults, serves the demo key, stops cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import requests
from eth_account import Account
from solders.keypair import Keypair
from web3 import Web3

from devnet import free_port_base
from payintent.webhooks import verify_signature
from tests.conftest import free_port
from tests.webhooks.receiver import start_receiver

PAYINTENT = str(Path(sys.executable).with_name("payintent"))
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
AGENT_PAY = EXAMPLES / "agent_pay.py"
AGENT_SETTINGS = ("PAYINTENT_URL", "PAYINTENT_API_KEY", "BUYER_PRIVATE_KEY", "PAYINTENT_RPC_URLS")


def test_dev_stack_serves_the_seeded_demo_merchant(tmp_path):
    port = free_port()
    unset = ("DATABASE_URL", "REDIS_URL", "CHECKOUT_HOST", "CHAINS_FILE")  # CHAINS_FILE unset: the devnet starts
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env["PAYINTENT_VAR_DIR"] = str(tmp_path / "var")
    env["PAYINTENT_DEVNET_PORT_BASE"] = str(free_port_base())
    proc = subprocess.Popen(
        [PAYINTENT, "dev", "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        banner = ""
        deadline = time.monotonic() + 240  # the stack waits up to 180 s for its processes (harness/ready.py)
        while "Ctrl-C stops everything" not in banner:
            assert proc.poll() is None and time.monotonic() < deadline, banner
            banner += proc.stdout.readline()
        demo = json.loads((tmp_path / "var" / "demo.json").read_text())
        assert demo["api_key"] in banner and "curl" in banner
        # A checkout link to open in a browser, for a demo intent made at start-up.
        assert demo["checkout_url"] in banner and demo["checkout_url"].startswith(f"http://127.0.0.1:{port}/pay/")
        checkout_page = requests.get(demo["checkout_url"], timeout=10)
        assert checkout_page.status_code == 200 and 'src="/pay/assets/' in checkout_page.text
        assert (tmp_path / "var" / "payintent.db").exists()  # SQLite under var/ by default
        children = psutil.Process(proc.pid).children(recursive=True)
        assert any("redis-server" in " ".join(c.cmdline()) for c in children)  # a private, real Redis
        assert sum("anvil" in " ".join(c.cmdline()) for c in children) == 3  # the local devnet
        assert any("devnet.solana_rpc" in c.cmdline() for c in children)  # and its local Solana RPC
        assert any(c.cmdline()[-1:] == ["relayer"] for c in children)  # settles /pay
        chains = json.loads(Path(demo["chains_file"]).read_text())["networks"]
        assert [b["address"] in banner and b["private_key"] in banner for b in demo["buyers"]] == [True] * 3
        response = requests.post(
            f"http://127.0.0.1:{port}/api/v1/x402/intents",
            json={"amount_usdc": 10.5},
            headers={"Authorization": f"Bearer {demo['api_key']}"},
            timeout=10,
        )
        assert response.status_code == 201
        requirements = response.json()["data"]["payment_requirements"]
        assert len(requirements) == len(chains) == 4  # three EVM chains and Solana devnet (local)
        # The demo merchant is paid to accounts whose keys var/demo.json lists (a developer can sign as it).
        wallets = demo["merchant_wallets"]
        assert {r["network"]: r["payTo"] for r in requirements} == {n: w["address"] for n, w in wallets.items()}
        for network, wallet in wallets.items():
            if network.startswith("eip155:"):
                assert Account.from_key(wallet["private_key"]).address == wallet["address"]
            else:
                assert str(Keypair.from_base58_string(wallet["private_key"]).pubkey()) == wallet["address"]
        assert {r["asset"] for r in requirements} == {c["usdc_address"] for c in chains}

        # A merchant's local webhook receiver (make run allows private targets).
        receiver = start_receiver()
        hook = requests.post(
            f"http://127.0.0.1:{port}/api/v1/webhooks",
            json={"url": receiver.url("/hooks"), "events": ["payment.completed"]},
            headers={"Authorization": f"Bearer {demo['api_key']}"},
            timeout=10,
        )
        assert hook.status_code == 201, hook.text

        # The agent example pays a fresh intent on the devnet, end to end, with only var/demo.json.
        agent_env = {k: v for k, v in env.items() if k not in AGENT_SETTINGS}  # PAYINTENT_VAR_DIR stays
        paid = subprocess.run(
            [sys.executable, str(AGENT_PAY), "--amount", "1.25"],
            env=agent_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert paid.returncode == 0, paid.stderr
        summary = json.loads(paid.stdout.splitlines()[-1])
        assert f"tx_hash {summary['tx_hash']}" in paid.stdout
        rpc_url = demo["networks"][summary["network"]]["rpc_url"]
        receipt = Web3(Web3.HTTPProvider(rpc_url)).eth.get_transaction_receipt(summary["tx_hash"])
        assert receipt["status"] == 1
        assert summary["buyer_address"] == demo["buyers"][0]["address"] and summary["amount_usdc"] == 1.25
        intent = requests.get(
            f"http://127.0.0.1:{port}/api/v1/x402/intents/{summary['intent_id']}",
            headers={"Authorization": f"Bearer {demo['api_key']}"},
            timeout=10,
        ).json()["data"]
        assert intent["status"] == "paid" and intent["tx_hash"] == summary["tx_hash"]
        assert intent["chain"] == summary["network"] and intent["amount_usdc"] == 1.25
        # ... and on the local Solana, with the devnet's Solana buyer.
        paid_sol = subprocess.run(
            [sys.executable, str(AGENT_PAY), "--amount", "0.75", "--network", "solana"],
            env=agent_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert paid_sol.returncode == 0, paid_sol.stderr
        sol_summary = json.loads(paid_sol.stdout.splitlines()[-1])
        assert sol_summary["network"].startswith("solana:") and sol_summary["status"] == "paid"
        assert sol_summary["buyer_address"] == demo["solana_buyers"][0]["address"]
        assert f"tx_hash {sol_summary['tx_hash']}" in paid_sol.stdout
        status = requests.post(
            demo["solana"]["rpc_url"],
            json={"jsonrpc": "2.0", "id": 1, "method": "getSignatureStatuses",
                  "params": [[sol_summary["tx_hash"]], {"searchTransactionHistory": True}]},
            timeout=10,
        ).json()["result"]["value"][0]  # fmt: skip
        assert status is not None and status["err"] is None

        # The refund example refunds part of each, signed with the demo payout wallets' keys from var/demo.json.
        for paid_summary, amount in ((summary, "0.25"), (sol_summary, "0.5")):
            refunded = subprocess.run(
                [sys.executable, str(EXAMPLES / "refund.py"), "--intent-id", paid_summary["intent_id"],
                 "--amount", amount],
                env=agent_env, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert refunded.returncode == 0, refunded.stderr
            refund = json.loads(refunded.stdout.splitlines()[-1])
            assert refund["status"] == "succeeded" and refund["tx_hash"], refund
            assert refund["pay_to"] == paid_summary["buyer_address"] and str(refund["amount_usdc"]) == amount
            intent = requests.get(
                f"http://127.0.0.1:{port}/api/v1/x402/intents/{paid_summary['intent_id']}",
                headers={"Authorization": f"Bearer {demo['api_key']}"},
                timeout=10,
            ).json()["data"]
            assert str(intent["refunded_usdc"]) == amount and intent["refunds"][0]["tx_hash"] == refund["tx_hash"]

        deliveries = receiver.wait_for(2, timeout=5)  # payment.completed of both payments
        for delivered in deliveries:
            verify_signature(delivered.body, delivered.headers["Service-Signature"], hook.json()["data"]["secret"])
        envelopes = [json.loads(d.body) for d in deliveries]
        assert {e["event"] for e in envelopes} == {"payment.completed"}
        assert {e["data"]["tx_hash"] for e in envelopes} == {summary["tx_hash"], sol_summary["tx_hash"]}
        receiver.close()

        # "Sell to agents": agent_fetch.py buys GET /report from paywalled_api.py over HTTP 402.
        shop_port = free_port()
        shop = subprocess.Popen(
            [sys.executable, str(EXAMPLES / "paywalled_api.py"), "--port", str(shop_port), "--price", "0.05"],
            env=agent_env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        try:
            assert "selling GET" in shop.stdout.readline()
            fetched = subprocess.run(
                [sys.executable, str(EXAMPLES / "agent_fetch.py"), f"http://127.0.0.1:{shop_port}/report"],
                env=agent_env, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
        finally:
            shop.terminate()
            shop.wait(timeout=10)
        assert fetched.returncode == 0, fetched.stderr
        bought = json.loads(fetched.stdout.splitlines()[-1])
        assert bought["status"] == 200 and bought["spent_usdc"] == "0.05" and "report" in fetched.stdout
        paid = requests.get(
            f"http://127.0.0.1:{port}/api/v1/x402/intents",
            params={"status": "paid", "limit": 100},
            headers={"Authorization": f"Bearer {demo['api_key']}"},
            timeout=10,
        ).json()["data"]["intents"]
        (sale,) = [i for i in paid if i["tx_hash"] == bought["paid"]["transaction"]]  # recorded by the facilitator
        assert sale["metadata"]["x402_resource"].endswith("/report") and sale["amount_usdc"] == 0.05
        rpc_url = demo["networks"][sale["chain"]]["rpc_url"]
        assert Web3(Web3.HTTPProvider(rpc_url)).eth.get_transaction_receipt(sale["tx_hash"])["status"] == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    time.sleep(0.5)
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def test_the_relayer_starts_only_where_relay_keys_are_configured(tmp_path, monkeypatch):
    from backend.devstack import relay_keys_configured

    for name in ("RELAY_KEYS", "RELAY_KEYS_FILE", "CHAINS_FILE"):
        monkeypatch.delenv(name, raising=False)
    assert not relay_keys_configured()  # the public testnets: no relay keys, no relayer
    chains = tmp_path / "chains.json"
    chains.write_text(json.dumps({"networks": [], "relay_keys_file": "relay_keys.json"}))
    monkeypatch.setenv("CHAINS_FILE", str(chains))
    assert relay_keys_configured()  # as `devnet up` writes it
    monkeypatch.delenv("CHAINS_FILE")
    monkeypatch.setenv("RELAY_KEYS_FILE", str(tmp_path / "keys.json"))
    assert relay_keys_configured()
