"""The intents page's "Export CSV" in a real browser, against `payintent dev`: the button carries the page's
filters, and the file downloaded is those intents' CSV (header, values, a formula-looking cell escaped)."""

from __future__ import annotations

import csv
import re
import uuid

from eth_account import Account
from playwright.sync_api import Page, expect

from e2e.conftest import Shot, Stack
from e2e.test_dashboard import _flash, _networks, confirm_paste, go, sign_up

HEADER = [
    "intent_id", "status", "amount_usdc", "chain", "tx_hash", "buyer_address", "created_at", "paid_at",
    "expires_at", "order_id", "description", "payment_link_id", "metadata", "refunded_usdc",
]  # fmt: skip


def test_export_csv_downloads_the_filtered_intents(page: Page, stack: Stack, shot: Shot) -> None:
    merchant = sign_up(page)
    go(page, "Wallets")
    evm = _networks(stack)[0]
    page.get_by_label(f"Wallet address on {evm['name']}").fill(Account.create().address)
    confirm_paste(page, evm["name"])
    page.get_by_role("button", name="Save wallet").first.click()
    expect(_flash(page)).to_contain_text("Saved, unverified.")

    tag = uuid.uuid4().hex[:8]
    key = merchant.first_key
    kept = stack.create_intent(
        12.5, key=key, order_id=f"order-{tag}", description="=HYPERLINK(\"http://evil.example\")",
        metadata={"customer": "c_42"},
    )  # fmt: skip
    other = stack.create_intent(7, key=key, order_id=f"other-{tag}")
    dropped = stack.create_intent(1.25, key=key)
    cancel = stack.api("DELETE", f"/x402/intents/{dropped['intent_id']}", key=key)
    assert cancel.status_code == 200, cancel.text

    go(page, "Intents")
    page.get_by_label("Status").select_option("pending")
    page.get_by_role("button", name="Filter").click()
    expect(page).to_have_url(re.compile(r"status=pending"))
    export = page.get_by_role("link", name="Export CSV")
    expect(export).to_have_attribute("href", "/dashboard/intents/export.csv?status=pending")
    shot(page, "filtered")

    with page.expect_download() as started:
        export.click()
    download = started.value
    assert re.fullmatch(r"intents-\d{4}-\d{2}-\d{2}\.csv", download.suggested_filename), download.suggested_filename
    assert download.failure() is None
    with open(download.path(), newline="", encoding="utf-8") as file:
        table = list(csv.reader(file))

    assert table[0] == HEADER
    rows = {row[0]: dict(zip(HEADER, row, strict=True)) for row in table[1:]}
    assert list(rows) == [other["intent_id"], kept["intent_id"]]  # pending only, newest first
    row = rows[kept["intent_id"]]
    assert row["status"] == "pending"
    assert row["amount_usdc"] == "12.5"
    assert row["order_id"] == f"order-{tag}"
    assert row["description"] == '\'=HYPERLINK("http://evil.example")'  # a spreadsheet shows it, never runs it
    assert row["metadata"] == '{"customer":"c_42"}'
    assert row["created_at"] == kept["created_at"] and row["expires_at"] == kept["expires_at"]
    assert (row["tx_hash"], row["paid_at"], row["refunded_usdc"]) == ("", "", "0")
    assert rows[other["intent_id"]]["amount_usdc"] == "7"
    expect(page.get_by_role("heading", level=1)).to_have_text("Payment intents")  # the page stayed
