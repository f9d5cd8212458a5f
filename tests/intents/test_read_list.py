"""GET one intent and list intents: the merchant sees only its own."""

from __future__ import annotations

import pytest
from sqlalchemy import update

from backend.extensions import db
from backend.intents.models import Intent
from tests.intents.helpers import URL, create, mark_paid


def test_read_returns_the_full_intent(client, merchant):
    created = create(client, merchant, order_id="o-1", metadata={"a": "b"})
    response = client.get(f"{URL}/{created['intent_id']}", headers=merchant.headers)
    assert response.status_code == 200
    data = response.get_json()["data"]
    assert data == created
    assert data["tx_hash"] is None and data["paid_at"] is None


def test_read_of_a_paid_intent_holds_the_paid_fields(client, merchant, clock):
    created = create(client, merchant, order_id="o-2")
    mark_paid(created["intent_id"])
    data = client.get(f"{URL}/{created['intent_id']}", headers=merchant.headers).get_json()["data"]
    assert data["status"] == "paid"
    assert data["tx_hash"] == "0x" + "ab" * 32
    assert data["buyer_address"] and data["chain"] == "eip155:84532"
    assert data["paid_at"].endswith("Z")
    for field in ("intent_id", "amount_usdc", "order_id", "expires_at"):
        assert field in data


# A well-formed id that names no intent; a literal, so that every pytest-xdist worker collects the same test ids.
UNKNOWN_ID = "5b0f8a3c-2d7e-4c1a-9f64-8e2b7d13c0a5"


@pytest.mark.parametrize(
    "intent_id", ["nope", "1", UNKNOWN_ID, "00000000-0000-0000-0000-00000000000g", "../../etc/passwd", "x" * 300]
)
def test_unknown_or_malformed_id_is_404(client, merchant, intent_id):
    response = client.get(f"{URL}/{intent_id}", headers=merchant.headers)
    assert response.status_code == 404
    assert response.get_json()["error"]["code"] == "NOT_FOUND"


def test_another_merchants_intent_is_404_everywhere(client, merchant, other_merchant):
    theirs = create(client, other_merchant, order_id="secret")
    assert client.get(f"{URL}/{theirs['intent_id']}", headers=merchant.headers).status_code == 404
    assert client.delete(f"{URL}/{theirs['intent_id']}", headers=merchant.headers).status_code == 404
    listing = client.get(f"{URL}?order_id=secret", headers=merchant.headers).get_json()["data"]
    assert listing["total"] == 0 and listing["intents"] == []
    still = client.get(f"{URL}/{theirs['intent_id']}", headers=other_merchant.headers).get_json()["data"]
    assert still["status"] == "pending"


def test_list_is_newest_first_with_total_limit_offset(client, merchant, clock):
    ids = []
    for i in range(25):
        ids.append(create(client, merchant, order_id=f"o-{i % 3}")["intent_id"])
        clock.advance(seconds=1)
    page = client.get(URL, headers=merchant.headers).get_json()["data"]
    assert page["total"] == 25 and page["limit"] == 20 and page["offset"] == 0
    assert [i["intent_id"] for i in page["intents"]] == ids[::-1][:20]
    page2 = client.get(f"{URL}?limit=10&offset=20", headers=merchant.headers).get_json()["data"]
    assert [i["intent_id"] for i in page2["intents"]] == ids[::-1][20:]
    assert page2["total"] == 25
    beyond = client.get(f"{URL}?offset=100", headers=merchant.headers).get_json()["data"]
    assert beyond["intents"] == [] and beyond["total"] == 25
    by_order = client.get(f"{URL}?order_id=o-1&limit=100", headers=merchant.headers).get_json()["data"]
    assert by_order["total"] == 8
    assert {i["order_id"] for i in by_order["intents"]} == {"o-1"}


def test_list_filters_by_status(client, merchant):
    a = create(client, merchant)["intent_id"]
    b = create(client, merchant)["intent_id"]
    create(client, merchant)
    mark_paid(a)
    client.delete(f"{URL}/{b}", headers=merchant.headers)
    for status, expected in (("paid", [a]), ("cancelled", [b])):
        page = client.get(f"{URL}?status={status}", headers=merchant.headers).get_json()["data"]
        assert [i["intent_id"] for i in page["intents"]] == expected
    assert client.get(f"{URL}?status=pending", headers=merchant.headers).get_json()["data"]["total"] == 1


def test_totals_follow_the_filters_on_every_page(client, merchant, other_merchant, clock):
    """The total counts what the filters match (the computed expired status included), not the page."""
    paid = create(client, merchant, order_id="o-a")["intent_id"]
    cancelled = create(client, merchant, order_id="o-a")["intent_id"]
    held = create(client, merchant, order_id="o-b")["intent_id"]
    overdue = create(client, merchant, order_id="o-b")["intent_id"]
    swept = create(client, merchant)["intent_id"]
    clock.advance(minutes=20)
    fresh = [create(client, merchant)["intent_id"] for _ in range(2)]
    create(client, other_merchant, order_id="o-a")
    mark_paid(paid)
    client.delete(f"{URL}/{cancelled}", headers=merchant.headers)
    db.session.execute(update(Intent).where(Intent.id == held).values(settlement_id="stl_held"))
    db.session.execute(update(Intent).where(Intent.id == swept).values(status="expired"))
    db.session.commit()
    clock.advance(minutes=15)  # the first five are past their expiry; only `swept` was written as expired
    expected = {
        "": {fresh[1], fresh[0], swept, overdue, held, cancelled, paid},
        "status=pending": {fresh[1], fresh[0], held},
        "status=expired": {overdue, swept},
        "status=paid": {paid},
        "status=cancelled": {cancelled},
        "order_id=o-a": {paid, cancelled},
        "order_id=o-b&status=expired": {overdue},
        "order_id=o-b&status=pending": {held},
        "order_id=nope": set(),
    }
    for query, ids in expected.items():
        seen = []
        for offset in range(0, len(ids) + 2):
            page = client.get(f"{URL}?{query}&limit=1&offset={offset}", headers=merchant.headers).get_json()["data"]
            assert page["total"] == len(ids), (query, offset)
            assert len(page["intents"]) == (1 if offset < len(ids) else 0), (query, offset)
            seen += [i["intent_id"] for i in page["intents"]]
        assert set(seen) == ids and len(seen) == len(ids), query


def test_pages_of_intents_created_in_the_same_instant_neither_repeat_nor_skip(client, merchant, clock):
    """Ties on created_at are ordered by id, descending, the same way on every page."""
    ids = [create(client, merchant)["intent_id"] for _ in range(7)]  # the frozen clock: one created_at
    pages = [
        client.get(f"{URL}?limit=3&offset={offset}", headers=merchant.headers).get_json()["data"]
        for offset in (0, 3, 6)
    ]
    assert [i["intent_id"] for p in pages for i in p["intents"]] == sorted(ids, reverse=True)
    assert {p["total"] for p in pages} == {7}


@pytest.mark.parametrize(
    "query",
    [
        "limit=0",
        "limit=101",
        "limit=abc",
        "limit=1.5",
        "offset=-1",
        "offset=x",
        "status=done",
        "status=",
        "order_id=",
        "colour=red",
    ],
)
def test_bad_list_parameters_are_400(client, merchant, query):
    response = client.get(f"{URL}?{query}", headers=merchant.headers)
    assert response.status_code == 400, response.data
    body = response.get_json()
    assert body["error"]["code"] == "VALIDATION_ERROR"
    assert body["error"]["fields"]


def test_limit_100_is_allowed(client, merchant):
    response = client.get(f"{URL}?limit=100", headers=merchant.headers)
    assert response.status_code == 200
    assert response.get_json()["data"]["limit"] == 100
