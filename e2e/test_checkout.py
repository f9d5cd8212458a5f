"""A buyer pays through the hosted checkout (/pay/<intent_id>) with a wallet in a real browser.

The wallets (e2e/wallets.py) hold devnet keys; money moves on the devnet's chains and the tests
read balances there. The merchant's shop is a route the browser answers itself.
"""

from __future__ import annotations

import re
import sqlite3
import time
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import requests
from eth_account import Account
from playwright.sync_api import Page, Route, expect
from solders.pubkey import Pubkey
from web3 import Web3

from e2e.a11y import violations
from e2e.conftest import Stack
from e2e.wallets import EvmWallet, SolanaWallet
from payintent import solana_tx as stx

SHOP = "https://shop.example"
EVM_NETWORKS = ["eip155:84532", "eip155:11155111", "eip155:5042002"]
BALANCE_OF = [{"name": "balanceOf", "type": "function", "stateMutability": "view",
               "inputs": [{"name": "a", "type": "address"}], "outputs": [{"name": "", "type": "uint256"}]}]  # fmt: skip


def shop(page: Page) -> list[str]:
    """Answer the merchant's pages in the browser; returns the URLs the buyer was sent to."""
    visits: list[str] = []

    def answer(route: Route) -> None:
        visits.append(route.request.url)
        route.fulfill(status=200, content_type="text/html", body="<!doctype html><title>Shop</title><h1>Thanks</h1>")

    page.route(f"{SHOP}/**", answer)
    return visits


def evm_wallet(stack: Stack, buyer: int = 0) -> EvmWallet:
    rpc_urls = {entry["chain_id"]: entry["rpc_url"] for entry in stack.demo["networks"].values()}
    return EvmWallet(stack.demo["buyers"][buyer]["private_key"], rpc_urls)


def usdc_balance(stack: Stack, network: str, address: str) -> int:
    entry = stack.demo["networks"][network]
    w3 = Web3(Web3.HTTPProvider(entry["rpc_url"]))
    return int(w3.eth.contract(address=entry["usdc_address"], abi=BALANCE_OF).functions.balanceOf(address).call())


def spl_balance(stack: Stack, owner: str) -> int:
    mint = Pubkey.from_string(stack.demo["solana"]["usdc_mint"])
    account = str(stx.associated_token_address(Pubkey.from_string(owner), mint))
    body = {"jsonrpc": "2.0", "id": 1, "method": "getTokenAccountBalance",
            "params": [account, {"commitment": "confirmed"}]}  # fmt: skip
    answer = requests.post(stack.demo["solana"]["rpc_url"], json=body, timeout=10).json()
    return int(answer["result"]["value"]["amount"]) if "result" in answer else 0


def requirement(intent: dict[str, Any], network: str) -> dict[str, Any]:
    return next(r for r in intent["payment_requirements"] if r["network"] == network)


def open_checkout(page: Page, intent: dict[str, Any]) -> None:
    page.goto(intent["checkout_url"])
    expect(page.get_by_test_id("amount")).to_be_visible()


def pay_with_evm(page: Page, network_name: str) -> None:
    page.get_by_role("radio", name=re.compile(network_name)).check()
    page.get_by_role("button", name="Connect E2E Wallet").click()
    expect(page.get_by_test_id("balance")).to_contain_text("USDC")
    page.get_by_role("button", name=re.compile(r"^Pay ")).click()


def assert_redirected_paid(stack: Stack, page: Page, intent: dict[str, Any]) -> dict[str, Any]:
    page.wait_for_url(f"{SHOP}/thanks**", timeout=30_000)
    query = parse_qs(urlsplit(page.url).query)
    assert query == {"order": ["42"], "intent_id": [intent["intent_id"]]}  # the merchant's query is kept
    paid = stack.api("GET", f"/x402/intents/{intent['intent_id']}").json()["data"]
    assert paid["status"] == "paid" and paid["tx_hash"]
    return paid


@pytest.mark.parametrize("network", EVM_NETWORKS)
def test_a_buyer_pays_on_each_evm_chain_and_returns_to_the_shop(stack: Stack, page: Page, shot, network: str):
    visits = shop(page)
    wallet = evm_wallet(stack)
    wallet.install(page)
    intent = stack.create_intent(
        2.5, description="Two ceramic mugs", redirect_url=f"{SHOP}/thanks?order=42", cancel_url=f"{SHOP}/cart"
    )
    wanted = requirement(intent, network)
    payee_before = usdc_balance(stack, network, wanted["payTo"])
    buyer_before = usdc_balance(stack, network, wallet.address)

    open_checkout(page, intent)
    expect(page.get_by_test_id("amount")).to_have_text("2.50")
    expect(page.get_by_text("Two ceramic mugs")).to_be_visible()
    expect(page.get_by_text("Demo Shop", exact=True)).to_be_visible()
    expect(page.locator(".countdown")).to_have_text(re.compile(r"^(29|30):\d\d$"))
    expect(page.get_by_role("link", name="Cancel and return to Demo Shop")).to_have_attribute("href", f"{SHOP}/cart")
    network_name = next(
        n["name"]
        for n in stack.api("GET", f"/checkout/intents/{intent['intent_id']}").json()["data"]["networks"]
        if n["network"] == network
    )
    page.get_by_role("radio", name=re.compile(re.escape(network_name))).check()
    page.get_by_role("button", name="Connect E2E Wallet").click()
    expect(page.get_by_test_id("balance")).to_contain_text(f"Balance on {network_name}:")
    shot(page, "ready")
    page.get_by_role("button", name="Pay 2.50 USDC").click()
    paid = assert_redirected_paid(stack, page, intent)
    assert visits[-1] == page.url

    # The wallet was added and switched to the chain, and asked for exactly the requirement's authorization.
    chain_id = int(network.split(":")[1])
    assert wallet.chain_id == chain_id and wallet.added_chains[0]["chainId"] == hex(chain_id)
    assert wallet.added_chains[0]["rpcUrls"] == [stack.demo["networks"][network]["rpc_url"]]
    [typed] = wallet.typed_data
    assert typed["domain"] == {"name": wanted["extra"]["name"], "version": wanted["extra"]["version"],
                               "chainId": chain_id, "verifyingContract": wanted["asset"]}  # fmt: skip
    message = typed["message"]
    assert message["to"] == wanted["payTo"] and message["value"] == wanted["maxAmountRequired"] == "2500000"
    assert abs(int(message["validBefore"]) - (time.time() + 900)) < 60
    assert re.fullmatch(r"0x[0-9a-f]{64}", message["nonce"])

    # Money moved on chain, once, from the buyer straight to the merchant.
    assert paid["chain"] == network
    assert usdc_balance(stack, network, wanted["payTo"]) - payee_before == 2_500_000
    assert buyer_before - usdc_balance(stack, network, wallet.address) == 2_500_000


def test_a_buyer_pays_with_a_solana_wallet(stack: Stack, page: Page, shot):
    shop(page)
    wallet = SolanaWallet(stack.demo["solana_buyers"][1]["secret_key"])
    wallet.install(page)
    intent = stack.create_intent(1.75, redirect_url=f"{SHOP}/thanks?order=42")
    network = stack.demo["solana"]["network"]
    payee = requirement(intent, network)["payTo"]
    buyer = str(wallet.keypair.pubkey())
    buyer_before = spl_balance(stack, buyer)
    payee_before = spl_balance(stack, payee)

    open_checkout(page, intent)
    page.get_by_role("radio", name=re.compile("Solana")).check()
    page.get_by_role("button", name="Connect E2E Solana").click()
    expect(page.get_by_test_id("balance")).to_contain_text("USDC")
    shot(page, "ready")
    page.get_by_role("button", name="Pay 1.75 USDC").click()
    paid = assert_redirected_paid(stack, page, intent)

    assert paid["chain"] == network and len(wallet.signed) == 1
    assert buyer_before - spl_balance(stack, buyer) == 1_750_000
    assert spl_balance(stack, payee) - payee_before == 1_750_000


def test_a_declined_signature_and_a_refused_payment_explain_themselves_and_can_be_retried(
    stack: Stack, page: Page, shot
):
    shop(page)
    wallet = evm_wallet(stack, buyer=1)
    wallet.reject_next.add("eth_signTypedData_v4")
    wallet.wrong_key_once = True
    wallet.install(page)
    intent = stack.create_intent(1, redirect_url=f"{SHOP}/thanks?order=42")
    open_checkout(page, intent)
    pay_with_evm(page, "Base Sepolia")

    alert = page.get_by_role("alert")
    expect(alert).to_contain_text("You declined the request in your wallet")
    expect(alert).to_contain_text("No money has moved.")
    shot(page, "declined")
    alert.get_by_role("button", name="Try again").click()
    # Signed by the wrong key: the service refuses it, the page says so and offers another try.
    expect(alert).to_contain_text("Your wallet's signature was not accepted")
    expect(alert).to_contain_text("No money has moved.")
    assert stack.api("GET", f"/x402/intents/{intent['intent_id']}").json()["data"]["status"] == "pending"
    shot(page, "refused")
    alert.get_by_role("button", name="Try again").click()
    assert_redirected_paid(stack, page, intent)
    assert len(wallet.typed_data) == 2  # the refused one and the good one, with different nonces
    assert wallet.typed_data[0]["message"]["nonce"] != wallet.typed_data[1]["message"]["nonce"]


def test_a_buyer_without_enough_usdc_is_told_so_before_signing(stack: Stack, page: Page):
    wallet = EvmWallet(Account.create().key.to_0x_hex(), evm_wallet(stack).rpc_urls)  # holds nothing
    wallet.install(page)
    intent = stack.create_intent(3)
    open_checkout(page, intent)
    pay_with_evm(page, "Arc Testnet")
    alert = page.get_by_role("alert")
    expect(alert).to_contain_text("Not enough USDC on Arc Testnet")
    expect(alert).to_contain_text("Your balance is 0.00 USDC and this payment needs 3.00 USDC")
    expect(page.get_by_test_id("balance")).to_have_class(re.compile("low"))
    assert not wallet.typed_data  # never asked to sign
    assert stack.api("GET", f"/x402/intents/{intent['intent_id']}").json()["data"]["status"] == "pending"


def test_a_cancelled_intent_shows_its_page_even_to_a_buyer_already_on_it(stack: Stack, page: Page):
    shop(page)
    intent = stack.create_intent(1, cancel_url=f"{SHOP}/cart")
    open_checkout(page, intent)
    assert stack.api("DELETE", f"/x402/intents/{intent['intent_id']}").status_code == 200
    heading = page.get_by_role("heading", name="This payment was cancelled")
    expect(heading).to_be_visible(timeout=10_000)  # the open page notices within its 5 s poll
    page.reload()
    expect(heading).to_be_visible()
    expect(page.get_by_role("button", name=re.compile("^Pay"))).to_have_count(0)
    page.get_by_role("link", name="Return to Demo Shop").click()
    page.wait_for_url(f"{SHOP}/cart")


def _expire(stack: Stack, intent_id: str) -> None:
    """Move the intent's expiry into the past in the stack's SQLite (the clock is the one thing we fake)."""
    with sqlite3.connect(stack.var_dir / "payintent.db") as connection:
        (expires_at,) = connection.execute("SELECT expires_at FROM intents WHERE id = ?", (intent_id,)).fetchone()
        past = datetime.fromisoformat(expires_at) - timedelta(minutes=31)
        connection.execute("UPDATE intents SET expires_at = ? WHERE id = ?", (past.isoformat(sep=" "), intent_id))


def test_an_expired_intent_shows_its_page_and_cannot_be_paid(stack: Stack, page: Page):
    wallet = evm_wallet(stack)
    wallet.install(page)
    intent = stack.create_intent(1)
    open_checkout(page, intent)
    _expire(stack, intent["intent_id"])
    expect(page.get_by_role("heading", name="This payment request has expired")).to_be_visible(timeout=10_000)
    expect(page.get_by_text("Nothing was paid. Ask Demo Shop for a new payment link.")).to_be_visible()
    assert page.title().startswith("Expired")
    assert not wallet.requests or all(m != "eth_signTypedData_v4" for m, _ in wallet.requests)


def test_paid_and_unknown_intents_have_their_own_pages(stack: Stack, page: Page):
    page.goto(stack.url("/pay/00000000-0000-4000-8000-000000000000"))
    expect(page.get_by_role("heading", name="Payment not found")).to_be_visible()

    shop(page)
    wallet = evm_wallet(stack, buyer=2)
    wallet.install(page)
    intent = stack.create_intent(0.5, redirect_url=f"{SHOP}/thanks?order=42")
    open_checkout(page, intent)
    pay_with_evm(page, "Ethereum Sepolia")
    paid = assert_redirected_paid(stack, page, intent)
    page.goto(intent["checkout_url"])  # back to the link once paid
    expect(page.get_by_role("heading", name="Paid")).to_be_visible()
    expect(page.get_by_text(paid["tx_hash"])).to_be_visible()
    expect(page.get_by_role("link", name="Return to Demo Shop")).to_have_attribute(
        "href", f"{SHOP}/thanks?order=42&intent_id={intent['intent_id']}"
    )


def test_a_phone_sized_screen_keyboard_only_payment_and_qr_code(stack: Stack, page: Page, shot):
    page.set_viewport_size({"width": 390, "height": 844})
    shop(page)
    wallet = evm_wallet(stack, buyer=1)
    wallet.install(page)
    intent = stack.create_intent(1.2, description="Coffee beans", redirect_url=f"{SHOP}/thanks?order=42")
    open_checkout(page, intent)
    no_sideways_scroll = "document.documentElement.scrollWidth <= window.innerWidth"
    assert page.evaluate(no_sideways_scroll)

    page.get_by_text("Pay from your phone").click()
    qr = page.get_by_role("img", name="QR code of this checkout page's link")
    expect(qr).to_be_visible()
    box = qr.bounding_box()
    assert box is not None and box["width"] >= 150
    assert page.evaluate(no_sideways_scroll)
    shot(page, "phone")

    # Keyboard only: the first network is selected; Tab to the wallet, Enter; Tab to Pay, Enter.
    page.get_by_role("radio", name=re.compile("Base Sepolia")).focus()
    page.keyboard.press("ArrowDown")  # radios move with arrows: Ethereum Sepolia
    expect(page.get_by_role("radio", name=re.compile("Ethereum Sepolia"))).to_be_checked()
    page.keyboard.press("Tab")
    expect(page.get_by_role("button", name="Connect E2E Wallet")).to_be_focused()
    page.keyboard.press("Enter")
    expect(page.get_by_role("button", name="Pay 1.20 USDC")).to_be_focused()  # connected: focus moves on to Pay
    page.keyboard.press("Enter")
    paid = assert_redirected_paid(stack, page, intent)
    assert paid["chain"] == "eip155:11155111" and len(wallet.typed_data) == 1


def test_a_wallet_left_on_another_chain_is_asked_to_switch_again(stack: Stack, page: Page):
    shop(page)
    wallet = evm_wallet(stack, buyer=2)
    wallet.known_chains.add(84532)  # it knows the chain, but ignores the first switch request
    wallet.stuck_once = True
    wallet.install(page)
    intent = stack.create_intent(0.25, redirect_url=f"{SHOP}/thanks?order=42")
    open_checkout(page, intent)
    pay_with_evm(page, "Base Sepolia")
    alert = page.get_by_role("alert")
    expect(alert).to_contain_text("Switch your wallet to Base Sepolia (local)")
    assert not wallet.typed_data and wallet.chain_id == 1  # nothing signed on the wrong chain
    alert.get_by_role("button", name="Try again").click()
    assert_redirected_paid(stack, page, intent)
    assert wallet.chain_id == 84532 and not wallet.added_chains


def test_every_checkout_page_passes_axe_wcag_aa(stack: Stack, page: Page, shot):
    """axe-core finds no WCAG 2.1 AA violation on the payable page (idle, connected, with a problem,
    on a phone) nor on the paid, expired, cancelled and not-found pages."""
    found: dict[str, list[dict[str, Any]]] = {}
    wallet = EvmWallet(Account.create().key.to_0x_hex(), evm_wallet(stack).rpc_urls)  # no USDC: a problem shows
    wallet.install(page)
    intent = stack.create_intent(4, description="Tea", cancel_url=f"{SHOP}/cart")
    open_checkout(page, intent)
    found["pending"] = violations(page)
    pay_with_evm(page, "Base Sepolia")
    expect(page.get_by_role("alert")).to_contain_text("Not enough USDC")
    page.get_by_text("Pay from your phone").click()
    found["problem"] = violations(page)
    page.set_viewport_size({"width": 390, "height": 844})
    found["phone"] = violations(page)
    shot(page, "problem-phone")
    page.set_viewport_size({"width": 1280, "height": 800})

    assert stack.api("DELETE", f"/x402/intents/{intent['intent_id']}").status_code == 200
    page.reload()
    expect(page.get_by_role("heading", name="This payment was cancelled")).to_be_visible()
    found["cancelled"] = violations(page)
    expired = stack.create_intent(1)
    _expire(stack, expired["intent_id"])
    page.goto(expired["checkout_url"])
    expect(page.get_by_role("heading", name="This payment request has expired")).to_be_visible()
    found["expired"] = violations(page)
    page.goto(stack.url("/pay/00000000-0000-4000-8000-000000000000"))
    expect(page.get_by_role("heading", name="Payment not found")).to_be_visible()
    found["not found"] = violations(page)
    assert {name: v for name, v in found.items() if v} == {}
