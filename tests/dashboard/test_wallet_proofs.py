"""Payout wallets proven, not pasted: the dashboard's wallet signs the service's message naming the merchant and the
network (EIP-191 on EVM, ed25519 on Solana); a pasted address is unverified; the API says which is which."""

from __future__ import annotations

import base64
import re

from eth_account import Account
from eth_account.messages import encode_defunct
from solders.keypair import Keypair

from backend.merchants import proofs
from tests.dashboard.helpers import form_token, post, text

EVM = "eip155:84532"
SOLANA = "solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1"


def _headers(dashboard) -> dict[str, str]:
    return {"X-CSRF-Token": form_token(text(dashboard.get("/dashboard/wallets")))}


def _challenge(dashboard, headers, network: str, address: str):
    return dashboard.post(
        "/dashboard/wallets/challenge", json={"network": network, "address": address}, headers=headers
    )


def _prove(dashboard, headers, network: str, address: str, signature: str):
    body = {"network": network, "address": address, "signature": signature}
    return dashboard.post("/dashboard/wallets/prove", json=body, headers=headers)


def _evm_sign(account, message: str) -> str:
    return account.sign_message(encode_defunct(text=message)).signature.to_0x_hex()


def _api_wallets(client, merchant) -> dict[str, dict]:
    answer = client.get("/api/v1/wallets", headers=merchant.headers)
    assert answer.status_code == 200, answer.data
    return {w["network"]: w for w in answer.get_json()["data"]["wallets"]}


def test_an_evm_wallet_that_signs_the_message_becomes_the_verified_payout_wallet(client, merchant, dashboard):
    assert _api_wallets(client, merchant)[EVM]["verified"] is False  # pasted (the fixture's)
    wallet = Account.create()
    headers = _headers(dashboard)
    issued = _challenge(dashboard, headers, EVM, wallet.address.lower())
    assert issued.status_code == 200, issued.data
    message = issued.get_json()["data"]["message"]
    for part in ("Test Shop", merchant.id, "Base Sepolia", EVM, wallet.address, "moves no funds"):
        assert part in message, part
    assert re.search(r"Nonce: [0-9a-f]{32}", message)
    proven = _prove(dashboard, headers, EVM, wallet.address, _evm_sign(wallet, message))
    assert proven.status_code == 200, proven.data
    assert proven.get_json()["data"] == {"network": EVM, "address": wallet.address, "verified": True}
    listed = _api_wallets(client, merchant)[EVM]
    assert listed["address"] == wallet.address and listed["verified"] is True and listed["verified_at"]
    page = text(dashboard.get("/dashboard/wallets"))
    assert "Verified: new intents pay" in page and "badge-verified" in page
    intent = client.post("/api/v1/x402/intents", json={"amount_usdc": 1}, headers=merchant.headers).get_json()["data"]
    assert {r["network"]: r["payTo"] for r in intent["payment_requirements"]}[EVM] == wallet.address
    # The message was used: the same signature again proves nothing.
    again = _prove(dashboard, headers, EVM, wallet.address, _evm_sign(wallet, message))
    assert again.status_code == 400 and again.get_json()["error"]["code"] == "WALLET_NOT_PROVEN"
    # Pasting another address replaces it, unverified; pasting the same one keeps the proof.
    same = post(dashboard, "/dashboard/wallets", {"network": EVM, "address": wallet.address, "confirm": "yes"})
    assert same.status_code == 302 and _api_wallets(client, merchant)[EVM]["verified"] is True
    other = Account.create().address
    assert (
        post(dashboard, "/dashboard/wallets", {"network": EVM, "address": other, "confirm": "yes"}).status_code == 302
    )
    assert _api_wallets(client, merchant)[EVM] | {"updated_at": None} == {
        "network": EVM, "address": other, "verified": False, "verified_at": None, "updated_at": None}  # fmt: skip
    assert "badge-unverified" in text(dashboard.get("/dashboard/wallets"))


def test_a_signature_that_does_not_prove_the_wallet_changes_nothing(client, merchant, dashboard, monkeypatch):
    before = _api_wallets(client, merchant)[EVM]
    wallet, stranger = Account.create(), Account.create()
    headers = _headers(dashboard)
    message = _challenge(dashboard, headers, EVM, wallet.address).get_json()["data"]["message"]
    cases = [
        (wallet.address, _evm_sign(stranger, message)),  # signed by another key
        (wallet.address, _evm_sign(wallet, message + " ")),  # another message
        (stranger.address, _evm_sign(stranger, message)),  # a message issued for another address
        (wallet.address, "0x" + "00" * 65),  # not a signature
    ]
    for address, signature in cases:
        _challenge(dashboard, headers, EVM, wallet.address)  # issued again: each proof uses the session's
        answer = _prove(dashboard, headers, EVM, address, signature)
        assert answer.status_code == 400 and answer.get_json()["error"]["code"] == "WALLET_NOT_PROVEN", address
    # Expired: a proof after CHALLENGE_SECONDS is refused.
    monkeypatch.setattr(proofs, "CHALLENGE_SECONDS", -1)
    late = _challenge(dashboard, headers, EVM, wallet.address).get_json()["data"]["message"]
    answer = _prove(dashboard, headers, EVM, wallet.address, _evm_sign(wallet, late))
    assert answer.status_code == 400 and "expired" in answer.get_json()["error"]["message"]
    # Bad input: a clear 400, never a 500; without the CSRF header nothing is done.
    bodies = ({"network": EVM}, {"network": "eip155:1", "address": wallet.address},
              {"network": EVM, "address": "0x12"}, [], {"network": 5, "address": wallet.address})  # fmt: skip
    for body in bodies:
        refused = dashboard.post("/dashboard/wallets/challenge", json=body, headers=headers)
        assert refused.status_code == 400 and refused.get_json()["success"] is False, body
    assert (
        dashboard.post("/dashboard/wallets/challenge", json={"network": EVM, "address": wallet.address}).status_code
        == 400
    )
    assert _api_wallets(client, merchant)[EVM] == before


def test_a_solana_wallet_proves_itself_with_signmessage(client, merchant, dashboard):
    keypair = Keypair()
    address = str(keypair.pubkey())
    headers = _headers(dashboard)
    message = _challenge(dashboard, headers, SOLANA, address).get_json()["data"]["message"]
    signature = base64.b64encode(bytes(keypair.sign_message(message.encode()))).decode()
    proven = _prove(dashboard, headers, SOLANA, address, signature)
    assert proven.status_code == 200, proven.data
    assert _api_wallets(client, merchant)[SOLANA]["verified"] is True


def test_the_wallets_page_runs_the_wallet_scripts_and_only_its_own(dashboard):
    page = dashboard.get("/dashboard/wallets")
    assert "script-src 'self'" in page.headers["Content-Security-Policy"]
    body = text(page)
    assert 'src="/dashboard/static/wallets.js"' in body and 'src="/dashboard/static/wallet-proof.js"' in body
    assert 'class="wallet-connect" data-network="eip155:84532" data-kind="evm"' in body
    assert "script-src" not in dashboard.get("/dashboard/keys").headers["Content-Security-Policy"]
