"""Payment links in a real browser, against `payintent dev`: a merchant creates a link in the dashboard, a buyer
opening it lands on a fresh intent's checkout (a second visit, another intent), a link previewer gets the link's
page without an intent (its "Continue to payment" button makes one), and once the merchant deactivates it the link
shows a page saying so and makes no intent."""

from __future__ import annotations

import re

from eth_account import Account
from playwright.sync_api import Page, expect

from e2e.conftest import Shot, Stack
from e2e.test_dashboard import _flash, _networks, confirm_paste, go, sign_up


def test_a_payment_link_is_created_opened_twice_and_deactivated(page: Page, stack: Stack, shot: Shot) -> None:
    merchant = sign_up(page)
    evm = next(n for n in _networks(stack) if n["kind"] == "evm")
    go(page, "Wallets")
    card = page.get_by_role("listitem").filter(has=page.get_by_role("heading", name=evm["name"], exact=True))
    card.get_by_label(f"Wallet address on {evm['name']}").fill(Account.create().address)
    confirm_paste(card, evm["name"])
    card.get_by_role("button", name="Save wallet").click()
    expect(_flash(page)).to_contain_text("New intents pay")

    go(page, "Payment links")
    page.get_by_label("Amount (USDC)").fill("4.20")
    page.get_by_label("Description").fill("Poster, A2")
    page.get_by_role("button", name="Create link").click()
    expect(_flash(page)).to_contain_text("Payment link created")
    row = page.get_by_role("row").filter(has_text="Poster, A2")
    expect(row).to_contain_text("4.2 USDC")
    expect(row).to_contain_text("active")
    url = row.get_by_role("link").get_attribute("href")
    assert url is not None and re.search(r"/l/pl_[0-9a-f]{32}$", url), url
    shot(page, "links")

    checkouts = []
    for _ in range(2):
        buyer = page.context.new_page()
        buyer.goto(url)
        expect(buyer).to_have_url(re.compile(r"/pay/[0-9a-f-]{36}$"))
        expect(buyer.get_by_test_id("amount")).to_have_text("4.20")
        expect(buyer.get_by_text("Poster, A2")).to_be_visible()
        checkouts.append(buyer.url)
        buyer.close()
    assert checkouts[0] != checkouts[1]  # each visit, its own intent

    # A link previewer's view (by its User-Agent): the link's page, no intent; its button makes one.
    preview = page.context.browser.new_context(user_agent="Slackbot-LinkExpanding 1.0 (+https://api.slack.com/robots)")
    previewed = preview.new_page()
    previewed.goto(url)
    expect(previewed.get_by_role("heading", level=1)).to_have_text("Poster, A2")
    expect(previewed.get_by_text("4.2 USDC")).to_be_visible()
    shot(previewed, "link-page")
    assert stack.api("GET", "/x402/intents", key=merchant.first_key).json()["data"]["total"] == 2
    previewed.get_by_role("button", name="Continue to payment").click()
    expect(previewed).to_have_url(re.compile(r"/pay/[0-9a-f-]{36}$"))
    expect(previewed.get_by_test_id("amount")).to_have_text("4.20")
    preview.close()
    listed = stack.api("GET", "/x402/intents", key=merchant.first_key).json()["data"]
    link_id = url.rsplit("/", 1)[1]
    assert [i["payment_link_id"] for i in listed["intents"]] == [link_id] * 3

    row.get_by_role("button", name="Deactivate Poster, A2").click()
    expect(_flash(page)).to_contain_text("makes no more intents")
    expect(page.get_by_role("row").filter(has_text="Poster, A2")).to_contain_text("deactivated")
    buyer = page.context.new_page()
    response = buyer.goto(url)
    assert response is not None and response.status == 410
    expect(buyer.get_by_role("heading", level=1)).to_have_text("Payment link no longer active")
    shot(buyer, "deactivated")
    buyer.close()
    assert stack.api("GET", "/x402/intents", key=merchant.first_key).json()["data"]["total"] == 3
