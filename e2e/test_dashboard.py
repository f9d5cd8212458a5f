"""The merchant dashboard in a real browser, against `payintent dev`.

A merchant signs up, creates and revokes an API key (the API refuses it at once), registers
wallets (the next intent pays them), registers a webhook endpoint on a local receiver, sends a
test event (signed with the secret shown once) and replays a failed delivery; the intents list
filters and links to details. Every step the issue names is done by clicking through the pages;
the API is used only to check the outcome (and to create intents, which merchants do from their
servers).
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eth_account import Account
from playwright.sync_api import Locator, Page, expect
from solders.keypair import Keypair

from backend.merchants.services import KEY_DISPLAY_CHARS, KEY_PREFIX
from e2e.conftest import Shot, Stack
from payintent.webhooks import verify_signature
from tests.webhooks.receiver import Receiver

PASSWORD = "correct horse battery staple"


@dataclass
class Merchant:
    email: str
    password: str
    name: str
    first_key: str


def _networks(stack: Stack) -> list[dict[str, Any]]:
    """The stack's configured networks (the devnet's chains file), in order."""
    return json.loads(Path(stack.demo["chains_file"]).read_text())["networks"]  # type: ignore[no-any-return]


def _flash(page: Page) -> Locator:
    return page.locator(".flash")


def revealed_secret(page: Page, label: str) -> str:
    """The secret the page shows once, read from its labelled read-only field."""
    field = page.get_by_label(label, exact=True)
    expect(field).to_be_visible()
    expect(field).to_have_attribute("readonly", "")
    return field.input_value()


def sign_up(page: Page, name: str = "Mugs & Co") -> Merchant:
    """Create an account through the sign-up page; lands on the overview, logged in."""
    email = f"shop-{uuid.uuid4().hex[:10]}@example.com"
    page.goto("/dashboard/signup")
    page.get_by_label("Shop name").fill(name)
    page.get_by_label("Email").fill(email)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Create account").click()
    expect(page.get_by_role("heading", level=1)).to_have_text("Overview")
    expect(_flash(page)).to_contain_text("Your account is ready")
    first_key = revealed_secret(page, "API key")
    assert first_key.startswith("sk_")
    return Merchant(email, PASSWORD, name, first_key)


def log_in(page: Page, email: str, password: str) -> None:
    page.get_by_label("Email").fill(email)
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Log in").click()


def go(page: Page, section: str) -> None:
    """Follow a link of the dashboard's navigation."""
    page.get_by_role("navigation", name="Dashboard").get_by_role("link", name=section).click()
    expect(page.get_by_role("navigation", name="Dashboard").get_by_role("link", name=section)).to_have_attribute(
        "aria-current", "page"
    )


def confirm_paste(scope: Page | Locator, network_name: str) -> None:
    """Tick the pasted address's confirmation: a pasted address is unverified, the form asks for the merchant's word."""
    scope.get_by_label(re.compile(rf"I checked this address.* on {re.escape(network_name)}:")).check()


def reload_until(page: Page, locator: Locator, timeout: float = 15.0) -> None:
    """Reload the page until ``locator`` is visible (the worker acts in the background)."""
    deadline = time.monotonic() + timeout
    while not locator.is_visible():
        assert time.monotonic() < deadline, f"not shown after {timeout} s: {locator}"
        time.sleep(0.2)
        page.reload()


# --- account -------------------------------------------------------------------------------------


def test_sign_up_log_out_and_log_in_again(page: Page, stack: Stack, shot: Shot) -> None:
    page.goto("/dashboard/keys")  # not logged in: to the log-in page, and back after it
    expect(page).to_have_url(re.compile(r"/dashboard/login\?next=(/|%2F)dashboard(/|%2F)keys$"))

    page.get_by_role("link", name="Create an account").click()
    page.get_by_label("Shop name").fill("Mugs & Co")
    page.get_by_label("Email").fill("not-an-email")
    page.get_by_label("Password").fill("short")
    page.get_by_role("button", name="Create account").click()
    summary = page.get_by_role("alert")
    expect(summary).to_contain_text("Please fix the following")
    expect(summary).to_contain_text("Use at least 10 characters.")
    expect(page.get_by_label("Password")).to_have_attribute("aria-invalid", "true")
    expect(page.get_by_label("Password")).to_have_value("")  # never rendered back
    expect(page.get_by_label("Shop name")).to_have_value("Mugs & Co")  # the rest is kept
    shot(page, "signup-errors")

    merchant = sign_up(page)
    assert stack.api("GET", "/x402/intents", key=merchant.first_key).status_code == 200  # the key shown works
    expect(page.get_by_role("banner")).to_contain_text("Mugs & Co")
    page.reload()  # the key was shown once
    expect(page.get_by_label("API key", exact=True)).to_have_count(0)
    assert merchant.first_key not in page.content()

    page.get_by_role("button", name="Log out").click()
    expect(page.get_by_role("heading", level=1)).to_have_text("Log in to your dashboard")
    expect(_flash(page)).to_have_text("You are logged out.")
    page.goto("/dashboard/")
    expect(page).to_have_url(re.compile(r"/dashboard/login"))

    log_in(page, merchant.email, "wrong password, sorry")
    expect(page.get_by_role("alert")).to_contain_text("Invalid email or password.")
    expect(page.get_by_label("Email")).to_have_value(merchant.email)
    expect(page.get_by_role("navigation", name="Dashboard")).to_have_count(0)  # still logged out
    shot(page, "wrong-password")

    page.goto("/dashboard/keys")
    log_in(page, merchant.email, merchant.password)
    expect(page).to_have_url(re.compile(r"/dashboard/keys$"))  # where the merchant was going
    expect(page.get_by_role("heading", level=1)).to_have_text("API keys")

    page.get_by_role("button", name="Log out").click()
    page.get_by_role("link", name="Create an account").click()
    page.get_by_label("Shop name").fill("Someone else")
    page.get_by_label("Email").fill(merchant.email.upper())
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Create account").click()
    expect(page.get_by_role("alert")).to_contain_text("An account with this email already exists")


# --- API keys ------------------------------------------------------------------------------------


def test_create_an_api_key_use_it_and_revoke_it(page: Page, stack: Stack, shot: Shot) -> None:
    merchant = sign_up(page)
    go(page, "Wallets")  # an intent needs a payout wallet
    evm = _networks(stack)[0]
    page.get_by_label(f"Wallet address on {evm['name']}").fill(Account.create().address)
    confirm_paste(page, evm["name"])
    page.get_by_role("button", name="Save wallet").first.click()
    expect(_flash(page)).to_contain_text("Saved, unverified.")

    go(page, "API keys")
    page.get_by_role("button", name="Create an API key").click()
    expect(_flash(page)).to_have_text("API key created.")
    key = revealed_secret(page, "API key")
    assert key != merchant.first_key
    shot(page, "created")

    shown = key[: len(KEY_PREFIX) + KEY_DISPLAY_CHARS]  # how listings show a key
    created = stack.api("POST", "/x402/intents", key=key, json={"amount_usdc": 2.5})
    assert created.status_code == 201, created.text
    page.reload()
    expect(page.get_by_label("API key", exact=True)).to_have_count(0)  # shown once
    row = page.get_by_role("row").filter(has_text=shown)
    expect(row).to_have_count(1)
    expect(row.get_by_role("cell").nth(2)).not_to_have_text("Never")  # last use is recorded
    expect(row).to_contain_text("active")

    row.get_by_role("link", name=re.compile(r"^Revoke")).click()
    expect(page.get_by_role("heading", level=1)).to_contain_text(f"Revoke API key {shown}")
    page.get_by_role("button", name="Revoke key").click()
    expect(_flash(page)).to_contain_text("is revoked")
    expect(page.get_by_role("row").filter(has_text=shown)).to_contain_text("revoked")

    refused = stack.api("POST", "/x402/intents", key=key, json={"amount_usdc": 2.5})
    assert refused.status_code == 401, refused.text  # at once
    assert stack.api("GET", "/x402/intents", key=merchant.first_key).status_code == 200  # only that key


# --- wallets -------------------------------------------------------------------------------------


def test_a_registered_wallet_is_paid_by_the_next_intent(page: Page, stack: Stack, shot: Shot) -> None:
    merchant = sign_up(page)
    networks = _networks(stack)
    evm = next(n for n in networks if n["kind"] == "evm")
    solana = next(n for n in networks if n["kind"] == "solana")
    no_wallet = stack.api("POST", "/x402/intents", key=merchant.first_key, json={"amount_usdc": 1})
    assert no_wallet.status_code >= 400  # nowhere to be paid yet

    go(page, "Wallets")
    evm_card = page.get_by_role("listitem").filter(has=page.get_by_role("heading", name=evm["name"], exact=True))
    evm_card.get_by_label(f"Wallet address on {evm['name']}").fill("0x1234")
    confirm_paste(evm_card, evm["name"])
    evm_card.get_by_role("button", name="Save wallet").click()
    expect(page.get_by_role("alert")).to_contain_text("The wallet was not saved")
    expect(evm_card.get_by_label(re.compile("Wallet address"))).to_have_attribute("aria-invalid", "true")
    shot(page, "invalid")

    address = Account.create().address
    evm_card.get_by_label(f"Wallet address on {evm['name']}").fill(address.lower())  # any case; stored checksummed
    confirm_paste(evm_card, evm["name"])
    evm_card.get_by_role("button", name="Save wallet").click()
    expect(_flash(page)).to_contain_text(f"New intents pay {address} on {evm['name']}")
    expect(evm_card).to_contain_text(address)

    sol_address = str(Keypair().pubkey())
    sol_card = page.get_by_role("listitem").filter(has=page.get_by_role("heading", name=solana["name"], exact=True))
    sol_card.get_by_label(f"Wallet address on {solana['name']}").fill(sol_address)
    confirm_paste(sol_card, solana["name"])
    sol_card.get_by_role("button", name="Save wallet").click()
    expect(sol_card).to_contain_text(sol_address)

    intent = stack.create_intent(3, key=merchant.first_key)
    pay_to = {r["network"]: r["payTo"] for r in intent["payment_requirements"]}
    assert pay_to == {evm["network"]: address, solana["network"]: sol_address}  # only where there is a wallet

    replacement = Account.create().address
    evm_card.get_by_label(f"Replace with address on {evm['name']}").fill(replacement)
    confirm_paste(evm_card, evm["name"])
    evm_card.get_by_role("button", name="Save wallet").click()
    expect(evm_card).to_contain_text(replacement)
    sol_card.get_by_role("button", name=f"Remove wallet on {solana['name']}").click()
    expect(_flash(page)).to_contain_text(f"New intents are not payable on {solana['network']}")
    expect(sol_card).to_contain_text("No wallet")

    later = stack.create_intent(4, key=merchant.first_key)
    assert {r["network"]: r["payTo"] for r in later["payment_requirements"]} == {evm["network"]: replacement}
    earlier = stack.api("GET", f"/x402/intents/{intent['intent_id']}", key=merchant.first_key).json()["data"]
    assert {r["network"]: r["payTo"] for r in earlier["payment_requirements"]} == pay_to  # kept


# --- webhooks ------------------------------------------------------------------------------------


def add_endpoint(page: Page, url: str) -> str:
    """Add a webhook endpoint through the form; returns the signing secret shown once."""
    go(page, "Webhooks")
    page.get_by_label("Endpoint URL").fill(url)
    page.get_by_label("payment.completed").check()
    page.get_by_role("button", name="Add endpoint").click()
    expect(_flash(page)).to_have_text("Webhook endpoint added.")
    expect(page.get_by_role("heading", level=1)).to_have_text(url)
    secret = revealed_secret(page, "Signing secret")
    assert secret.startswith("whsec_")
    return secret


def send_test_event(page: Page, event: str) -> tuple[str, str]:
    """Send a test event from the endpoint's page; returns (event id, delivery id) from the confirmation."""
    page.get_by_label("Event type").select_option(event)
    page.get_by_role("button", name="Send test event").click()
    expect(_flash(page)).to_contain_text(f"Test {event} event")
    found = re.search(r"event (evt_test_\w+) queued as delivery (\S+)\.$", _flash(page).inner_text().strip())
    assert found, _flash(page).inner_text()
    return found.group(1), found.group(2)


def delivery_card(page: Page, delivery_id: str) -> Locator:
    return page.locator("ol.deliveries > li").filter(has=page.locator(f'[id="d-{delivery_id}"]'))


def test_webhook_test_event_arrives_signed(page: Page, stack: Stack, receiver: Receiver, shot: Shot) -> None:
    sign_up(page)
    secret = add_endpoint(page, receiver.url("/hooks"))
    page.reload()
    expect(page.get_by_label("Signing secret", exact=True)).to_have_count(0)  # shown once
    expect(page.get_by_text("No deliveries yet")).to_be_visible()

    event_id, delivery_id = send_test_event(page, "payment.failed")
    received = receiver.wait_for(1, "/hooks", timeout=15)[0]
    verify_signature(received.body, received.headers["Service-Signature"], secret)  # the secret shown signs it
    envelope = json.loads(received.body)
    assert envelope["id"] == event_id and envelope["event"] == "payment.failed"

    card = delivery_card(page, delivery_id)
    # Until the delivery's own row says so: the page reads the delivery, then its attempts, so a reload between the
    # worker's commits may show the succeeded attempt under a heading still "pending, 0 attempts" (seen in CI).
    reload_until(page, card.get_by_role("heading").filter(has_text="1 attempt"))
    expect(card.locator(".badge-succeeded").first).to_be_visible()
    expect(card.get_by_role("heading")).to_contain_text("payment.failed")
    expect(card.get_by_role("row").nth(1)).to_contain_text("200")

    card.get_by_role("link", name=delivery_id).click()  # the delivery's own page
    expect(page.get_by_role("heading", level=1)).to_contain_text(delivery_id)
    expect(page.locator("pre.payload").last).to_contain_text(event_id)


def fail_until_released(receiver: Receiver) -> threading.Event:
    """Make ``receiver`` answer 500 to every POST (recorded under /status/500) until the event is set."""
    released = threading.Event()
    handler = receiver.server.RequestHandlerClass

    class FailingHandler(handler):  # type: ignore[valid-type,misc]
        def do_POST(self) -> None:
            if not released.is_set():
                self.path = "/status/500"  # the receiver's own way of answering 500
            super().do_POST()

    receiver.server.RequestHandlerClass = FailingHandler
    return released


def test_replay_a_failed_delivery(page: Page, stack: Stack, receiver: Receiver, shot: Shot) -> None:
    sign_up(page)
    released = fail_until_released(receiver)
    secret = add_endpoint(page, receiver.url("/hooks"))
    event_id, failed_id = send_test_event(page, "payment.completed")
    first = receiver.wait_for(1, "/status/500", timeout=15)[0]
    assert json.loads(first.body)["id"] == event_id

    failed = delivery_card(page, failed_id)
    reload_until(page, failed.locator(".badge-failed"))  # the attempt failed; the next is a minute away
    expect(failed.get_by_role("row").nth(1)).to_contain_text("500")
    expect(failed).to_contain_text("next attempt")
    shot(page, "failed")

    released.set()  # the merchant fixed the receiver
    failed.get_by_role("button", name=f"Replay delivery {failed_id}").click()
    expect(_flash(page)).to_contain_text(f"Event {event_id} queued again as delivery")
    replay_id = re.search(r"as delivery (\S+)\.$", _flash(page).inner_text().strip()).group(1)  # type: ignore[union-attr]
    assert replay_id != failed_id

    again = receiver.wait_for(1, "/hooks", timeout=15)[0]
    assert json.loads(again.body)["id"] == event_id  # the same event, so receivers can deduplicate
    verify_signature(again.body, again.headers["Service-Signature"], secret)

    replayed = delivery_card(page, replay_id)
    reload_until(page, replayed.locator(".badge-succeeded").first)
    expect(replayed).to_contain_text(f"replay of {failed_id}")
    expect(replayed.get_by_role("row").nth(1)).to_contain_text("200")
    expect(delivery_card(page, failed_id).get_by_role("row").nth(1)).to_contain_text("500")  # history kept


# --- intents -------------------------------------------------------------------------------------


def test_intents_list_filters_and_detail(page: Page, stack: Stack, shot: Shot) -> None:
    merchant = sign_up(page)
    go(page, "Wallets")
    evm = _networks(stack)[0]
    address = Account.create().address
    page.get_by_label(f"Wallet address on {evm['name']}").fill(address)
    confirm_paste(page, evm["name"])
    page.get_by_role("button", name="Save wallet").first.click()
    expect(_flash(page)).to_contain_text("Saved, unverified.")

    tag = uuid.uuid4().hex[:8]
    kept = stack.create_intent(12.5, key=merchant.first_key, order_id=f"order-{tag}-1", description="Two mugs")
    other = stack.create_intent(7, key=merchant.first_key, order_id=f"order-{tag}-2")
    dropped = stack.create_intent(1.25, key=merchant.first_key, order_id=f"order-{tag}-3")
    cancel = stack.api("DELETE", f"/x402/intents/{dropped['intent_id']}", key=merchant.first_key)
    assert cancel.status_code == 200, cancel.text

    go(page, "Overview")
    stats = page.get_by_role("region", name="At a glance")
    expect(stats.get_by_role("link", name="2 pending intents")).to_be_visible()
    expect(stats.get_by_role("link", name="1 cancelled intent")).to_be_visible()

    go(page, "Intents")
    table = page.get_by_role("region", name="Intents")
    expect(table.get_by_role("row")).to_have_count(4)  # header + 3, newest first
    expect(table.get_by_role("row").nth(1)).to_contain_text(dropped["intent_id"])

    page.get_by_label("Status").select_option("cancelled")
    page.get_by_role("button", name="Filter").click()
    expect(page).to_have_url(re.compile(r"status=cancelled"))
    expect(table.get_by_role("row")).to_have_count(2)
    expect(table.get_by_role("row").nth(1)).to_contain_text(dropped["intent_id"])
    expect(table.get_by_role("row").nth(1)).to_contain_text("1.25 USDC")
    shot(page, "cancelled")

    page.get_by_label("Status").select_option("pending")
    page.get_by_role("button", name="Filter").click()
    expect(table.get_by_role("row")).to_have_count(3)
    expect(table).to_contain_text(other["intent_id"])
    expect(table).not_to_contain_text(dropped["intent_id"])

    page.get_by_label("Status").select_option("paid")
    page.get_by_role("button", name="Filter").click()
    expect(page.get_by_text("No intents match these filters.")).to_be_visible()
    page.get_by_role("link", name="Clear filters").click()
    page.get_by_label("Order ID").fill(f"order-{tag}-1")
    page.get_by_role("button", name="Filter").click()
    expect(table.get_by_role("row")).to_have_count(2)

    table.get_by_role("link", name=kept["intent_id"]).click()
    expect(page.get_by_role("heading", level=1)).to_have_text(f"Intent {kept['intent_id']}")
    facts = page.locator("dl.facts").first
    expect(facts).to_contain_text("12.5 USDC")
    expect(facts).to_contain_text("Two mugs")
    expect(facts.get_by_role("link", name=kept["checkout_url"])).to_have_attribute("href", kept["checkout_url"])
    requirements = page.get_by_role("region", name="Requirements by network")
    expect(requirements.get_by_role("row")).to_have_count(2)
    expect(requirements).to_contain_text(address)
    expect(requirements).to_contain_text(evm["network"])

    page.go_back()
    page.get_by_role("link", name="Clear filters").click()
    table.get_by_role("link", name=dropped["intent_id"]).click()
    expect(page.get_by_text("this intent is cancelled and accepts no payment")).to_be_visible()
    expect(page.get_by_role("link", name=dropped["checkout_url"])).to_have_count(0)  # nothing to pay


def test_another_merchants_intent_is_not_found(page: Page, stack: Stack) -> None:
    foreign = stack.create_intent(1)  # the demo merchant's
    sign_up(page)
    response = page.goto(f"/dashboard/intents/{foreign['intent_id']}")
    assert response is not None and response.status == 404
    expect(page.get_by_role("heading", level=1)).to_have_text("Page not found")
    expect(page.get_by_role("link", name="Back to the overview")).to_be_visible()
