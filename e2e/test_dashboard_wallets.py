"""Payout wallets proven in a real browser: the merchant connects a wallet on the wallets page (the injected test
wallets of e2e/wallets.py), it signs the service's message naming the shop and the network, and the wallet is
registered as verified; a pasted address shows as unverified."""

from __future__ import annotations

import re

from eth_account import Account
from playwright.sync_api import Page, expect
from solders.keypair import Keypair

from e2e.a11y import violations
from e2e.conftest import Shot, Stack
from e2e.test_dashboard import _flash, _networks, confirm_paste, go, sign_up
from e2e.wallets import EvmWallet, SolanaWallet


def test_wallets_are_proven_by_signing_and_a_pasted_one_is_unverified(page: Page, stack: Stack, shot: Shot) -> None:
    networks = _networks(stack)
    evm = next(n for n in networks if n["kind"] == "evm")
    solana = next(n for n in networks if n["kind"] == "solana")
    evm_key, sol_key = Account.create(), Keypair()
    evm_wallet = EvmWallet("0x" + bytes(evm_key.key).hex(), {})
    sol_wallet = SolanaWallet(str(sol_key))
    evm_wallet.install(page)
    sol_wallet.install(page)
    merchant = sign_up(page, name="Proof & Sons")
    go(page, "Wallets")

    page.get_by_role("button", name=f"Connect E2E Wallet on {evm['name']}").click()
    expect(_flash(page)).to_contain_text(f"Verified: new intents pay {evm_key.address} on {evm['name']}")
    (message,) = evm_wallet.messages
    assert "Proof & Sons" in message and evm["network"] in message and evm_key.address in message
    evm_card = page.get_by_role("listitem").filter(has=page.get_by_role("heading", name=evm["name"], exact=True))
    expect(evm_card.locator(".badge-verified")).to_have_text("Verified")

    page.get_by_role("button", name=f"Connect E2E Solana on {solana['name']}").click()
    expect(_flash(page)).to_contain_text(f"Verified: new intents pay {sol_key.pubkey()} on {solana['name']}")
    assert solana["network"] in sol_wallet.messages[0]

    # A pasted address on another network: saved only once confirmed, and unverified.
    other = next(n for n in networks if n["kind"] == "evm" and n["network"] != evm["network"])
    card = page.get_by_role("listitem").filter(has=page.get_by_role("heading", name=other["name"], exact=True))
    pasted = Account.create().address
    card.get_by_label(f"Wallet address on {other['name']}").fill(pasted)
    card.get_by_role("button", name="Save wallet").click()
    expect(page.get_by_role("alert")).to_contain_text("Confirm that you checked the pasted address")
    card = page.get_by_role("listitem").filter(has=page.get_by_role("heading", name=other["name"], exact=True))
    card.get_by_label(f"Wallet address on {other['name']}").fill(pasted)
    confirm_paste(card, other["name"])
    card.get_by_role("button", name="Save wallet").click()
    expect(_flash(page)).to_contain_text("Saved, unverified")
    expect(card.locator(".badge-unverified")).to_have_text("Unverified")
    shot(page, "wallets")
    assert violations(page) == []

    listed = stack.api("GET", "/wallets", key=merchant.first_key).json()["data"]["wallets"]
    assert {w["network"]: (w["address"], w["verified"]) for w in listed} == {
        evm["network"]: (evm_key.address, True),
        solana["network"]: (str(sol_key.pubkey()), True),
        other["network"]: (pasted, False),
    }
    assert re.match(r"\d{4}-\d\d-\d\dT", next(w for w in listed if w["verified"])["verified_at"])
