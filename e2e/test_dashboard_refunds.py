"""A refund in a real browser, against `payintent dev`: a merchant whose payout wallet is a devnet key refunds part of
a paid intent from its page, connects that wallet on the refund's page (the injected test wallets of e2e/wallets.py:
EIP-6963 on EVM, the Wallet Standard on Solana), signs, and watches the relay settle it; the buyer's balance is
read on chain. A wallet that shares another account is told so, and nothing is sent."""

from __future__ import annotations

import re

from eth_account import Account
from playwright.sync_api import Page, expect
from solders.keypair import Keypair

from e2e.a11y import violations
from e2e.conftest import Shot, Stack
from e2e.test_checkout import spl_balance, usdc_balance
from e2e.test_dashboard import _flash, _networks, confirm_paste, go, sign_up
from e2e.wallets import EvmWallet, SolanaWallet
from payintent.client import PayIntentClient


def _set_wallet(page: Page, network: dict, address: str) -> None:
    go(page, "Wallets")
    card = page.get_by_role("listitem").filter(has=page.get_by_role("heading", name=network["name"], exact=True))
    card.get_by_label(f"Wallet address on {network['name']}").fill(address)
    confirm_paste(card, network["name"])
    card.get_by_role("button", name="Save wallet").click()
    expect(_flash(page)).to_contain_text("New intents pay")


def _refund_from_intent_page(page: Page, intent_id: str, amount: str) -> None:
    page.goto(f"/dashboard/intents/{intent_id}")
    expect(page.get_by_role("heading", name="Refund", exact=True)).to_be_visible()
    page.get_by_label("Amount (USDC)").fill(amount)
    page.get_by_label("Reason (optional)").fill("Arrived damaged")
    page.get_by_role("button", name="Refund", exact=True).click()
    expect(page).to_have_url(re.compile(r"/dashboard/refunds/re_[0-9a-f]{32}$"))
    expect(_flash(page)).to_contain_text("Refund created")


def test_an_evm_refund_is_signed_in_the_browser_and_lands_once(page: Page, stack: Stack, shot: Shot) -> None:
    merchant = sign_up(page)
    evm = next(n for n in _networks(stack) if n["kind"] == "evm")
    payout = Account.create()
    _set_wallet(page, evm, payout.address)
    buyer = Account.from_key(stack.demo["buyers"][1]["private_key"])
    rpc_urls = {n: entry["rpc_url"] for n, entry in stack.demo["networks"].items()}
    with PayIntentClient(stack.base_url, merchant.first_key, rpc_urls=rpc_urls) as client:
        intent = client.create_intent("2.50", order_id="mug-7")
        client.pay(intent, buyer)
    before = usdc_balance(stack, evm["network"], buyer.address)

    _refund_from_intent_page(page, intent["intent_id"], "0.40")
    expect(page.get_by_text("Sign with your payout wallet")).to_be_visible()
    # A wallet holding another account: told so, nothing sent.
    stranger = EvmWallet(
        Account.create().key.hex(), {e["chain_id"]: e["rpc_url"] for e in stack.demo["networks"].values()}
    )
    other = page.context.new_page()
    stranger.install(other)
    other.goto(page.url)
    other.get_by_role("button", name="Sign with E2E Wallet").click()
    expect(other.locator("#refund-progress")).to_contain_text(f"the refund is paid from {payout.address}")
    assert not stranger.typed_data
    other.close()

    wallet = EvmWallet(
        "0x" + bytes(payout.key).hex(), {e["chain_id"]: e["rpc_url"] for e in stack.demo["networks"].values()}
    )
    wallet.install(page)
    page.reload()
    expect(page.get_by_role("button", name="Sign with E2E Wallet")).to_be_visible()
    shot(page, "refund-to-sign")
    assert violations(page) == []
    page.get_by_role("button", name="Sign with E2E Wallet").click()
    expect(page.locator("#refund-progress")).to_contain_text("Refunded: the buyer has the USDC back", timeout=60_000)
    shot(page, "refund-done")
    assert violations(page) == []
    (typed,) = wallet.typed_data
    assert typed["message"]["to"] == buyer.address and typed["message"]["value"] == "400000"
    assert typed["domain"]["chainId"] == int(evm["network"].split(":")[1])
    assert usdc_balance(stack, evm["network"], buyer.address) - before == 400_000
    assert usdc_balance(stack, evm["network"], payout.address) == 2_100_000
    read = stack.api("GET", f"/x402/intents/{intent['intent_id']}", key=merchant.first_key).json()["data"]
    assert read["refunded_usdc"] == 0.4 and read["refunds"][0]["status"] == "succeeded"
    page.goto(f"/dashboard/intents/{intent['intent_id']}")
    expect(page.get_by_text("Left to refund: 2.1 USDC")).to_be_visible()
    expect(page.get_by_role("region", name="Refunds of this intent")).to_contain_text("succeeded")


def test_a_solana_refund_is_signed_in_the_browser(page: Page, stack: Stack, shot: Shot) -> None:
    merchant = sign_up(page)
    solana = next(n for n in _networks(stack) if n["kind"] == "solana")
    payout = Keypair()
    _set_wallet(page, solana, str(payout.pubkey()))
    buyer = Keypair.from_base58_string(stack.demo["solana_buyers"][0]["secret_key"])
    with PayIntentClient(stack.base_url, merchant.first_key) as client:
        intent = client.create_intent("1.20")
        client.pay(intent, buyer)
    before = spl_balance(stack, str(buyer.pubkey()))

    _refund_from_intent_page(page, intent["intent_id"], "1.2")
    wallet = SolanaWallet(str(payout))
    wallet.install(page)
    page.reload()
    page.get_by_role("button", name="Sign with E2E Solana").click()
    expect(page.locator("#refund-progress")).to_contain_text("Refunded: the buyer has the USDC back", timeout=60_000)
    shot(page, "solana-refund-done")
    assert len(wallet.signed) == 1
    assert spl_balance(stack, str(buyer.pubkey())) - before == 1_200_000
    assert spl_balance(stack, str(payout.pubkey())) == 0
    page.goto(f"/dashboard/intents/{intent['intent_id']}")
    expect(page.get_by_text("Nothing is left to refund on this intent.")).to_be_visible()
