"""API keys and payout wallets through the dashboard, checked against the API they govern."""

from __future__ import annotations

from sqlalchemy import select

from backend.extensions import db
from backend.merchants.models import ApiKey
from tests.conftest import EVM_WALLET
from tests.dashboard.helpers import post, revealed_secret, text
from tests.intents.helpers import create as create_intent

INTENTS_API = "/api/v1/x402/intents"
NEW_EVM_WALLET = "0x3C44CdDdB6a900fa2b585dd299e03d12FA4293BC"


def _bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def test_create_key_shows_it_once_and_revoking_it_stops_the_api_at_once(dashboard, merchant):
    response = post(dashboard, "/dashboard/keys")
    assert response.status_code == 302 and response.headers["Location"] == "/dashboard/keys"
    page = text(dashboard.get("/dashboard/keys"))
    secret = revealed_secret(page)
    assert secret is not None and secret.startswith("sk_test_")
    # Shown once: the next view of any page no longer has it, and the listing has the prefix only.
    again = text(dashboard.get("/dashboard/keys"))
    assert revealed_secret(again) is None and secret not in again
    assert f"{secret[:14]}…" in again
    key = db.session.scalar(select(ApiKey).where(ApiKey.display_prefix == secret[:14]))
    assert key is not None and key.merchant_id == merchant.id and secret not in key.key_hash

    assert dashboard.get(INTENTS_API, headers=_bearer(secret)).status_code == 200
    listing = text(dashboard.get("/dashboard/keys"))
    assert listing.count("Never") == 1  # the fixture's key was never used; the new one now was

    confirm = dashboard.get(f"/dashboard/keys/{key.id}/revoke")
    assert confirm.status_code == 200 and "cannot be undone" in text(confirm)
    assert dashboard.get(INTENTS_API, headers=_bearer(secret)).status_code == 200  # a GET changes nothing
    response = post(dashboard, f"/dashboard/keys/{key.id}/revoke")
    assert response.status_code == 302
    denied = dashboard.get(INTENTS_API, headers=_bearer(secret))
    assert denied.status_code == 401 and denied.get_json()["error"]["code"] == "UNAUTHORIZED"
    assert dashboard.get(INTENTS_API, headers=merchant.headers).status_code == 200  # the other key still works
    assert "revoked" in text(dashboard.get("/dashboard/keys"))
    # Revoking twice is harmless.
    assert post(dashboard, f"/dashboard/keys/{key.id}/revoke").status_code == 302


def test_wallet_change_appears_in_the_next_intent(dashboard, client, merchant):
    before = create_intent(client, merchant)
    base = next(r for r in before["payment_requirements"] if r["network"] == "eip155:84532")
    assert base["payTo"] == EVM_WALLET

    form = {"network": "eip155:84532", "address": NEW_EVM_WALLET.lower(), "confirm": "yes"}
    response = post(dashboard, "/dashboard/wallets", form)
    assert response.status_code == 302
    page = text(dashboard.get("/dashboard/wallets"))
    assert NEW_EVM_WALLET in page  # stored checksummed
    assert "New intents pay" in page

    after = create_intent(client, merchant)
    by_network = {r["network"]: r["payTo"] for r in after["payment_requirements"]}
    assert by_network["eip155:84532"] == NEW_EVM_WALLET
    assert by_network["eip155:11155111"] == EVM_WALLET
    # The earlier intent keeps what it offered.
    old = client.get(f"{INTENTS_API}/{before['intent_id']}", headers=merchant.headers).get_json()["data"]
    assert next(r for r in old["payment_requirements"] if r["network"] == "eip155:84532")["payTo"] == EVM_WALLET

    # Removing a network's wallet takes it out of the next intent.
    assert post(dashboard, "/dashboard/wallets/remove", {"network": "eip155:84532"}).status_code == 302
    networks = {r["network"] for r in create_intent(client, merchant)["payment_requirements"]}
    assert "eip155:84532" not in networks and "eip155:11155111" in networks


def test_invalid_wallet_is_refused_with_the_services_message(dashboard, client, merchant):
    cases = [
        ({"network": "eip155:84532", "address": "0x1234"}, "0x followed by 40 hex characters"),
        ({"network": "eip155:84532", "address": "0x3C44CdDdB6a900fa2b585dd299e03d12FA4293Bc"}, "checksum"),
        ({"network": "eip155:84532", "address": "0x" + "0" * 40}, "zero address"),
        ({"network": "solana:EtWTRABZaYq6iMfeYKouRu166VU2xqa1", "address": NEW_EVM_WALLET}, "base58"),
        ({"network": "eip155:1", "address": NEW_EVM_WALLET}, "Choose one of the configured networks."),
        ({"network": "eip155:84532", "address": "   "}, "Enter the wallet address"),
    ]
    # A pasted address is saved only with the merchant's word that it was checked (it is unverified).
    unconfirmed = post(dashboard, "/dashboard/wallets", {"network": "eip155:84532", "address": NEW_EVM_WALLET})
    assert unconfirmed.status_code == 400 and "Confirm that you checked the pasted address" in text(unconfirmed)
    for form, message in cases:
        response = post(dashboard, "/dashboard/wallets", {**form, "confirm": "yes"})
        assert response.status_code == 400, form
        body = text(response)
        assert message in body, (form, body[:2000])
        assert "The wallet was not saved" in body
    requirements = create_intent(client, merchant)["payment_requirements"]
    assert {r["network"]: r["payTo"] for r in requirements}["eip155:84532"] == EVM_WALLET


def test_wallets_page_lists_every_configured_network(dashboard, app):
    page = text(dashboard.get("/dashboard/wallets"))
    for network in app.extensions["payintent.chains"]:
        assert network.name in page and network.network in page
