"""The intents list (filters, pagination) and detail page."""

from __future__ import annotations

from tests.dashboard.helpers import intent_ids, text
from tests.intents.helpers import URL, create, mark_paid


def test_list_filters_by_status_and_order_id(clock, dashboard, client, merchant):
    pending = create(client, merchant, order_id="order-1")
    clock.advance(seconds=1)
    paid = create(client, merchant, order_id="order-2", amount_usdc=12.5)
    mark_paid(paid["intent_id"])
    clock.advance(seconds=1)
    cancelled = create(client, merchant, order_id="order-1")
    assert client.delete(f"{URL}/{cancelled['intent_id']}", headers=merchant.headers).status_code == 200
    clock.advance(seconds=1)

    everything = text(dashboard.get("/dashboard/intents"))
    assert intent_ids(everything) == [cancelled["intent_id"], paid["intent_id"], pending["intent_id"]]
    assert "12.5 USDC" in everything

    assert intent_ids(text(dashboard.get("/dashboard/intents?status=paid"))) == [paid["intent_id"]]
    assert intent_ids(text(dashboard.get("/dashboard/intents?status=cancelled"))) == [cancelled["intent_id"]]
    assert intent_ids(text(dashboard.get("/dashboard/intents?status=pending"))) == [pending["intent_id"]]
    by_order = text(dashboard.get("/dashboard/intents?order_id=order-1"))
    assert intent_ids(by_order) == [cancelled["intent_id"], pending["intent_id"]]
    assert 'value="order-1"' in by_order  # the filter stays filled in
    both = dashboard.get("/dashboard/intents?status=pending&order_id=order-1")
    assert intent_ids(text(both)) == [pending["intent_id"]]
    assert "No intents match these filters." in text(dashboard.get("/dashboard/intents?order_id=nope"))

    # Expiry shows without waiting for the sweep, as in the API.
    clock.advance(minutes=31)
    assert intent_ids(text(dashboard.get("/dashboard/intents?status=expired"))) == [pending["intent_id"]]
    assert intent_ids(text(dashboard.get("/dashboard/intents?status=pending"))) == []


def test_bad_filters_are_400_with_a_message(dashboard):
    for query, message in [
        ("status=bogus", "Choose a status from the list."),
        ("order_id=" + "x" * 129, "An order ID is 1 to 128 characters."),
        ("page=0", "The page number must be a whole number"),
        ("page=abc", "The page number must be a whole number"),
    ]:
        response = dashboard.get(f"/dashboard/intents?{query}")
        assert response.status_code == 400, query
        assert message in text(response), query


def test_pagination(clock, dashboard, client, merchant):
    created = []
    for n in range(23):
        created.append(create(client, merchant, order_id=f"o-{n}")["intent_id"])
        clock.advance(seconds=1)
    newest_first = list(reversed(created))
    first = text(dashboard.get("/dashboard/intents"))
    assert intent_ids(first) == newest_first[:20]
    assert "Showing 1&ndash;20 of 23" in first
    assert 'href="/dashboard/intents?page=2"' in first
    second = text(dashboard.get("/dashboard/intents?page=2"))
    assert intent_ids(second) == newest_first[20:]
    assert "Page 2 of 2" in second and "Next page" not in second
    assert intent_ids(text(dashboard.get("/dashboard/intents?page=3"))) == []
    # Filters are kept across pages.
    filtered = text(dashboard.get("/dashboard/intents?status=pending"))
    assert 'href="/dashboard/intents?page=2&amp;status=pending"' in filtered


def test_detail_page_of_a_paid_intent(clock, dashboard, client, merchant):
    intent = create(
        client, merchant, amount_usdc=10.5, order_id="order-1001", description="Two mugs", metadata={"customer": "c_42"}
    )
    pending_page = text(dashboard.get(f"/dashboard/intents/{intent['intent_id']}"))
    assert intent["checkout_url"] in pending_page and "Not paid" in pending_page
    clock.advance(minutes=3, seconds=7)
    mark_paid(intent["intent_id"])
    response = dashboard.get(f"/dashboard/intents/{intent['intent_id']}")
    assert response.status_code == 200
    page = text(response)
    assert "10.5 USDC" in page and "order-1001" in page and "Two mugs" in page and "c_42" in page
    assert "badge-paid" in page
    assert "0x" + "ab" * 32 in page  # tx hash
    assert "0x" + "11" * 20 in page  # buyer
    assert "eip155:84532" in page  # chain
    assert "https://sepolia.basescan.org/tx/0x" + "ab" * 32 in page  # explorer link from the chains file
    assert '<time datetime="2026-11-22T12:03:07.000Z">2026-11-22 12:03:07 UTC</time>' in page  # paid_at
    for requirement in intent["payment_requirements"]:  # every requirement: network, payTo, asset
        assert requirement["network"] in page and requirement["payTo"] in page and requirement["asset"] in page
    assert "Base Sepolia" in page and "Solana Devnet" in page
